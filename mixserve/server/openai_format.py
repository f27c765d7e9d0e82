"""Engine updates -> OpenAI response bodies: completions, chat completions, their stream chunks, usage."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from mixserve.engine.outputs import RequestUpdate

DONE = "data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


@dataclass
class TokenLogprob:
    """The sampled token's log-probability and the top alternatives (token id -> logprob)."""

    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)


def token_logprobs(update: RequestUpdate) -> list[TokenLogprob]:
    """An update's `TokenLogprobs` records (token_id, logprob, top pairs), one per new token."""
    return [TokenLogprob(e.token_id, e.logprob, dict(e.top)) for e in (update.logprobs or [])]


def _best_first(top: dict[int, float]) -> list[tuple[int, float]]:
    return sorted(top.items(), key=lambda kv: -kv[1])


@dataclass
class Choice:
    """One choice of an answer as it is collected: its text pieces, logprobs and finish reason."""

    texts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None


@dataclass
class Usage:
    """Token counts of one request."""

    prompt_tokens: int
    completion_tokens: int = 0

    def body(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


class Formatter:
    """Builds the bodies of one request (`chat` or text completion); ids and `created` fixed per request."""

    def __init__(self, request_id: str, model: str, chat: bool, tokenizer: Any) -> None:
        self.id = request_id
        self.model = model
        self.chat = chat
        self.tokenizer = tokenizer
        self.created = int(time.time())
        self.text_offsets: dict[int, int] = {}  # per choice: where its next token's text begins
        self._delta_head: str | None = None  # delta_event's fixed start, built at its first use

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _chat_token(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self._token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    def logprobs(self, entries: list[TokenLogprob], index: int = 0) -> dict[str, Any] | None:
        """OpenAI's logprobs object: chat `{"content": [...]}`, completions the four parallel lists."""
        if self.chat:
            content = []
            for e in entries:
                entry = self._chat_token(e.token_id, e.logprob)
                entry["top_logprobs"] = [self._chat_token(k, v) for k, v in _best_first(e.top)]
                content.append(entry)
            return {"content": content}
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        for e in entries:
            text = self._token_text(e.token_id)
            tokens.append(text)
            token_logprobs.append(e.logprob)
            top_logprobs.append({self._token_text(k): v for k, v in _best_first(e.top)})
            offsets.append(self.text_offsets.get(index, 0))
            self.text_offsets[index] = offsets[-1] + len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": offsets}

    # -- whole answers
    def response(self, choices: list[Choice], usage: Usage) -> dict[str, Any]:
        """The whole answer: one entry per choice, in index order."""
        bodies = []
        for i, c in enumerate(choices):
            lp = self.logprobs(c.logprobs, i) if c.logprobs is not None else None
            if self.chat:
                bodies.append({"index": i, "message": {"role": "assistant", "content": "".join(c.texts)},
                               "logprobs": lp, "finish_reason": c.finish_reason})
            else:
                bodies.append({"index": i, "text": "".join(c.texts), "logprobs": lp,
                               "finish_reason": c.finish_reason})
        obj = "chat.completion" if self.chat else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": bodies, "usage": usage.body()}

    # -- stream chunks
    def _chunk(self, choices: list[dict[str, Any]], usage: Usage | None = None) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        body: dict[str, Any] = {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                                "choices": choices}
        if usage is not None:
            body["usage"] = usage.body()
        return body

    def role_chunk(self, usage: Usage | None = None, index: int = 0) -> dict[str, Any]:
        """Chat streams open each choice with the assistant's role."""
        return self._chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}], usage)

    def delta_chunk(self, text: str, finish_reason: str | None, logprobs: list[TokenLogprob] | None,
                    usage: Usage | None = None, index: int = 0) -> dict[str, Any]:
        """One step's text of choice `index`; `usage` (the counts so far) with `continuous_usage_stats`."""
        lp = self.logprobs(logprobs, index) if logprobs is not None else None
        if self.chat:
            delta = {} if finish_reason is not None and not text else {"content": text}
            choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": finish_reason}
        return self._chunk([choice], usage)

    def delta_event(self, text: str, finish_reason: str | None, logprobs: list[TokenLogprob] | None,
                    usage: Usage | None = None, index: int = 0) -> str:
        """`sse(delta_chunk(...))`, byte for byte. The common chunk (text only: no finish, logprobs or
        usage) is the request's fixed JSON around the text's own `json.dumps`, cheaper than dumping the
        whole dict: the event loop formats one per stream per step (docs/decisions/host-cost-per-row.md)."""
        if finish_reason is not None or logprobs is not None or usage is not None:
            return sse(self.delta_chunk(text, finish_reason, logprobs, usage, index))
        if self._delta_head is None:
            obj = "chat.completion.chunk" if self.chat else "text_completion"
            self._delta_head = (f"data: {{\"id\": {json.dumps(self.id, ensure_ascii=False)}, \"object\": "
                                f"\"{obj}\", \"created\": {self.created}, \"model\": "
                                f"{json.dumps(self.model, ensure_ascii=False)}, \"choices\": [{{\"index\": ")
        field = "\"delta\": {\"content\": " if self.chat else "\"text\": "
        close = "}" if self.chat else ""
        return (f"{self._delta_head}{index}, {field}{json.dumps(text, ensure_ascii=False)}{close}, "
                f"\"logprobs\": null, \"finish_reason\": null}}]}}\n\n")

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        """The last chunk of a stream with `include_usage`: no choices, only the counts."""
        return self._chunk([], usage)
