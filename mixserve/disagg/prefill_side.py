"""The prefill instance: runs the decode instance's prompts to their first token and ships their KV back.

A PrefillEngine is an LLMEngine (so the server, its /health, /metrics, watchdog and step trace work as
they are) that also takes prompts from the KV link. Each runs as an ordinary request of its own, id
"kv-<the decode side's id>", with max_tokens 1 and greedy sampling: its token is thrown away, the decode
side samples the first token itself (so seeded and greedy outputs equal one `both` instance).

Where the K/V are read (decided): right after the step that finished the request, from the prefix cache,
not in a hook inside LLMEngine._retire. With prefix caching on (required for disaggregation), every full
block a chunk filled is registered under its chain key in that same step (Scheduler.update), and a
retired request's blocks stay cached until an allocation evicts them; nothing allocates between the end
of step() and this code on the same thread, so `pool.match(chain_keys(prompt))` finds every full block.
That needs no line in llm_engine.py and no knowledge of when a request retires. Prompts may also come
over HTTP: they are served as on a `both` instance.
"""

from __future__ import annotations

import collections
import logging
from typing import Any

import torch

from mixserve.config import EngineConfig
from mixserve.core.prefix_cache import PrefixCachingPool, chain_keys
from mixserve.disagg.kv_blocks import gather_blocks, num_full_blocks
from mixserve.disagg.link import KVLink, PeerLostError
from mixserve.engine.llm_engine import LLMEngine, RequestError
from mixserve.engine.outputs import RequestUpdate
from mixserve.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

PREFIX = "kv-"
PREFILL_PARAMS = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


class PrefillEngine(LLMEngine):
    """An LLMEngine that also prefills the decode instance's prompts (attach a KVLink to start)."""

    def __init__(self, runner: Any, cfg: EngineConfig | None = None) -> None:
        super().__init__(runner, cfg)
        self.link: KVLink | None = None
        self._incoming: collections.deque[dict[str, Any]] = collections.deque()  # from the receiver thread
        self._remote: dict[str, list[int]] = {}  # our id of a prompt from the link -> the prompt
        self.num_shipped = 0

    def attach(self, link: KVLink) -> None:
        """Start taking prompts from `link` (its receiver thread queues them for the step thread)."""
        if not isinstance(self.scheduler.blocks, PrefixCachingPool):
            raise ValueError("role prefill: needs enable_prefix_caching (its KV is read from the cache)")
        self.link = link
        link.start(lambda header, _tensor: self._incoming.append(header))

    def has_unfinished(self) -> bool:
        if self.link is None:
            return super().has_unfinished()
        return self.link.error is not None or bool(self._incoming) or super().has_unfinished()

    def step(self) -> list[RequestUpdate]:
        """Take the link's prompts and aborts, run one step, ship the prompts it finished."""
        if self.link is None:
            return super().step()
        if (why := self.link.error) is not None:
            raise PeerLostError(why)
        while self._incoming:
            self._handle(self._incoming.popleft())
        updates = super().step()
        kept = []
        for u in updates:
            if u.request_id not in self._remote:
                kept.append(u)
            elif u.finished:
                self._ship(u.request_id, self._remote.pop(u.request_id))
        return kept

    def abort(self, request_id: str) -> None:
        self._remote.pop(request_id, None)
        super().abort(request_id)

    def close(self) -> None:
        if self.link is not None:
            self.link.close()
        super().close()

    def _handle(self, header: dict[str, Any]) -> None:
        kind, rid = header.get("kind"), str(header.get("rid"))
        if kind == "prefill":
            ids = [int(t) for t in header["ids"]]
            try:
                self.add_request(PREFIX + rid, ids, PREFILL_PARAMS)
            except RequestError as exc:  # the decode side prefills it itself
                self.link.post({"kind": "refused", "rid": rid, "message": str(exc)})  # type: ignore[union-attr]
                return
            self._remote[PREFIX + rid] = ids
        elif kind == "abort" and PREFIX + rid in self._remote:
            self.abort(PREFIX + rid)

    def _ship(self, request_id: str, ids: list[int]) -> None:
        """Copy the prompt's full blocks out of the cache (between steps) and queue them for the link."""
        rid = request_id.removeprefix(PREFIX)
        block_size = self.runner.block_size
        n = num_full_blocks(len(ids), block_size)
        pool = self.scheduler.blocks
        assert isinstance(pool, PrefixCachingPool)
        blocks = pool.match(chain_keys(ids, block_size, n, []))
        if len(blocks) < n:  # cannot happen (see the module docstring); the decode side computes it then
            logger.error("prefill %s: %d of %d full blocks cached", rid, len(blocks), n)
            self.link.post({"kind": "refused", "rid": rid, "message": "blocks not cached"})  # type: ignore[union-attr]
            return
        with torch.no_grad():
            payload = gather_blocks(self.runner.kv_cache.layers, blocks)
        self.link.post({"kind": "kv", "rid": rid, "num_blocks": n}, payload)  # type: ignore[union-attr]
        self.num_shipped += 1
