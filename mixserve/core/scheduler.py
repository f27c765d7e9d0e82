"""The mixed-batch scheduler: each step, decodes first, then prefill chunks, within one token budget."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence

from mixserve.core.batch import Chunk, RequestId, ScheduleOutput
from mixserve.core.blocks import BlockSpace
from mixserve.core.config import SchedulerConfig
from mixserve.core.cost_model import StepFeatures, step_features
from mixserve.core.draft_steps import book_drafts, keep_verified, trim_blocks
from mixserve.core.policy import PrefillPolicy, WholePrompt
from mixserve.core.prefill_limits import Admit, PartialPrefills
from mixserve.core.prefix_cache import PrefixCache, new_pool
from mixserve.core.request import Request, Status, new_request
from mixserve.core.scheduler_reads import SchedulerReads
from mixserve.core.slo import SloBudget, first_prefill
from mixserve.core.speculative import SpecCounts, Speculation
from mixserve.core.step_draft import StepDraft
from mixserve.core.tpot_budget import TpotBudget
from mixserve.core.waiting_share import WAITING_SHARE, WaitingShare

MAX_FINISHED_KEPT = 10_000  # finished requests kept readable (abort() forgets one sooner)


class Scheduler(SchedulerReads):
    """Decides what each engine step computes and owns every request's KV blocks."""

    def __init__(self, cfg: SchedulerConfig, blocks: BlockSpace | None = None) -> None:
        self.cfg = cfg
        self.blocks: BlockSpace = blocks if blocks is not None else new_pool(cfg)
        self._cache: PrefixCache | None = PrefixCache.for_config(cfg, self.blocks)  # None: caching off
        self.policy: PrefillPolicy = WholePrompt()
        self.step_budget: TpotBudget | None = None  # None: every step's budget is max_batch_tokens
        self.waiting_share = WAITING_SHARE  # with a step budget: what waiting prompts may take first
        self.speculation: Speculation | None = None  # None: one token per decode
        self.slo: SloBudget | None = None  # None: no SLO mode (core/slo.py)
        self._prefill_only_next = False  # the SLO mode just ran the decodes apart: the chunks go next
        self.spec_counts = SpecCounts()  # drafted and accepted so far
        self._requests: dict[RequestId, Request] = {}
        self._waiting: deque[Request] = deque()  # arrival order; preempted requests go back in front
        self._running: list[Request] = []  # admission order: the last one is preempted first
        self._finished: OrderedDict[RequestId, None] = OrderedDict()
        self._num_preemptions = 0
        self._last_step = ScheduleOutput()

    def with_prefill_policy(self, policy: PrefillPolicy) -> Scheduler:
        """Use `policy` for every prefill from now on; returns self."""
        self.policy = policy
        return self

    def with_step_budget(self, budget: TpotBudget | None, waiting_share: float = WAITING_SHARE) -> Scheduler:
        """While decodes run, let `budget` (a TPOT target, or an SloBudget: core/slo.py) cap the chunks of
        each step, waiting prompts that fit whole in `waiting_share` of its chunk time going first
        (waiting_share.py); returns self."""
        if not 0.0 <= waiting_share <= 1.0:
            raise ValueError(f"waiting_share must be within 0..1, got {waiting_share!r}")
        self.step_budget, self.waiting_share = budget, waiting_share
        self.slo = budget if isinstance(budget, SloBudget) else None
        return self

    def with_speculation(self, speculation: Speculation | None) -> Scheduler:
        """Let decodes carry draft tokens (core/speculative.py) from now on; returns self."""
        self.speculation = speculation
        return self

    # ---- requests in and out -------------------------------------------------------------------

    def add_request(self, request_id: RequestId, prompt: Sequence[int], max_tokens: int) -> None:
        """Queue a request; ValueError if it is empty, asks for < 1 token, reuses an id or can never fit."""
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self._requests[request_id] = r = new_request(request_id, prompt, max_tokens, self.cfg)
        self._waiting.append(r)
        if self.slo is not None:
            self.slo.arrived(r)

    def finish(self, request_id: RequestId) -> None:
        """End a request early (EOS, stop string): frees its blocks; its output stays readable."""
        r = self._get(request_id)
        if r.status is not Status.FINISHED:
            self._finish(r)

    def abort(self, request_id: RequestId) -> None:
        """Drop a request (client gone, or a finished one no longer needed): frees its blocks."""
        r = self._get(request_id)
        self._release(r)
        del self._requests[request_id]
        self._finished.pop(request_id, None)

    # ---- one step ------------------------------------------------------------------------------

    def schedule(self) -> ScheduleOutput:
        """Choose this step's decodes and chunks and allocate the KV blocks of every position they write."""
        step = StepDraft(self.cfg.max_batch_tokens)
        prefill_only, self._prefill_only_next = self._prefill_only_next, False
        if self.slo is not None:  # this step's time limit (for every chunk), and the prompts in SLO order
            self._waiting = deque(self.slo.begin_step(self._running, self._waiting, prefill_only))
            step.sized = True
        # 1. Decodes, one token each, oldest first (none in the prefill-only step of an exclusive pair).
        for r in list(self._running) if not prefill_only else ():
            if r.status is Status.RUNNING and r.is_decode_ready and step.budget_left > 0:
                if self._reserve(r, len(r.tokens), step):
                    step.decodes[r.request_id] = None
                    r.num_computed += 1
        prefilling, given_up = [r for r in self._running if r.is_prefilling], []
        if self.slo is not None:  # prompts given up on go after the waiting ones that can still make it
            prefilling = self.slo.ordered(prefilling)
            given_up = [r for r in prefilling if not self.slo.protected(r)]
            can_admit = len(self._running) < self.cfg.max_num_seqs and self.blocks.num_free() > 0
            nxt = first_prefill(prefilling, self._waiting if can_admit else ()) if step.decodes else None
            if nxt and self.slo.exclusive(self._features(step), nxt[0], min(nxt[1], step.budget_left)):
                self._prefill_only_next = True  # decodes alone now, the chunks alone next step
                return self._end_step(step)
        # 2. Requests part-way through their prefill, oldest first. Under a target (and with decodes to
        #    protect), waiting prompts that fit whole within their share of the step's time go before them.
        partial = PartialPrefills(self.cfg, (r.prefill_end for r in prefilling))
        overdue = self.slo is not None and bool(self._waiting) and self.slo.overdue(self._waiting[0])
        if self.step_budget is not None and step.decodes and self.waiting_share > 0 and not overdue:
            share = WaitingShare(self.step_budget, self._features(step), self.waiting_share)
            self._admit_waiting(step, partial, share.take)
        if self._next_chunks([r for r in prefilling if r not in given_up], step):
            return self._end_step(step)
        # 3. Waiting requests in arrival order; one that cannot start holds back those behind it, except a
        #    long prompt over max_long_partial_prefills: shorter ones may pass it (prefill_limits.py).
        self._admit_waiting(step, partial)
        self._next_chunks(given_up, step)
        # a prefill-only step whose chunks could not start after all becomes a plain step
        return self.schedule() if prefill_only and not step.chunks else self._end_step(step)

    def _next_chunks(self, prefilling: list[Request], step: StepDraft) -> bool:
        """The next chunks of these prompts part-way through their prefill, in turn, until the budget is
        spent; True when the step must end here."""
        for r in prefilling:
            # (one chunk a step: a prompt the share just admitted already has its chunk in this step)
            if r.status is Status.RUNNING and r.is_prefilling and r.request_id not in step.chunks:
                if self._schedule_chunk(r, step) == 0:
                    if r.status is Status.WAITING:  # it preempted itself: its blocks are for those after it
                        continue
                    return False
                # Under a target, the step that ends a prompt's prefill takes nothing after it: every token
                # added would delay that prompt's first token by its own time, and deferred to the next
                # step it costs only that step's fixed part (docs/decisions/waiting-share.md).
                if self.step_budget is not None and step.chunks[r.request_id].last:
                    return True
        return False

    def _end_step(self, step: StepDraft) -> ScheduleOutput:
        """4. Drafts where the gate lets them, in what the budget and target leave (draft_steps.py)."""
        if self.speculation is not None:
            book_drafts(step, self.speculation, self._requests, self.cfg.block_size, self._draft_limit,
                        lambda r, upto: self._reserve(r, upto, step, may_preempt=False))
        self._last_step = step.output()
        return self._last_step

    def _draft_limit(self, step: StepDraft, r: Request, limit: int) -> int:
        if self.step_budget is None or limit <= 0:
            return limit
        return self.step_budget.chunk_budget(self._features(step), len(r.tokens), limit)

    def _admit_waiting(self, step: StepDraft, partial: PartialPrefills,
                       only: Callable[[int, int], bool | None] | None = None) -> None:
        """Start waiting requests in arrival order; with `only` (prompt length, tokens left -> start it
        now? None: no prompt would fit any more), just those it takes: the others keep their place and
        those behind them may pass."""
        passed: list[Request] = []
        while self._waiting and len(self._running) < self.cfg.max_num_seqs:
            r = self._waiting[0]
            if r.request_id in step.preempted:  # it just gave its blocks back: not again this step
                break
            admit = partial.admits(len(r.tokens))
            fits = only(len(r.tokens), step.budget_left) if only is not None and admit is Admit.YES else True
            if fits is None:
                break
            if admit is not Admit.YES or not fits:
                if admit is Admit.STOP:
                    break
                passed.append(self._waiting.popleft())
                continue
            r.prefill_end = len(r.tokens)
            if self._cache is not None:
                self._cache.admit(r)  # its prefill starts after the longest cached run of its blocks
            if self._schedule_chunk(r, step) == 0:
                if self._cache is not None:
                    self._cache.undo(r)
                break
            partial.add(len(r.tokens))
        self._waiting.extendleft(reversed(passed))

    def _schedule_chunk(self, r: Request, step: StepDraft) -> int:
        """Give `r` its next chunk under the policy; returns its length (0: it must wait)."""
        remaining = r.prefill_end - r.num_computed
        budget_left, alone = step.budget_left, step.alone
        if self.step_budget is not None and (step.decodes or step.sized):  # no decodes: nothing to protect
            limit = self.step_budget.chunk_budget(self._features(step), r.num_computed, budget_left)
            # alone in a step, a prompt always progresses (one block), even where no chunk meets the limit
            budget_left = max(limit, min(budget_left, self.cfg.block_size)) if alone else limit
        length = self.policy.chunk_len(remaining, budget_left, alone)
        if not 0 <= length <= remaining or (length > budget_left and not alone):
            raise ValueError(f"{type(self.policy).__name__}.chunk_len({remaining}, {budget_left}, {alone}) "
                             f"returned {length}: out of range")
        if length == 0:
            return 0
        admitting = r.status is Status.WAITING
        # A waiting request only takes free blocks: preempting for it would just preempt someone else.
        if not self._reserve(r, r.num_computed + length, step, may_preempt=not admitting):
            return 0
        if admitting:
            self._waiting.popleft()
            r.status = Status.RUNNING
            self._running.append(r)
        start = r.num_computed
        step.chunks[r.request_id] = Chunk(r.request_id, start, length, start + length == len(r.tokens))
        r.num_computed += length
        return length

    def _features(self, step: StepDraft) -> StepFeatures:
        """The step so far as the cost model sees it: decodes at n - 1 with drafts, chunks at their start."""
        drafts = step.drafts
        decodes = ((len(self._requests[r].tokens) - 1, 1 + len(drafts.get(r, ()))) for r in step.decodes)
        return step_features([*decodes, *((c.start, c.length) for c in step.chunks.values())])

    def _reserve(self, r: Request, upto: int, step: StepDraft, may_preempt: bool = True) -> bool:
        """Give `r` blocks for positions < upto, preempting the newest running requests if need be; False
        if that is impossible (blocks short and no preempting, or `r` itself was the newest, preempted)."""
        need = -(-upto // self.cfg.block_size) - len(r.block_table)
        while need > self.blocks.num_free():
            if not may_preempt:
                return False
            victim = self._running[-1]
            self._preempt(victim, step)
            if victim is r:
                return False
        if need > 0:
            r.block_table.extend(self.blocks.allocate(need))
        return True

    def _preempt(self, r: Request, step: StepDraft) -> None:
        """Recompute later: give back every block, forget the K/V, wait at the front of the queue."""
        step.drop(r.request_id)
        step.preempted.append(r.request_id)
        self._release(r)
        r.status = Status.WAITING
        self._waiting.appendleft(r)
        self._num_preemptions += 1

    def update(self, out: ScheduleOutput, sampled: Mapping[RequestId, int | Sequence[int]]
               ) -> list[RequestId]:
        """Append each sampled token (a speculating decode's: the drafts it kept, then the next token);
        returns the requests that reached max_tokens in this step."""
        rows = [*out.decodes, *(c.request_id for c in out.chunks if c.last)]
        extra = set(sampled) - set(rows)
        if extra:
            raise ValueError(f"sampled tokens for requests with no sampled row this step: {sorted(extra)}")
        kept = {rid: keep_verified(self._requests.get(rid), d, sampled.get(rid), self.spec_counts)
                for rid, d in out.drafts.items()}
        if self._cache is not None:
            self._cache.register_step(out, self._requests, kept)  # the blocks this step filled are shareable
        finished = []
        for rid in rows:
            r = self._requests.get(rid)
            if r is None or r.status is not Status.RUNNING:
                continue  # finished or aborted after the step was scheduled
            if rid not in sampled:
                raise ValueError(f"no sampled token for request {rid!r}")
            token = sampled[rid]
            if isinstance(token, Sequence) and rid not in kept and len(token) != 1:
                raise ValueError(f"request {rid!r}: {len(token)} tokens sampled for a row without drafts")
            r.tokens.append(int(token[-1] if isinstance(token, Sequence) else token))
            if self.slo is not None:
                self.slo.sampled(r)
            if rid in kept:
                trim_blocks(r, self.blocks, self.cfg.block_size)
            if r.num_generated >= r.max_tokens:
                self._finish(r)
                finished.append(rid)
        return finished

    # ---- bookkeeping ---------------------------------------------------------------------------

    def _release(self, r: Request) -> None:
        """Take `r` out of the queues and give its blocks back; its K/V are gone."""
        if r.status is Status.RUNNING:
            self._running.remove(r)
        elif r.status is Status.WAITING:
            self._waiting.remove(r)
        self.blocks.free(r.block_table)
        r.block_table = []
        r.num_computed = 0

    def _finish(self, r: Request) -> None:
        self._release(r)
        r.status = Status.FINISHED
        self._finished[r.request_id] = None
        if len(self._finished) > MAX_FINISHED_KEPT:
            oldest, _ = self._finished.popitem(last=False)
            del self._requests[oldest]
