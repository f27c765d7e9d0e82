"""The engine's record of one request: params, detokenized text, stop checks, times and logprobs."""

from __future__ import annotations

from mixserve.engine.detokenizer import Decoder, IncrementalDetokenizer
from mixserve.engine.outputs import RequestMetrics, RequestOutput, RequestUpdate, TokenLogprobs
from mixserve.engine.sampling_params import SamplingParams
from mixserve.engine.structured import RequestGrammar
from mixserve.runner.logits_processors import ProcessorRow
from mixserve.runner.sampler import SamplingRow, row_seed


class RequestState:
    """Follows one request from add_request to its last token.

    Text that could be the start of a stop string is held back until it is known not to be one, so
    a streamed delta never has to be taken back.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer: Decoder,
        eos_token_ids: frozenset[int],
        arrival: float,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        eos = frozenset() if params.ignore_eos else eos_token_ids
        self.stop_ids = frozenset(params.stop_token_ids) | eos
        self.detok = IncrementalDetokenizer(tokenizer, prompt_token_ids)
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprobs] | None = [] if params.logprobs is not None else None
        self.text = ""
        self.emitted = 0  # characters of self.text already handed out in updates
        self.sent_tokens = 0
        self.arrival = arrival
        self.token_times: list[float] = []
        self.finished_at: float | None = None
        self.finish_reason: str | None = None
        self.stopped_by_string = False
        self.grammar: RequestGrammar | None = None  # structured output: set by the engine

    @property
    def num_generated(self) -> int:
        return len(self.token_ids)

    def append(self, token_id: int, logprobs: TokenLogprobs | None, now: float) -> str | None:
        """Take one sampled token; returns "stop" if it ends the request (stop token, EOS, stop string)."""
        self.token_ids.append(token_id)
        self.token_times.append(now)
        if self.logprobs is not None and logprobs is not None:
            self.logprobs.append(logprobs)
        if self.grammar is not None and self.grammar.accept(token_id):
            return "stop"  # the grammar has ended (on a stop token): whatever ignore_eos or min_tokens say
        if len(self.token_ids) <= self.params.min_tokens:  # nothing stops it before min_tokens (as vLLM)
            self.text += self.detok.add(token_id)
            return None
        if token_id in self.stop_ids:
            return "stop"  # the token stays in token_ids; its text is not added
        old_len = len(self.text)
        self.text += self.detok.add(token_id)
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

    def sampling_row(self) -> SamplingRow:
        """How the sampler treats this request's next token."""
        p = self.params
        seed = None if p.seed is None else row_seed(p.seed, self.num_generated)
        processing = None
        if p.penalized:
            penalties = p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
            # a grammar decides where its output ends: hiding the stop tokens could leave it no token
            hide = self.num_generated < p.min_tokens and self.grammar is None
            processing = ProcessorRow(
                p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.logit_bias,
                hidden_ids=tuple(self.stop_ids) if hide else (),
                output_ids=self.token_ids if penalties else (),
                seen_ids=[*self.prompt_token_ids, *self.token_ids] if p.repetition_penalty != 1.0 else ())
        return SamplingRow(p.temperature, p.top_p, p.top_k, p.min_p, seed, p.logprobs, processing)

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
        new_ids = self.token_ids[self.sent_tokens :]
        new_lps = None if self.logprobs is None else self.logprobs[self.sent_tokens :]
        times = tuple(self.token_times[self.sent_tokens :])
        prev = self.token_times[self.sent_tokens - 1] if self.sent_tokens > 0 else None
        self.sent_tokens = len(self.token_ids)
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
            prompt_token_ids=list(self.prompt_token_ids),
            token_ids=list(self.token_ids),
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
