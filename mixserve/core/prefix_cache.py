"""Prefix caching: chained block keys, a reference-counted pool whose freed blocks stay cached (LRU), and
the admission glue that starts a request after the longest cached run of its full blocks.

Design (issue 15):
- vLLM V1's hash chain, not SGLang's radix tree. Our KV cache is already a pool of fixed-size blocks and
  a request already holds a flat block table; a chain of per-block keys in one dict slots into that as it
  is (one lookup per block, invariants a `check()` can verify in one pass). A radix tree matches at token
  granularity, but a partial block cannot be shared without copying it, so at block_size 16 it would win
  at most 15 tokens a request while adding node splits and a second structure to keep consistent with
  the pool. Eviction order is where the tree is better (leaves first); we get the same by freeing a block
  table tail first, so a block is evicted before the blocks it extends.
- A block's key is SHA-256 over its parent's key and its exact token ids (8 bytes each): it names the
  whole prefix, not just the block, and costs one fixed-size digest per block however long the prefix.
  Never Python's hash(): 64 bits, and a collision would serve one user another user's K/V. Keying by
  (token tuple, parent key) tuples would be exact too, but nested tuples re-hash the whole prefix on every
  dict lookup (tuples do not cache their hash), O(prompt^2) per admission.
- Only full blocks whose every position has been computed are registered, after the step that computed
  them (Scheduler.update): a block still being filled, or written in the very step another request would
  read it, is never shared. Two requests that compute the same block at once keep private copies; the
  first registered wins.
- A fully cached prompt still computes its last token (its logits are what we sample from): admission
  never reuses the block holding the last known token, so no request ever writes into a shared block.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence

from mixserve.core.batch import RequestId, ScheduleOutput
from mixserve.core.blocks import BlockPool, BlockSpace
from mixserve.core.config import SchedulerConfig
from mixserve.core.request import Request, Status


def chain_keys(tokens: Sequence[int], block_size: int, num_blocks: int, keys: list[bytes]) -> list[bytes]:
    """Extend `keys` (the keys of the first len(keys) full blocks of `tokens`) to `num_blocks` keys."""
    for i in range(len(keys), num_blocks):
        block = array("q", tokens[i * block_size : (i + 1) * block_size])
        if len(block) != block_size:
            raise ValueError(f"block {i} is not full: {len(block)} of {block_size} tokens")
        parent = keys[i - 1] if i else b""
        keys.append(hashlib.sha256(parent + block.tobytes()).digest())
    return keys


class PrefixCachingPool:
    """A BlockSpace whose blocks are reference-counted and may be shared through their keys.

    num_free() counts every unreferenced block, cached or not: a cached one is evicted (its key dropped)
    when allocate() needs it, least recently freed first. Fresh, block 0 comes out first.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._refs = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # front = evict next
        self._block_of: dict[bytes, int] = {}  # key -> the block holding that prefix's K/V
        self._key_of: dict[int, bytes] = {}  # the inverse, for eviction

    # ---- BlockSpace ----------------------------------------------------------------------------

    def num_free(self) -> int:
        return len(self._free)

    def num_held(self) -> int:
        """Blocks referenced by at least one request (what kv_cache_usage counts)."""
        return self.num_blocks - len(self._free)

    def num_cached(self) -> int:
        """Blocks registered under a key, referenced or not."""
        return len(self._key_of)

    def refs(self, block: int) -> int:
        """How many block tables hold `block`."""
        return self._refs[block]

    def is_cached(self, block: int) -> bool:
        return block in self._key_of

    def allocate(self, n: int) -> list[int]:
        """Take `n` unreferenced blocks, evicting cached ones least recently freed first."""
        if n < 0 or n > len(self._free):
            raise RuntimeError(f"cannot allocate {n} blocks: {len(self._free)} free")
        blocks = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            key = self._key_of.pop(b, None)
            if key is not None:  # evicted: its K/V are about to be overwritten
                del self._block_of[key]
            self._refs[b] = 1
            blocks.append(b)
        return blocks

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference to each block of a block table; a block nobody holds stays cached.

        The tail goes on the free list first, so it is evicted first: a cached block is useless once the
        block it extends is gone. Freeing a block nobody holds (a double free) raises ValueError.
        """
        for b in reversed(list(blocks)):
            if self._refs[b] <= 0:
                raise ValueError(f"block {b} is not held (double free?)")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free[b] = None

    # ---- the cache -----------------------------------------------------------------------------

    def match(self, keys: Iterable[bytes]) -> list[int]:
        """The blocks of the longest cached run keys[0], keys[1], ...; takes no reference."""
        blocks = []
        for key in keys:
            b = self._block_of.get(key)
            if b is None:
                break
            blocks.append(b)
        return blocks

    def take(self, blocks: Iterable[int]) -> None:
        """One more reference to each cached block (a match), taking it off the free list if need be."""
        for b in blocks:
            if b not in self._key_of:
                raise ValueError(f"block {b} is not cached")
            if self._refs[b] == 0:
                del self._free[b]
            self._refs[b] += 1

    def register(self, block: int, key: bytes) -> bool:
        """Cache a held, full, computed block under `key`; False if another block has the key already."""
        if self._refs[block] <= 0:
            raise ValueError(f"block {block} is not held: only a request's own computed block is cached")
        old = self._key_of.get(block)
        if old is not None:
            if old != key:
                raise RuntimeError(f"block {block} is cached under another key")
            return True
        if key in self._block_of:
            return False  # computed twice at once: the first copy is shared, this one stays private
        self._block_of[key] = block
        self._key_of[block] = key
        return True

    def check(self) -> None:
        """RuntimeError unless refs, free list and key maps agree (free = unreferenced; maps inverse)."""
        if any(r < 0 for r in self._refs):
            raise RuntimeError("a block has a negative reference count")
        unreferenced = {b for b, r in enumerate(self._refs) if r == 0}
        if set(self._free) != unreferenced:
            raise RuntimeError(f"free list != unreferenced blocks: {sorted(set(self._free) ^ unreferenced)}")
        if len(self._block_of) != len(self._key_of) or any(
            self._key_of.get(b) != k for k, b in self._block_of.items()
        ):
            raise RuntimeError("the key -> block and block -> key maps disagree")


class PrefixCache:
    """What the scheduler calls: admit a request after its cached prefix, register what a step computed."""

    def __init__(self, pool: PrefixCachingPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.num_queries = 0  # tokens of requests admitted (prompt, or prompt + generated after preemption)
        self.num_hits = 0  # of those, tokens whose K/V came from the cache

    def admit(self, r: Request) -> int:
        """Give a waiting request with no blocks the longest cached run of its full blocks; returns its hits.

        The block holding the last known token is never reused (see the module docstring), so at least
        one token is computed and every position written lies in a block of the request's own.
        """
        if r.block_table or r.num_computed:
            raise RuntimeError(f"request {r.request_id!r} is admitted while holding blocks")
        usable = (len(r.tokens) - 1) // self.block_size
        keys = chain_keys(r.tokens, self.block_size, usable, r.block_keys)
        hit = self.pool.match(keys[:usable])
        self.pool.take(hit)
        r.block_table = hit
        r.num_computed = len(hit) * self.block_size
        self.num_queries += len(r.tokens)
        self.num_hits += r.num_computed
        return r.num_computed

    def undo(self, r: Request) -> None:
        """The admission did not happen after all (no chunk this step): give the cached blocks back."""
        self.num_queries -= len(r.tokens)
        self.num_hits -= r.num_computed
        self.pool.free(r.block_table)
        r.block_table = []
        r.num_computed = 0

    def register_step(self, out: ScheduleOutput, requests: Mapping[RequestId, Request],
                      kept: Mapping[RequestId, int] | None = None) -> None:
        """After a step ran: register every block its decodes and chunks filled, with their keys;
        `kept[rid]`: the drafts a speculating decode kept (its rejected ones' slots are not filled)."""
        kept = kept or {}
        spans = [(rid, None) for rid in out.decodes] + [(c.request_id, c) for c in out.chunks]
        for rid, chunk in spans:
            r = requests.get(rid)
            if r is None or r.status is not Status.RUNNING:
                continue  # finished or aborted after the step was scheduled: its blocks are gone
            start, end = (r.num_computed - 1 - kept.get(rid, 0), r.num_computed) if chunk is None else (
                chunk.start, chunk.start + chunk.length)
            first, full = start // self.block_size, end // self.block_size  # blocks first..full-1 filled
            if full > first:
                keys = chain_keys(r.tokens, self.block_size, full, r.block_keys)
                for i in range(first, full):
                    self.pool.register(r.block_table[i], keys[i])

    @classmethod
    def for_config(cls, cfg: SchedulerConfig, blocks: BlockSpace) -> PrefixCache | None:
        """The scheduler's cache if cfg enables it (its pool must then be a PrefixCachingPool), else None."""
        if not cfg.enable_prefix_caching:
            return None
        if not isinstance(blocks, PrefixCachingPool):
            raise ValueError(f"enable_prefix_caching needs a PrefixCachingPool, got {type(blocks).__name__}")
        return cls(blocks, cfg.block_size)

    def stats(self) -> dict[str, int]:
        """The SchedulerStats fields this cache fills."""
        return {"prefix_cache_queries": self.num_queries, "prefix_cache_hits": self.num_hits,
                "num_cached_blocks": self.pool.num_cached()}


def new_pool(cfg: SchedulerConfig) -> BlockSpace:
    """The pool a Scheduler builds for itself: caching or plain, as cfg says."""
    return PrefixCachingPool(cfg.num_blocks) if cfg.enable_prefix_caching else BlockPool(cfg.num_blocks)
