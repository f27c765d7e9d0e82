"""The row walk (csrc/quant_row_walk.h; up to 5 input rows: a single stream's decode step, one verifying
drafts): each thread walks its run of weight rows whole, one input row two blocks at a time, so a row of an
odd number of blocks ends on one alone; the rows split between the threads in runs, a small weight stays on
one thread. Each case against dequantize-then-matmul to float32 rounding, as every quantized product is
(test_quant_linear.assert_linear_close)."""

from __future__ import annotations

import pytest
import torch

from mixserve.model.cpu import quant_linear as ql
from tests.model.test_quant_linear import BLOCK_TYPES, IDS, assert_linear_close, two_threads, weight

__all__ = ["two_threads"]  # the fixture, used by name below
pytestmark = pytest.mark.usefixtures("kernel_build")
BLOCK32 = [t for t in BLOCK_TYPES if ql.FORMATS[t][1] == 32]
K_QUANTS = [t for t in BLOCK_TYPES if ql.FORMATS[t][1] == 256]


WALK_ROWS = [1, 2, 5]  # one row's two-block loop; the few-row loop; its most rows


def check_rows(w: ql.QuantWeight, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    deq = ql.dequantize(w)
    for rows in WALK_ROWS:
        x, bias = torch.randn(rows, w.k, generator=g), torch.randn(w.n, generator=g)
        assert_linear_close(ql.linear(x, w, bias), x, deq, bias)
        assert_linear_close(ql.linear(x, w, None), x, deq, None)
        wide = torch.cat([x, torch.randn(rows, 32, generator=g)], dim=1)[:, : w.k]  # a row stride past k
        assert_linear_close(ql.linear(wide, w, bias), x, deq, bias)


@pytest.mark.parametrize("n", [5, 301])  # one thread's few rows; an odd count split between two threads
@pytest.mark.parametrize("blocks", [1, 17, 18])  # a lone block, an odd count ending on one, pairs only
@pytest.mark.parametrize("qtype", BLOCK32, ids=IDS.get)
def test_row_walk_of_32_element_blocks(two_threads: None, qtype: int, blocks: int, n: int) -> None:
    check_rows(weight(qtype, n=n, k=32 * blocks, seed=qtype + blocks), seed=n)


@pytest.mark.parametrize("n", [5, 301])
@pytest.mark.parametrize("blocks", [1, 3])
@pytest.mark.parametrize("qtype", K_QUANTS, ids=IDS.get)
def test_row_walk_of_k_quant_super_blocks(two_threads: None, qtype: int, blocks: int, n: int) -> None:
    check_rows(weight(qtype, n=n, k=256 * blocks, seed=qtype + blocks), seed=n)


@pytest.mark.parametrize("n", [5, 301])
@pytest.mark.parametrize("k", [32, 544, 576])
def test_row_walk_of_int8_per_channel_applies_each_rows_scale(two_threads: None, k: int, n: int) -> None:
    g = torch.Generator().manual_seed(k + n)
    w = ql.quantize_int8(torch.randn(n, k, generator=g) * torch.logspace(-2, 1, n)[:, None])  # scales differ
    check_rows(w, seed=k)
