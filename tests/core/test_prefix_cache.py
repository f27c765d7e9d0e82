"""The prefix-caching pool and its keys: chained keys, reference counts, LRU eviction, its invariant."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mixserve.core import PrefixCachingPool
from mixserve.core.prefix_cache import chain_keys


def keys(tokens: list[int], n: int, bs: int = 4) -> list[bytes]:
    return chain_keys(tokens, bs, n, [])


def test_a_key_names_the_whole_prefix_not_just_its_block():
    a = keys([1, 2, 3, 4, 5, 6, 7, 8], 2)
    assert a == keys([1, 2, 3, 4, 5, 6, 7, 8, 9], 2)  # the tokens after the blocks do not matter
    b = keys([1, 2, 3, 9, 5, 6, 7, 8], 2)  # same second block, different first one
    assert a[0] != b[0] and a[1] != b[1]
    assert len(set(a)) == 2 and all(len(k) == 32 for k in a)  # SHA-256 digests
    # token ids are fixed-width in the key: [1, 23] and [12, 3] can never meet
    assert keys([1, 23], 1, bs=2) != keys([12, 3], 1, bs=2)


def test_chain_keys_extends_and_refuses_a_partial_block():
    known = keys([1, 2, 3, 4], 1)
    assert chain_keys([1, 2, 3, 4, 5, 6, 7, 8], 4, 2, list(known)) == keys([1, 2, 3, 4, 5, 6, 7, 8], 2)
    with pytest.raises(ValueError, match="not full"):
        keys([1, 2, 3, 4, 5], 2)


def test_freed_blocks_stay_cached_and_count_as_free():
    pool = PrefixCachingPool(4)
    blocks = pool.allocate(2)
    assert blocks == [0, 1] and pool.num_free() == 2
    k = keys([1, 2, 3, 4, 5, 6, 7, 8], 2)
    assert pool.register(0, k[0]) and pool.register(1, k[1])
    pool.free(blocks)
    assert pool.num_free() == 4 and pool.num_held() == 0 and pool.num_cached() == 2
    assert pool.match(k) == [0, 1]
    assert pool.match([k[1]]) == [1] and pool.match([b"x" * 32, k[1]]) == []
    pool.take([0, 1])
    assert pool.num_free() == 2 and pool.refs(0) == 1
    pool.take([0])  # a second request shares block 0
    pool.free([0, 1])
    assert pool.refs(0) == 1 and pool.refs(1) == 0 and pool.num_free() == 3
    pool.check()


def test_eviction_is_least_recently_freed_first_and_a_tail_before_its_head():
    pool = PrefixCachingPool(4)
    a, b = pool.allocate(2), pool.allocate(2)
    for blk in (*a, *b):
        pool.register(blk, bytes([blk]) * 32)
    pool.free(a)  # a's tail (1) then head (0) go on the free list
    pool.free(b)
    assert pool.allocate(1) == [1]
    assert not pool.is_cached(1) and pool.match([bytes([1]) * 32]) == []  # evicted: its key is gone
    assert pool.allocate(2) == [0, 3]
    assert pool.match([bytes([2]) * 32]) == [2]
    pool.check()


def test_a_key_already_cached_keeps_its_first_block():
    pool = PrefixCachingPool(2)
    x, y = pool.allocate(2)
    assert pool.register(x, b"k" * 32)
    assert not pool.register(y, b"k" * 32)  # computed twice at once: y stays private
    assert pool.register(x, b"k" * 32)  # idempotent
    with pytest.raises(RuntimeError, match="another key"):
        pool.register(x, b"j" * 32)
    pool.free([y])
    assert not pool.is_cached(y)
    with pytest.raises(ValueError, match="not held"):
        pool.register(y, b"j" * 32)
    with pytest.raises(ValueError, match="not cached"):
        pool.take([y])
    with pytest.raises(ValueError, match="double free"):
        pool.free([y])
    with pytest.raises(RuntimeError, match="cannot allocate 2"):
        pool.allocate(2)


def test_check_catches_a_corrupt_pool():
    pool = PrefixCachingPool(3)
    pool.allocate(1)
    pool._free[0] = None  # held and free at once
    with pytest.raises(RuntimeError, match="free list"):
        pool.check()
    pool = PrefixCachingPool(3)
    (b,) = pool.allocate(1)
    pool.register(b, b"k" * 32)
    pool._key_of[b] = b"j" * 32
    with pytest.raises(RuntimeError, match="maps disagree"):
        pool.check()


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), num_blocks=st.integers(1, 12))
def test_random_ops_never_hand_out_a_referenced_block(seed: int, num_blocks: int):
    """Requests allocate, register, match-and-take and free at random; a model of who holds what must
    agree with the pool, allocate() must never return a block someone holds, and in the end every block
    is free (cached or not)."""
    rng = random.Random(seed)
    pool = PrefixCachingPool(num_blocks)
    tables: list[list[int]] = []
    universe = [bytes([i]) * 32 for i in range(6)]
    for _ in range(200):
        op = rng.random()
        held = {b for t in tables for b in t}
        if op < 0.35 and pool.num_free():
            new = pool.allocate(rng.randint(1, pool.num_free()))
            assert not held & set(new), "allocate handed out a referenced block"
            tables.append(new)
        elif op < 0.55 and tables:
            b = rng.choice(rng.choice(tables))
            if not pool.is_cached(b):
                pool.register(b, rng.choice(universe))
        elif op < 0.75:
            hit = pool.match(rng.sample(universe, rng.randint(1, len(universe))))
            pool.take(hit)
            if hit:
                tables.append(hit)
        elif tables:
            pool.free(tables.pop(rng.randrange(len(tables))))
        pool.check()
        for b in range(num_blocks):
            assert pool.refs(b) == sum(t.count(b) for t in tables)
        assert pool.num_free() == num_blocks - len({b for t in tables for b in t})
    for t in tables:
        pool.free(t)
    pool.check()
    assert pool.num_free() == num_blocks and pool.num_held() == 0
