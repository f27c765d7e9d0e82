"""What the engine hands back: per-step deltas (RequestUpdate) and finished results (RequestOutput)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenLogprobs:
    """One generated token's log-probability and the top-k of the model's distribution at that step."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, log-probability), most likely first


@dataclass(frozen=True)
class RequestMetrics:
    """Per-request times in seconds from time.monotonic(): arrival, first token, each token, finished."""

    arrival: float
    first_token: float | None
    token_times: tuple[float, ...]
    finished: float | None
    num_prompt_tokens: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def tpot(self) -> float | None:
        """Mean gap between consecutive tokens (None with fewer than two tokens)."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)


@dataclass(frozen=True)
class RequestOutput:
    """A finished request: its prompt and generated token ids, text, why it stopped, and its times."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None  # "length" (max_tokens reached) | "stop" (EOS, stop token or stop string)
    metrics: RequestMetrics
    logprobs: list[TokenLogprobs] | None = None
    index: int = 0  # which choice of its request this is (SamplingParams.n)
    other_choices: tuple[RequestOutput, ...] = field(default=(), repr=False)

    @property
    def choices(self) -> list[RequestOutput]:
        """Every choice of the request, in index order; this output is choice 0 (n = 1: just itself)."""
        return [self, *self.other_choices]


@dataclass(frozen=True)
class RequestUpdate:
    """One step's delta for one request; `output` is the full RequestOutput once `finished`."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    logprobs: list[TokenLogprobs] | None
    output: RequestOutput | None
    index: int = 0  # the choice this delta belongs to (SamplingParams.n > 1)
    request_done: bool | None = None  # every choice has finished; None: the same as `finished`
    # the engine's clock (time.monotonic) for the new tokens, and for the token before them (None: these
    # begin the choice): the one clock the server's metrics read
    token_times: tuple[float, ...] = ()
    prev_token_time: float | None = None

    def __post_init__(self) -> None:
        if self.request_done is None:
            object.__setattr__(self, "request_done", self.finished)
