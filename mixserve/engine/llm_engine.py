"""LLMEngine: the synchronous step loop (schedule -> plan -> forward -> sample -> update -> detokenize)."""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from mixserve.config import EngineConfig
from mixserve.core import Chunked, ScheduleOutput, Scheduler, SchedulerConfig, WholePrompt, plan
from mixserve.core.speculative import SpecStats
from mixserve.engine.choices import Choices
from mixserve.engine.outputs import RequestUpdate
from mixserve.engine.request_state import RequestState
from mixserve.engine.sampling_params import SamplingParams
from mixserve.engine.speculative import draft_model_for, speculation_for
from mixserve.engine.stats_log import EngineStats, StatsLog
from mixserve.engine.step_cost import StepCost
from mixserve.engine.step_sampling import Sampled, draft_groups, sample_step
from mixserve.engine.step_trace import StepTrace
from mixserve.engine.structured import Grammars
from mixserve.engine.threads import available_cores, bind_threads, run_on_own_thread, set_threads
from mixserve.runner.sampler import Sampler


class RequestError(ValueError):
    """A request the engine refuses (too long, bad prompt or parameters); `.param` names the culprit."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class LLMEngine:
    """Continuous batching over a ModelRunner: requests join and leave between steps."""

    def __init__(self, runner: Any, cfg: EngineConfig | None = None) -> None:
        self.cfg = cfg = cfg or EngineConfig()
        self.runner = runner
        self.tokenizer = runner.tokenizer
        self.eos_token_ids: frozenset[int] = frozenset(runner.tokenizer.eos_token_ids)
        self.vocab_size: int = runner.config.vocab_size
        if cfg.max_model_len > runner.max_model_len:
            raise ValueError(f"max_model_len: {cfg.max_model_len} exceeds the model's context length "
                             f"{runner.max_model_len}")
        self.max_model_len: int = cfg.max_model_len or runner.max_model_len
        # cfg.num_blocks may use part of a runner's cache (tests share one runner between engines)
        self.num_blocks: int = cfg.num_blocks or runner.num_blocks
        if self.num_blocks > runner.num_blocks:
            raise ValueError(f"num_blocks: {self.num_blocks} exceeds the runner's KV cache "
                             f"({runner.num_blocks} blocks)")
        sched_cfg = SchedulerConfig(
            max_batch_tokens=cfg.max_batch_tokens,
            max_num_seqs=cfg.max_num_seqs,
            block_size=runner.block_size,
            num_blocks=self.num_blocks,
            max_partial_prefills=cfg.max_partial_prefills,
            long_prefill_threshold=cfg.long_prefill_threshold,
            max_long_partial_prefills=cfg.max_long_partial_prefills,
            enable_prefix_caching=cfg.enable_prefix_caching,
        )
        policy = Chunked(cfg.prefill_chunk) if cfg.prefill_chunk > 0 else WholePrompt()
        if cfg.tpot_target_ms > 0 or cfg.slo_ttft_ms > 0 or cfg.slo_tpot_ms > 0:  # the budget sizes chunks
            policy = Chunked(cfg.max_batch_tokens)
        self.scheduler = Scheduler(sched_cfg).with_prefill_policy(policy).with_speculation(
            speculation_for(cfg.speculative, cfg.num_speculative_tokens))
        self.draft_model = draft_model_for(cfg.speculative, runner)  # None unless `speculative` is a path
        self.sampler = Sampler(cfg.seed, runner.device)
        self.grammars = Grammars(runner.tokenizer, self.vocab_size, self.eos_token_ids)  # built on first use
        self.num_threads = set_threads(cfg.threads) if torch.device(runner.device).type == "cpu" else 0
        self._bound_thread: int | None = None
        # after set_threads: with a TPOT target and no cost model file it profiles the runner first
        self.step_cost = StepCost(cfg, runner, self.scheduler, self.num_blocks)
        self._cost_fields: dict = {}  # the last step's prediction, for its trace line
        self._requests: dict[str, RequestState] = {}
        self.choices = Choices()  # requests with n > 1
        self._trace: StepTrace | None = StepTrace(cfg.step_trace) if cfg.step_trace else None
        self._num_steps = 0
        self._prompt_tokens = self._generation_tokens = 0
        self._stats_log = StatsLog()

    @property
    def model_name(self) -> str:
        return self.runner.model_name

    @property
    def sampling_defaults(self) -> dict:  # the checkpoint's own (model/generation_config.py)
        from mixserve.model.generation_config import sampling_defaults
        return sampling_defaults(getattr(self.runner, "path", None))

    @property
    def context_limit(self) -> int:
        """The most tokens (prompt + output) one request may hold: the context and the KV cache."""
        return min(self.max_model_len, self.scheduler.cfg.num_slots)

    @classmethod
    def from_config(cls, cfg: EngineConfig) -> LLMEngine:
        """Load the model named by `cfg.model` ("" = the default) on `cfg.device` and build the engine."""
        from mixserve.runner.model_runner import ModelRunner, resolve_device, resolve_dtype

        device = resolve_device(cfg.device)
        if cfg.tensor_parallel_size > 1:  # ranks 1..N-1 are spawned, this process is rank 0 (distributed/)
            from mixserve.distributed.tp_runner import start_tensor_parallel

            runner, cfg = start_tensor_parallel(cfg, device.type, available_cores())
            return cls(runner, cfg)
        def load() -> ModelRunner:
            return ModelRunner.from_pretrained(
                cfg.model or None,
                num_blocks=cfg.num_blocks,
                block_size=cfg.block_size,
                device=str(device),
                dtype=resolve_dtype(cfg.dtype, device),  # auto: float32 on CPU, bfloat16 on CUDA
                attention_backend=cfg.attention_backend,
                cuda_graphs=cfg.cuda_graphs,
                cpu_kv_cache_gib=cfg.cpu_kv_cache_gib,
                gpu_memory_utilization=cfg.gpu_memory_utilization,
                max_num_seqs=cfg.max_num_seqs,  # the largest decode batch a CUDA graph is captured for
                quantization=cfg.quantization,
                int8_activations=cfg.int8_activations,
            )

        # on the CPU the load and the engine's own start-up work (a draft model's load, the cost profile) run
        # on a bound thread of its own that then ends (threads.py: one OpenMP pool at a time); this thread
        # stays free to run the server's event loop, off the compute core. Its first step() binds whichever
        # thread steps, this one too (offline).
        if device.type != "cpu":
            return cls(load(), cfg)
        return run_on_own_thread(lambda: cls(load(), cfg), set_threads(cfg.threads))

    # ---- requests in and out -------------------------------------------------------------------

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise RequestError if the request can never run; reads only fixed settings and compiles the
        request's grammar into a locked cache (thread-safe)."""
        if not isinstance(params, SamplingParams):
            raise RequestError(f"params: expected SamplingParams, got {type(params).__name__}", "params")
        n = len(prompt_token_ids)
        if n == 0:
            raise RequestError("prompt: is empty", "prompt")
        bad = next((t for t in prompt_token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise RequestError(f"prompt: token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})",
                               "prompt")
        bad = next((t for t, _ in params.logit_bias if t >= self.vocab_size), None)
        if bad is not None:
            raise RequestError(f"logit_bias: token id {bad} is outside the vocabulary", "logit_bias")
        total = n + params.max_tokens
        param = "prompt" if n >= self.max_model_len else "max_tokens"
        if total > self.max_model_len:
            raise RequestError(
                f"{param}: prompt ({n} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds "
                f"max_model_len ({self.max_model_len})", param)
        kv_slots = self.scheduler.cfg.num_slots  # the scheduler's own rule (add_request) in one number
        if total > kv_slots:
            param = "prompt" if n >= kv_slots else "max_tokens"  # the prompt alone cannot fit: name it
            raise RequestError(
                f"{param}: prompt ({n} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds the KV "
                f"cache ({self.num_blocks} blocks x {self.runner.block_size} tokens)", param)
        if params.structured_output is not None:  # a bad schema or regex is refused here, before admission
            try:
                self.grammars.compile(params.structured_output)
            except ValueError as exc:
                raise RequestError(str(exc), "structured_output") from None

    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, arrival: float | None = None
    ) -> None:
        """Queue a request (a string is tokenized); it joins the batch at the next step."""
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            ids = [int(t) for t in prompt]
        self.validate(ids, params)
        if request_id in self._requests:
            raise RequestError(f"request_id: {request_id!r} is already in use", "request_id")
        params = self.choices.add(request_id, ids, params, arrival)  # n > 1: choice 0 now, the rest later
        self.scheduler.add_request(request_id, ids, params.max_tokens)
        self._requests[request_id] = RequestState(  # reads its tokens from the scheduler's record
            self.scheduler.request(request_id), params, self.tokenizer, self.eos_token_ids,
            time.monotonic() if arrival is None else arrival,
        )
        if params.structured_output is not None:  # compiled by validate() (cached)
            grammar = self.grammars.matcher(params.structured_output, request_id)
            self._requests[request_id].grammar = grammar
            # its drafts are cut where the grammar refuses them, and verified on masked rows
            self.scheduler.request(request_id).spec = SpecStats(allowed=grammar.allowed)

    def abort(self, request_id: str) -> None:
        """Drop a request (every choice of it) and free its blocks; unknown or finished ids are ignored."""
        if request_id in self._requests:
            self._retire(request_id)
        for child in self.choices.abort(request_id):
            self.abort(child)

    def _retire(self, request_id: str) -> None:
        """The one place a request leaves: finished (length, EOS, stop, grammar) or aborted. The scheduler
        drops its record and frees (or, with prefix caching, caches) its blocks."""
        del self._requests[request_id]
        self.scheduler.abort(request_id)
        if self.draft_model is not None:
            self.draft_model.forget(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- one step ------------------------------------------------------------------------------

    def step(self) -> list[RequestUpdate]:
        """Run one mixed batch; returns one update per request that got a token."""
        self._bind_this_thread()
        start, wall = time.monotonic(), time.time()
        out = self.scheduler.schedule()
        if out.num_tokens == 0:
            return []
        if self.draft_model is not None:  # its tokens for the drafts booked, and the chunks' K/V
            self.draft_model.propose(self.scheduler, out)
        step_plan = plan(self.scheduler, out)
        self.step_cost.begin(step_plan.batch)
        logits = self.runner.forward(step_plan.batch)
        # grammar masks, filled while a GPU still computes the logits; None if no row has a grammar
        masks = self.grammars.masks([self._requests[rid].grammar for _, rid in step_plan.sample
                                     if rid not in step_plan.drafts])
        draft_masks = self.grammars.draft_masks([(self._requests[rid].grammar, d)
                                                 for _, rid, d in draft_groups(step_plan)])
        sampled = sample_step(self.sampler, logits, step_plan, self._requests, masks, draft_masks)
        finished = self.scheduler.update(out, {rid: token for rid, (token, _) in sampled.items()})
        updates, prompt_tokens = self._postprocess(sampled, set(finished))
        updates = self.choices.after_step(self, updates)
        accepted = sum(len(tokens) - 1 for tokens, _ in sampled.values() if isinstance(tokens, list))
        return self._end_step(start, wall, out, len(step_plan.batch.seqs), prompt_tokens, updates, accepted)

    def _postprocess(self, sampled: Sampled, finished_by_length: set[str]) -> tuple[list[RequestUpdate], int]:
        """Detokenize, check stops, end finished requests; returns the updates and new prompt tokens."""
        now = time.monotonic()
        updates, prompt_tokens = [], 0
        for rid, (tokens, lps) in sampled.items():  # scheduler.update has appended them to its record
            state = self._requests[rid]
            if state.num_generated == 0 and not self.choices.is_later_choice(rid):  # once per request
                prompt_tokens += state.record.prompt_len
            reason = None
            for lp in lps if isinstance(tokens, list) else (lps,):
                reason = state.take(lp, now)
                if reason is not None:  # a stop inside a speculating decode's tokens: the rest are dropped
                    break
            if reason is None and rid in finished_by_length:
                reason = "length"
            updates.append(state.update(reason, now))
            if reason is not None:
                self._retire(rid)
        return updates, prompt_tokens

    def _end_step(self, start: float, wall: float, out: ScheduleOutput, num_seqs: int, prompt_tokens: int,
                  updates: list[RequestUpdate], accepted: int = 0) -> list[RequestUpdate]:
        """Count the step and write its trace line (`accepted`: the draft tokens it kept)."""
        duration = time.monotonic() - start
        self._cost_fields = self.step_cost.end(duration)
        spec = self.scheduler.speculation
        if spec is not None and out.decodes:  # what drafts buy at this many decodes
            useful = len(out.decodes) + accepted + sum(c.length for c in out.chunks)
            spec.gate.observe(len(out.decodes), bool(out.drafts), useful, duration, bool(out.chunks))
        self._num_steps += 1
        self._prompt_tokens += prompt_tokens
        self._generation_tokens += sum(len(u.new_token_ids) for u in updates)
        if self._trace is not None:
            drafts = {"draft_tokens": out.num_draft_tokens, "accepted_tokens": accepted} if out.drafts else {}
            self._trace.write(self._num_steps, wall, len(out.decodes) + out.num_draft_tokens, out.num_tokens,
                              num_seqs, duration, {**self._cost_fields, **drafts})
        self._stats_log.maybe_log(self.stats)
        return updates

    def stats(self) -> EngineStats:
        s = self.scheduler.stats()
        return EngineStats(
            scheduler=s,
            num_steps=self._num_steps,
            num_prompt_tokens_total=self._prompt_tokens,
            num_generation_tokens_total=self._generation_tokens,
            num_preemptions_total=s.num_preemptions,
        )

    def close(self) -> None:
        """Close the step trace file and write the step cost model (`[engine] cost_model`, if set)."""
        self.step_cost.save()
        if self._trace is not None:
            self._trace.close()
            self._trace = None

    # ---- helpers -------------------------------------------------------------------------------

    def _bind_this_thread(self) -> None:
        """libgomp has one worker pool per calling thread: bind the pool of whichever thread steps."""
        ident = threading.get_ident()
        if self._bound_thread != ident:
            self._bound_thread = ident
            if self.num_threads:
                bind_threads(self.num_threads)

