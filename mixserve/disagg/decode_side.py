"""The decode instance (the front): sends each new prompt to the prefill instance, imports the KV blocks
it ships back, and serves the stream from there.

A DecodeEngine is an LLMEngine, so the server drives it as any engine; only `add_request`, `abort`,
`has_unfinished` and `step` gain a stage before admission:
  1. add_request validates the prompt and posts it to the prefill instance (nothing is admitted yet). A
     prompt with no full block to hand over (shorter than block_size + 1), a later choice of n > 1, one
     whose full blocks are all in the local prefix cache already, or one with fewer uncached tokens than
     kv_peer_min_tokens is admitted at once, as on `both`. That last rule (default 0: off, every prompt
     goes out, as issue 16 asks) is NVIDIA Dynamo's conditional disaggregation: measured on workload M
     (bench/disagg.py), short prompts queued at the prefill instance behind the long ones waited seconds
     for their first token, while prefilling them here costs a step of the streams only their length.
  2. The link's receiver thread queues each arrival; the step thread, between steps, imports them in
     arrival order: it allocates free blocks from its PrefixCachingPool for the prompt's full blocks
     (reusing those still cached here), writes the received K/V into them (the block id mapping),
     registers each under its chain key, holds them, and adds the request normally. Admission then
     finds every full block cached, computes only the tail (1..block_size tokens) and samples the first
     token itself: greedy and seeded outputs equal one `both` instance, and neither the scheduler nor
     the runner knows about disaggregation. The hold lasts one step: the scheduler has admitted the
     request by then, or it waits behind others and its blocks stay cached (unreferenced, freed last),
     so admission still finds them unless memory runs short, when they are evicted and it computes them
     itself. A hold kept until admission deadlocked: holds invisible to the scheduler could leave a
     preempted request at the queue's head too few blocks ever to restart, with the held one behind it.
  3. Blocks short: the arrival waits in the queue (counted as waiting) until a step frees enough; never
     dropped. A prompt the prefill side refuses, or whose KV has not come back within
     kv_peer_timeout_s, is prefilled here instead (a slow peer delays a request, never hangs it).
  4. The link dead (the peer died, hung past link.SILENCE_S or left): the next step raises PeerLostError,
     which is permanent, so the step loop fails every request in flight and dies: /health 503, exit 1.
The server's step loop is not woken by arrivals (no change to async_engine.py, 297 lines): serve runs it
with a short idle poll (roles.IDLE_POLL_S) instead.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from mixserve.config import EngineConfig
from mixserve.core.prefix_cache import PrefixCachingPool, chain_keys
from mixserve.core.stats import EngineStats
from mixserve.disagg.kv_blocks import num_full_blocks, scatter_blocks
from mixserve.disagg.link import KVLink, PeerLostError
from mixserve.engine.llm_engine import LLMEngine, RequestError
from mixserve.engine.outputs import RequestUpdate
from mixserve.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class Remote:
    """A prompt out at the prefill instance, then its KV waiting for blocks here."""

    request_id: str
    ids: list[int]
    params: SamplingParams
    arrival: float
    deadline: float
    num_blocks: int
    payload: torch.Tensor | None = None
    sent: float = field(default_factory=time.monotonic)


class DecodeEngine(LLMEngine):
    """An LLMEngine whose prompts are prefilled by the peer at the other end of a KVLink."""

    def __init__(self, runner: Any, cfg: EngineConfig | None = None) -> None:
        super().__init__(runner, cfg)
        self.link: KVLink | None = None
        self.timeout_s = 60.0
        self.min_tokens = 0  # prompts with fewer uncached tokens are prefilled here
        self._arrivals: collections.deque[tuple[dict[str, Any], torch.Tensor | None]] = collections.deque()
        self._remote: dict[str, Remote] = {}  # insertion order = the order prompts were sent
        self._held: dict[str, list[int]] = {}  # imported this step: blocks held until it ends
        self.num_imported = self.num_local = self.num_fallbacks = 0

    def attach(self, link: KVLink, timeout_s: float = 60.0, min_tokens: int = 0) -> None:
        """Send new prompts over `link`; a prompt whose KV is not back in `timeout_s` is prefilled here,
        and so is one with fewer than `min_tokens` tokens not cached here."""
        if not isinstance(self.scheduler.blocks, PrefixCachingPool):
            raise ValueError("role decode: needs enable_prefix_caching (imported blocks enter the cache)")
        self.link, self.timeout_s, self.min_tokens = link, timeout_s, min_tokens
        link.max_tensor_bytes = self.runner.kv_cache.nbytes  # no prompt's KV is larger
        link.start(lambda header, tensor: self._arrivals.append((header, tensor)))

    @property
    def pool(self) -> PrefixCachingPool:
        pool = self.scheduler.blocks
        assert isinstance(pool, PrefixCachingPool)
        return pool

    # ---- requests ------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival: float | None = None) -> None:
        if self.link is None or self.choices.is_later_choice(request_id):
            return super().add_request(request_id, prompt, params, arrival)
        ids = self.tokenizer.encode(prompt, add_special_tokens=True) if isinstance(prompt, str) else [
            int(t) for t in prompt]
        self.validate(ids, params)
        if request_id in self._remote or request_id in self._held or self._in_scheduler(request_id):
            raise RequestError(f"request_id: {request_id!r} is already in use", "request_id")
        n = num_full_blocks(len(ids), self.runner.block_size)
        hit = len(self.pool.match(chain_keys(ids, self.runner.block_size, n, [])))
        if n == 0 or hit == n or len(ids) - hit * self.runner.block_size < self.min_tokens:  # prefill here
            self.num_local += 1
            return super().add_request(request_id, ids, params, arrival)
        now = time.monotonic()
        arrival = now if arrival is None else arrival
        self._remote[request_id] = Remote(request_id, ids, params, arrival, now + self.timeout_s, n)
        self.link.post({"kind": "prefill", "rid": request_id, "ids": ids})

    def abort(self, request_id: str) -> None:
        r = self._remote.pop(request_id, None)
        if r is not None:  # not in the scheduler yet
            if r.payload is None and self.link is not None:
                self.link.post({"kind": "abort", "rid": request_id})
            return
        held = self._held.pop(request_id, None)
        if held is not None:
            self.pool.free(held)
        super().abort(request_id)

    def has_unfinished(self) -> bool:
        if self.link is None:
            return super().has_unfinished()
        now = time.monotonic()
        # an arrival for a request aborted meanwhile is nothing left to do (after a failed step the async
        # engine aborts every request and restarts only if nothing is unfinished); list(): one C call
        pending = any(str(h.get("rid")) in self._remote for h, _ in list(self._arrivals))
        return (self.link.error is not None or pending or super().has_unfinished()
                or any(r.payload is not None or now > r.deadline for r in self._remote.values()))

    def stats(self) -> EngineStats:
        """As LLMEngine's, with the prompts out at the prefill instance counted as waiting."""
        stats = super().stats()
        s = stats.scheduler
        waiting = s.num_requests_waiting + len(self._remote)
        return replace(stats, scheduler=replace(s, num_requests_waiting=waiting))

    def close(self) -> None:
        if self.link is not None:
            self.link.close()
        super().close()

    # ---- the step thread -----------------------------------------------------------------------

    def step(self) -> list[RequestUpdate]:
        """Import what arrived (blocks allowing), then one step; PeerLostError once the link is dead."""
        if self.link is None:
            return super().step()
        if (why := self.link.error) is not None:
            raise PeerLostError(why)
        self._take_arrivals()
        self._fall_back(time.monotonic())
        self._import_ready()
        updates = super().step()
        self._release_holds()
        return updates

    def _take_arrivals(self) -> None:
        while self._arrivals:
            header, tensor = self._arrivals.popleft()
            r = self._remote.get(str(header.get("rid")))
            if r is None:
                continue  # aborted meanwhile (or already prefilled here)
            if header.get("kind") == "kv" and tensor is not None and header.get("num_blocks") == r.num_blocks:
                r.payload = tensor
            else:
                logger.warning("prefill instance refused %s (%s): prefilling it here", r.request_id,
                               header.get("message", header.get("kind")))
                self._admit_local(r)

    def _fall_back(self, now: float) -> None:
        for r in [r for r in self._remote.values() if r.payload is None and now > r.deadline]:
            logger.warning("no KV for %s after %.0f s: prefilling it here", r.request_id, now - r.sent)
            self.link.post({"kind": "abort", "rid": r.request_id})  # type: ignore[union-attr]
            self._admit_local(r)

    def _admit_local(self, r: Remote) -> None:
        del self._remote[r.request_id]
        self.num_fallbacks += 1
        super().add_request(r.request_id, r.ids, r.params, r.arrival)

    def _import_ready(self) -> None:
        """Import arrivals in the order their prompts were sent; the first that finds too few free blocks
        stops the rest (first come, first served: a long prompt is not starved by short ones)."""
        for r in list(self._remote.values()):
            if r.payload is not None and not self._import(r):
                return

    def _import(self, r: Remote) -> bool:
        block_size, pool = self.runner.block_size, self.pool
        keys = chain_keys(r.ids, block_size, r.num_blocks, [])
        hit = pool.match(keys)  # blocks still cached here need no copy
        pool.take(hit)
        need = r.num_blocks - len(hit)
        if pool.num_free() < need + 1:  # + 1: the tail's block, so admission can follow
            pool.free(hit)
            return False
        fresh = pool.allocate(need)
        assert r.payload is not None
        with torch.no_grad():
            scatter_blocks(self.runner.kv_cache.layers, fresh, r.payload[:, :, len(hit):])
        for block, key in zip(fresh, keys[len(hit):], strict=True):
            pool.register(block, key)  # False: the key got cached meanwhile; this copy stays private
        del self._remote[r.request_id]
        self._held[r.request_id] = hit + fresh
        super().add_request(r.request_id, r.ids, r.params, r.arrival)
        self.num_imported += 1
        return True

    def _in_scheduler(self, request_id: str) -> bool:
        try:
            self.scheduler.request(request_id)
        except KeyError:
            return False
        return True

    def _release_holds(self) -> None:
        """Drop the hold on every imported request's blocks after the step that followed its import: the
        scheduler holds them itself if it admitted it; if not, they stay cached for its admission."""
        for blocks in self._held.values():
            self.pool.free(blocks)
        self._held.clear()
