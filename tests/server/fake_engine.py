"""A model-free LLMEngine for the server's unit tests: one token per request per step, no torch.

Token t decodes to the character chr(ord('a') + t % 26); the "model" answers token (last + 1) % 26.
`gate` (a threading.Event) makes step() wait, so a test can hold requests in flight; `crash` makes the
next step raise, as a broken model would.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from mixserve.core.stats import EngineStats, SchedulerStats
from mixserve.engine.outputs import RequestUpdate, TokenLogprobs

EOS = 26


class FakeRequestError(ValueError):
    """As LLMEngine.validate raises: a ValueError naming the param."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class FakeTokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [(ord(c) - ord("a")) % 26 for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + t % 26) for t in ids if t != EOS)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        return self.encode(self.render_chat(messages, add_generation_prompt))

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return "".join(m["role"][0] + m["content"] for m in messages)

    encode_releasing_gil = encode
    max_token_bytes = 1

    eos_token_ids = frozenset({EOS})


@dataclass
class _Req:
    tokens: list[int]
    params: Any
    blocks: int
    generated: list[int] = field(default_factory=list)
    last_time: float | None = None  # the engine's clock at its last token


class FakeEngine:
    """Enough of LLMEngine for AsyncEngine and the app: validate, add_request, step, abort, stats."""

    def __init__(self, num_blocks: int = 64, block_size: int = 4, max_model_len: int = 128,
                 max_num_seqs: int = 4) -> None:
        self.tokenizer = FakeTokenizer()
        self.runner = SimpleNamespace(model_name="fake-model", num_blocks=num_blocks, block_size=block_size,
                                      max_model_len=max_model_len, config=SimpleNamespace(vocab_size=27))
        self.max_num_seqs = max_num_seqs
        self.gate: threading.Event | None = None
        self.crash = False
        self.hold_back_text = False  # as a detokenizer holding an unfinished character: text only at the end
        self.steps = 0
        self.last_step_tokens = 0
        self.prompt_tokens_total = self.generation_tokens_total = 0  # as LLMEngine's: /metrics reads them
        self._lock = threading.Lock()  # the tests read the tables from their own thread
        self.waiting: dict[str, _Req] = {}
        self.running: dict[str, _Req] = {}
        self.added: list[str] = []
        self.aborted: list[str] = []

    model_name = "fake-model"

    @property
    def context_limit(self) -> int:
        return min(self.runner.max_model_len, self.runner.num_blocks * self.runner.block_size)

    def validate(self, prompt_token_ids: list[int], params: Any) -> None:
        if any(not 0 <= t < self.runner.config.vocab_size for t in prompt_token_ids):
            raise FakeRequestError("prompt: a token id is outside the vocabulary", "prompt")
        if len(prompt_token_ids) + params.max_tokens > self.runner.max_model_len:
            raise FakeRequestError("prompt + max_tokens is over the context", "max_tokens")

    def add_request(self, request_id: str, prompt: list[int], params: Any,
                    arrival: float | None = None) -> None:
        with self._lock:
            if request_id in self.waiting or request_id in self.running:
                raise ValueError(f"duplicate request id {request_id}")
            self.waiting[request_id] = _Req(list(prompt), params, 0)
            self.added.append(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self.waiting.pop(request_id, None)
            if self.running.pop(request_id, None) is not None:
                self.aborted.append(request_id)

    def step(self) -> list[RequestUpdate]:
        if self.gate is not None:
            self.gate.wait()
        if self.crash:
            raise RuntimeError("the model broke")
        self.steps += 1
        updates = []
        with self._lock:
            while self.waiting and len(self.running) < self.max_num_seqs:
                rid, req = next(iter(self.waiting.items()))
                del self.waiting[rid]
                self.running[rid] = req
            self.last_step_tokens = len(self.running)
            for rid, req in list(self.running.items()):
                token = (req.tokens[-1] + 1) % 26
                req.tokens.append(token)
                req.generated.append(token)
                self.generation_tokens_total += 1
                if len(req.generated) == 1:
                    self.prompt_tokens_total += len(req.tokens) - 1
                req.blocks = math.ceil(len(req.tokens) / self.runner.block_size)
                done = len(req.generated) >= req.params.max_tokens
                lp = None
                if req.params.logprobs is not None:
                    top = tuple((token + i, -0.5 - i) for i in range(req.params.logprobs))
                    lp = [TokenLogprobs(token, -0.5, top)]
                if done:
                    del self.running[rid]
                text = self.tokenizer.decode([token])
                if self.hold_back_text:
                    text = self.tokenizer.decode(req.generated) if done else ""
                now = time.monotonic()
                updates.append(RequestUpdate(rid, [token], text, done, "length" if done else None, lp, None,
                                             token_times=(now,), prev_token_time=req.last_time))
                req.last_time = now
        return updates

    def stats(self) -> EngineStats:
        with self._lock:
            used = sum(r.blocks for r in self.running.values())
            scheduler = SchedulerStats(len(self.running), len(self.waiting), self.runner.num_blocks,
                                       self.runner.num_blocks - used, 0, self.last_step_tokens, 0)
            return EngineStats(scheduler, self.steps, self.prompt_tokens_total, self.generation_tokens_total,
                               num_preemptions_total=0)


def make_app(fake: FakeEngine | None = None, *, max_engine_restarts: int = 3, **server_cfg: Any) -> Any:
    """The server's app over a FakeEngine (a fresh one if None); `server_cfg` are [server] keys."""
    from mixserve.config import ServerConfig
    from mixserve.engine.async_engine import AsyncEngine
    from mixserve.server import create_app

    engine = AsyncEngine(fake if fake is not None else FakeEngine(), max_engine_restarts=max_engine_restarts)
    return create_app(engine, ServerConfig(**server_cfg))
