"""LLM: the offline API — generate a list of prompts and get the outputs back in prompt order."""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Sequence
from typing import Any

from mixserve.config import load_config
from mixserve.engine.llm_engine import LLMEngine
from mixserve.engine.outputs import RequestOutput
from mixserve.engine.sampling_params import SamplingParams

# Runs of fewer requests than this finish too quickly for a progress bar to help.
PROGRESS_MIN_REQUESTS = 8


class LLM:
    """Loads a model once and runs batches of prompts through the continuous-batching engine.

    `engine_options` are the [engine] keys of runtime.toml (prefill_chunk=64, dtype="bfloat16", ...);
    a bad key or value raises ConfigError (a ValueError) naming it.
    """

    def __init__(self, model: str | None = None, **engine_options: Any) -> None:
        options = dict(engine_options)
        if model is not None:
            options["model"] = str(model)
        self._attach(LLMEngine.from_config(load_config(None, {"engine": options}).engine))

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        """An LLM over an engine built elsewhere (e.g. several engines sharing one loaded runner)."""
        llm = cls.__new__(cls)
        llm._attach(engine)
        return llm

    def _attach(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.cfg = engine.cfg
        self.tokenizer = engine.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs in prompt order.

        `params` is one SamplingParams for all prompts or one per prompt (None = the defaults). Every
        request is checked before any runs, so a bad one raises RequestError and nothing is generated.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if params is None:
            params = SamplingParams()
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"params: got {len(per_prompt)} SamplingParams for {len(prompts)} prompts")
        encoded = [self._encode(p) for p in prompts]
        for ids, p in zip(encoded, per_prompt, strict=True):
            self.engine.validate(ids, p)
        order: dict[str, int] = {}
        for i, (ids, p) in enumerate(zip(encoded, per_prompt, strict=True)):
            rid = f"offline-{next(self._ids)}"
            order[rid] = i
            self.engine.add_request(rid, ids, p)
        return self._run(order, use_tqdm)

    def _encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        return [int(t) for t in prompt]

    def _run(self, order: dict[str, int], use_tqdm: bool) -> list[RequestOutput]:
        outputs: list[RequestOutput | None] = [None] * len(order)
        bar = _progress_bar(len(order)) if use_tqdm else None
        start, num_tokens = time.monotonic(), 0
        try:
            while self.engine.has_unfinished():
                updates = self.engine.step()
                if not updates and self.engine.stats().step_tokens == 0:
                    raise RuntimeError("the scheduler scheduled nothing while requests are unfinished")
                for update in updates:
                    num_tokens += len(update.new_token_ids)
                    if update.output is not None and update.request_id in order:
                        outputs[order[update.request_id]] = update.output
                        if bar is not None:
                            bar.set_postfix_str(f"{num_tokens / (time.monotonic() - start):.1f} output tok/s")
                            bar.update(1)
        except BaseException:
            for rid in order:  # e.g. Ctrl-C: leave the engine empty for the next call
                self.engine.abort(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [o for o in outputs if o is not None]


def _progress_bar(total: int) -> Any:
    """A tqdm bar on stderr for long runs; None when stderr is not a terminal or the run is short."""
    if total < PROGRESS_MIN_REQUESTS or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="requests", unit="req", file=sys.stderr)
