"""SamplingParams: how one request picks its tokens and when it stops."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from mixserve.runner.sampler import GREEDY_BELOW

MAX_LOGPROBS = 20  # what OpenAI's API allows for top_logprobs
MAX_CHOICES = 128  # OpenAI's limit on n
MAX_PENALTY = 2.0  # OpenAI's range for presence_penalty and frequency_penalty: [-2, 2]
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values: [-100, 100]
STRUCTURED_KINDS = ("json_object", "json_schema", "regex", "choice")


@dataclass(frozen=True)
class StructuredOutput:
    """A grammar the output must follow: `json_object` (any JSON object; `spec` empty), `json_schema`
    (`spec` the schema as JSON text), `regex` (`spec` the pattern) or `choice` (`choices`: one of them)."""

    kind: str
    spec: str = ""
    choices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured_output: kind must be one of {', '.join(STRUCTURED_KINDS)}, "
                             f"got {self.kind!r}")
        if self.kind == "json_schema":
            try:
                json.loads(self.spec)
            except ValueError as exc:
                raise ValueError(f"structured_output: the schema is not JSON ({exc})") from None
        if self.kind == "regex" and not self.spec:
            raise ValueError("structured_output: the regex is empty")
        choices_ok = bool(self.choices) and all(isinstance(c, str) and c for c in self.choices)
        if self.kind == "choice" and not choices_ok:
            raise ValueError("structured_output: choices must be non-empty strings")
        object.__setattr__(self, "choices", tuple(self.choices))


@dataclass(frozen=True)
class SamplingParams:
    """Sampling and stopping for one request; invalid values raise ValueError naming the field.

    temperature 0 is greedy; top_k 0 (or -1) and top_p 1 and min_p 0 are off. `stop` strings end the
    text before them (found across token boundaries); `stop_token_ids` and EOS (unless `ignore_eos`) end
    the request with that token last in `token_ids`. `logprobs=k` returns, per generated token, its own
    log-probability and the top k of the model's distribution.

    Logits processing, batched in the sampler: `presence_penalty` and `frequency_penalty` (OpenAI's
    definitions, over the generated tokens) subtract `presence * (count > 0) + frequency * count`;
    `repetition_penalty` (HF's, over prompt and generated tokens) divides a positive logit by it and
    multiplies a negative one; `logit_bias` adds its value to a token's logit; `min_tokens` hides EOS and
    the stop tokens until that many tokens are out. `structured_output` constrains every token to a
    grammar; a grammar that has ended ends the request, whatever `ignore_eos` or `min_tokens` say.
    `n` choices share the prompt: choice i samples with seed + i (engine/choices.py).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | Sequence[str] | None = None
    ignore_eos: bool = False
    min_p: float = 0.0
    stop_token_ids: Sequence[int] | None = None
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] | None = None
    min_tokens: int = 0
    structured_output: StructuredOutput | None = None
    n: int = 1

    def __post_init__(self) -> None:
        _check_int("max_tokens", self.max_tokens, low=1)
        _check_float("temperature", self.temperature, low=0.0)
        _check_float("top_p", self.top_p, low=0.0, high=1.0)
        if self.top_p == 0.0:
            raise ValueError("top_p: must be in (0, 1], got 0")
        _check_int("top_k", self.top_k, low=-1)
        _check_float("min_p", self.min_p, low=0.0, high=1.0)
        if self.seed is not None:
            _check_int("seed", self.seed, low=0)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos: must be a bool, got {self.ignore_eos!r}")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, low=0, high=MAX_LOGPROBS)
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop: must be non-empty strings, got {self.stop!r}")
        ids = tuple(self.stop_token_ids or ())
        for t in ids:
            _check_int("stop_token_ids", t, low=0)
        # normalised forms: a tuple of strings and a tuple of ints (hashable, as a frozen dataclass should be)
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", ids)
        _check_float("presence_penalty", self.presence_penalty, low=-MAX_PENALTY, high=MAX_PENALTY)
        _check_float("frequency_penalty", self.frequency_penalty, low=-MAX_PENALTY, high=MAX_PENALTY)
        _check_float("repetition_penalty", self.repetition_penalty, low=0.0)
        if self.repetition_penalty == 0.0:
            raise ValueError("repetition_penalty: must be > 0, got 0")
        bias = dict(self.logit_bias or {})
        for token, value in bias.items():
            _check_int("logit_bias", token, low=0)
            _check_float("logit_bias", value, low=-MAX_LOGIT_BIAS, high=MAX_LOGIT_BIAS)
        _check_int("min_tokens", self.min_tokens, low=0, high=self.max_tokens)
        _check_int("n", self.n, low=1, high=MAX_CHOICES)
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutput):
            raise ValueError(f"structured_output: expected StructuredOutput, got {self.structured_output!r}")
        # a tuple of (token, bias) pairs: hashable, as a frozen dataclass should be
        object.__setattr__(self, "logit_bias", tuple(sorted(bias.items())))

    @property
    def penalized(self) -> bool:
        """True when any logits processing (penalties, bias, min_tokens) applies."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0 or bool(self.logit_bias) or self.min_tokens > 0)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def _check_int(name: str, value: object, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}: must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in {low}..{high}"
        raise ValueError(f"{name}: must be {bound}, got {value}")


def _check_float(name: str, value: object, low: float, high: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name}: must be a finite number, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name}: must be {bound}, got {value}")
