"""Fixtures for the tensor-parallel tests: tiny checkpoints whose heads split unevenly, mixed batches."""

from __future__ import annotations

from pathlib import Path

import pytest

from mixserve.core.batch import ForwardBatch, ForwardSeq
from tests.distributed.tiny_tp import make_tiny_tp_llama


@pytest.fixture(scope="session")
def uneven_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """6 query heads in 3 KV groups (2 ranks: 2 groups + 1), odd MLP width, untied LM head."""
    return make_tiny_tp_llama(tmp_path_factory.mktemp("tp_uneven"), heads=6, kv_heads=3, tie=False)


@pytest.fixture(scope="session")
def one_group_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 query heads in 1 KV group: 2 ranks replicate the KV head and take 2 query heads each."""
    return make_tiny_tp_llama(tmp_path_factory.mktemp("tp_one_group"), heads=4, kv_heads=1)


def mixed_steps(block_size: int) -> list[ForwardBatch]:
    """Three steps of two requests: chunked prefill beside a whole prompt, then a chunk beside a decode,
    then two decodes — every kind of row the engine mixes, reading K/V written by earlier steps."""
    a = [11 + (7 * i) % 290 for i in range(14)]
    b = [40, 41, 42, 43, 44]
    ta, tb = list(range(0, 5)), list(range(8, 10))  # block tables, not contiguous
    assert len(ta) * block_size >= 16 and len(tb) * block_size >= 7
    return [
        ForwardBatch([ForwardSeq("a", a[:8], 0, ta), ForwardSeq("b", b, 0, tb)]),
        ForwardBatch([ForwardSeq("b", [45], 5, tb), ForwardSeq("a", a[8:], 8, ta)]),
        ForwardBatch([ForwardSeq("a", [17], 14, ta), ForwardSeq("b", [46], 6, tb)]),
    ]
