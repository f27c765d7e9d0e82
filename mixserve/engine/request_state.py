"""What the engine adds to the scheduler's record of a request: params, text, stop checks, times, logprobs.

The scheduler's `Request` (core/request.py) is the one record of a request's tokens: the scheduler
appends each sampled token, and everything here reads them from it (the detokenizer, the stop checks,
the penalties, the updates and the output), so the two can never disagree.
"""

from __future__ import annotations

from mixserve.core.request import Request
from mixserve.engine.detokenizer import Decoder, IncrementalDetokenizer
from mixserve.engine.outputs import RequestMetrics, RequestOutput, RequestUpdate, TokenLogprobs
from mixserve.engine.sampling_params import SamplingParams
from mixserve.engine.structured import RequestGrammar
from mixserve.runner.logits_processors import ProcessorRow
from mixserve.runner.sampler import SamplingRow, row_seed


class RequestState:
    """Follows one request from add_request to its last token, reading its tokens from `record`.

    Text that could be the start of a stop string is held back until it is known not to be one, so
    a streamed delta never has to be taken back.
    """

    def __init__(
        self,
        record: Request,
        params: SamplingParams,
        tokenizer: Decoder,
        eos_token_ids: frozenset[int],
        arrival: float,
    ) -> None:
        self.record = record  # the scheduler's: it appends the tokens, this only reads them
        self.params = params
        eos = frozenset() if params.ignore_eos else eos_token_ids
        self.stop_ids = frozenset(params.stop_token_ids) | eos
        self.detok = IncrementalDetokenizer(tokenizer, record.tokens, record.prompt_len)
        self.logprobs: list[TokenLogprobs] | None = [] if params.logprobs is not None else None
        self.text = ""
        self.emitted = 0  # characters of self.text already handed out in updates
        self.sent_tokens = 0
        self.arrival = arrival
        self.token_times: list[float] = []  # one per token taken: how many of the record's it has taken
        self.finished_at: float | None = None
        self.finish_reason: str | None = None
        self.stopped_by_string = False
        self.grammar: RequestGrammar | None = None  # structured output: set by the engine
        # unseeded and unprocessed (most requests): one SamplingRow for every step, built once
        self._plain_row: SamplingRow | None = None
        if params.seed is None and not params.penalized:
            self._plain_row = SamplingRow(params.temperature, params.top_p, params.top_k, params.min_p, None,
                                          params.logprobs, None)

    @property
    def request_id(self) -> str:
        return self.record.request_id

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.record.tokens[: self.record.prompt_len]

    @property
    def token_ids(self) -> list[int]:
        """The generated tokens taken so far (a copy: the record's list keeps growing)."""
        start = self.record.prompt_len
        return self.record.tokens[start : start + len(self.token_times)]

    @property
    def num_generated(self) -> int:
        return len(self.token_times)

    def take(self, logprobs: TokenLogprobs | None, now: float) -> str | None:
        """Take the next token the scheduler appended to the record (its logprobs, its time); returns
        "stop" if it ends the request (stop token, EOS, stop string, grammar)."""
        token_id = self.record.tokens[self.record.prompt_len + len(self.token_times)]  # IndexError: none
        self.token_times.append(now)
        if self.logprobs is not None and logprobs is not None:
            self.logprobs.append(logprobs)
        if self.grammar is not None and self.grammar.accept(token_id):
            return "stop"  # the grammar has ended (on a stop token): whatever ignore_eos or min_tokens say
        if self.num_generated <= self.params.min_tokens:  # nothing stops it before min_tokens (as vLLM)
            self.text += self.detok.add()
            return None
        if token_id in self.stop_ids:
            return "stop"  # the token stays in token_ids; its text is not added
        old_len = len(self.text)
        self.text += self.detok.add()
        if self.params.stop and len(self.text) > old_len:
            longest = max(len(s) for s in self.params.stop)
            # a stop string may begin in text added by earlier tokens
            begin = max(0, old_len - longest + 1)
            hits = [i for i in (self.text.find(s, begin) for s in self.params.stop) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                self.stopped_by_string = True
                return "stop"
        return None

    def sampling_row(self, draft: tuple[int, ...] = ()) -> SamplingRow:
        """How the sampler treats this request's next token (read before the scheduler appends it), or,
        with `draft`, the token after those drafts (a speculating decode's later rows)."""
        if self._plain_row is not None:  # nothing in the row changes from step to step
            return self._plain_row
        p, tokens = self.params, self.record.tokens
        generated = self.num_generated + len(draft)
        seed = None if p.seed is None else row_seed(p.seed, generated)
        processing = None
        if p.penalized:
            penalties = p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
            # a grammar decides where its output ends: hiding the stop tokens could leave it no token
            hide = generated < p.min_tokens and self.grammar is None
            seen = [*tokens, *draft] if draft else tokens  # the sampler reads it at once
            processing = ProcessorRow(
                p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.logit_bias,
                hidden_ids=tuple(self.stop_ids) if hide else (),
                output_ids=seen[self.record.prompt_len :] if penalties else (),
                seen_ids=seen if p.repetition_penalty != 1.0 else ())
        return SamplingRow(p.temperature, p.top_p, p.top_k, p.min_p, seed, p.logprobs, processing)

    def sampling_rows(self, draft: tuple[int, ...]) -> list[SamplingRow]:
        """The rows of a decode verifying `draft`: row j samples as if drafts[:j] had been taken."""
        return [self.sampling_row(draft[:j]) for j in range(len(draft) + 1)]

    def update(self, finish_reason: str | None, now: float) -> RequestUpdate:
        """The delta since the last update; with a finish reason, the rest of the text and the output."""
        if finish_reason is None:
            end = len(self.text) - self._held_back()
        else:
            if not self.stopped_by_string:
                self.text += self.detok.flush()  # the last tokens may end inside a character
            end = len(self.text)
            self.finish_reason, self.finished_at = finish_reason, now
        new_text = self.text[self.emitted : end]
        self.emitted = max(self.emitted, end)
        taken, start = self.num_generated, self.record.prompt_len
        new_ids = self.record.tokens[start + self.sent_tokens : start + taken]
        new_lps = None if self.logprobs is None else self.logprobs[self.sent_tokens :]
        times = tuple(self.token_times[self.sent_tokens :])
        prev = self.token_times[self.sent_tokens - 1] if self.sent_tokens > 0 else None
        self.sent_tokens = taken
        return RequestUpdate(
            request_id=self.request_id,
            new_token_ids=new_ids,
            new_text=new_text,
            finished=finish_reason is not None,
            finish_reason=finish_reason,
            logprobs=new_lps,
            output=self.output() if finish_reason is not None else None,
            token_times=times,
            prev_token_time=prev,
        )

    def output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            token_ids=self.token_ids,
            text=self.text,
            finish_reason=self.finish_reason,
            metrics=RequestMetrics(
                arrival=self.arrival,
                first_token=self.token_times[0] if self.token_times else None,
                token_times=tuple(self.token_times),
                finished=self.finished_at,
                num_prompt_tokens=len(self.prompt_token_ids),
            ),
            logprobs=None if self.logprobs is None else list(self.logprobs),
        )

    def _held_back(self) -> int:
        """Characters at the end of the text that could begin a stop string."""
        held = 0
        for s in self.params.stop:
            for k in range(min(len(s) - 1, len(self.text)), held, -1):
                if self.text.endswith(s[:k]):
                    held = k
                    break
        return held
