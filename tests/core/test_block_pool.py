"""The KV block pool: lowest ids first, no double free, and an invariant it checks itself."""

from __future__ import annotations

import random

import pytest

from mixserve.core import BlockPool


def test_allocate_and_free():
    pool = BlockPool(4)
    assert pool.allocate(2) == [0, 1]
    assert pool.num_free() == 2
    pool.free([0])
    assert sorted(pool.allocate(2)) == [0, 2]
    with pytest.raises(RuntimeError, match="1 free"):
        pool.allocate(2)
    with pytest.raises(ValueError, match="not held"):
        pool.free([3])
    pool.check()


def test_check_catches_a_corrupt_pool():
    pool = BlockPool(3)
    pool.allocate(1)
    pool._free.append(0)  # held and free at once
    with pytest.raises(RuntimeError, match="both free and held"):
        pool.check()
    pool = BlockPool(3)
    pool._free.pop()  # a block lost
    with pytest.raises(RuntimeError, match="total"):
        pool.check()


def test_random_traffic_keeps_the_invariant():
    rng = random.Random(0)
    pool = BlockPool(16)
    held: list[int] = []
    for _ in range(500):
        if held and rng.random() < 0.5:
            rng.shuffle(held)
            k = rng.randint(1, len(held))
            pool.free(held[:k])
            held = held[k:]
        else:
            held += pool.allocate(rng.randint(0, pool.num_free()))
        pool.check()
        assert pool.num_free() + len(held) == 16 and len(set(held)) == len(held)
