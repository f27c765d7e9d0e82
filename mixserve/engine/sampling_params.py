"""SamplingParams: how one request picks its tokens and when it stops."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from mixserve.runner.sampler import GREEDY_BELOW

MAX_LOGPROBS = 20  # what OpenAI's API allows for top_logprobs


@dataclass(frozen=True)
class SamplingParams:
    """Sampling and stopping for one request; invalid values raise ValueError naming the field.

    temperature 0 is greedy; top_k 0 (or -1) and top_p 1 and min_p 0 are off. `stop` strings end the
    text before them (found across token boundaries); `stop_token_ids` and EOS (unless `ignore_eos`) end
    the request with that token last in `token_ids`. `logprobs=k` returns, per generated token, its own
    log-probability and the top k of the model's distribution.
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
