"""Quantized weights read in place (mixserve/model/cpu/quant_linear.py): the C++ decoder of every format
equals gguf-py's dequantize exactly; `linear` (the few-row block kernel up to FEW_ROWS rows, decoded tiles +
torch's GEMM above) equals x @ dequantize(w).T to float32 rounding; fused (cat) weights, the embedding lookup,
int8 per output channel and bf16 inputs. Each test runs on the native build and the AVX2 one (conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator

import gguf
import numpy as np
import pytest
import torch
from gguf import quants

from mixserve.model.cpu import quant_linear as ql

pytestmark = pytest.mark.usefixtures("kernel_build")

BLOCK_TYPES = [t for t in ql.FORMATS if t != ql.INT8_ROW]
IDS = {t: ql.FORMATS[t][0] for t in ql.FORMATS}
# byte offsets of each block's fp16 fields (ggml-common.h): d, and m / dmin where the format has one; every
# other byte of a block (quants, 6-bit sub-block scales, Q6_K's int8 scales) may take any value
HALF_FIELDS = {2: (0,), 3: (0, 2), 6: (0,), 7: (0, 2), 8: (0,), 12: (0, 2), 13: (0, 2), 14: (208,)}
ROWS = [1, 2, 3, 4, 5, 16, 17, 40]  # both sides of FEW_ROWS: the block kernel, then tiles + GEMM
N, K = 37, 512  # n odd and not a multiple of the kernel's 4 columns; k a whole number of 256-element blocks
U = 2.0**-24  # float32's unit roundoff


def random_blocks(qtype: int, n: int, k: int, seed: int) -> np.ndarray:
    """(n, row bytes) uint8 of random blocks whose fp16 fields are finite scales of either sign."""
    _, elems, nbytes = ql.FORMATS[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // elems, nbytes), dtype=np.uint8)
    for off in HALF_FIELDS[qtype]:
        halves = rng.uniform(-0.05, 0.05, size=(n, k // elems)).astype(np.float16)
        raw[:, :, off : off + 2] = halves.view(np.uint8).reshape(n, k // elems, 2)
    return raw.reshape(n, -1)


def weight(qtype: int, n: int = N, k: int = K, seed: int = 0) -> ql.QuantWeight:
    return ql.from_blocks(qtype, torch.from_numpy(random_blocks(qtype, n, k, seed)), k)


def reference(raw: np.ndarray, qtype: int) -> torch.Tensor:
    return torch.from_numpy(quants.dequantize(raw, gguf.GGMLQuantizationType(qtype)).astype(np.float32))


def int8_dot(w: ql.QuantWeight) -> bool:
    """This product is integer dots on int8-rounded inputs, at any number of rows: `w` marked `int8_inputs`,
    every segment a format with them (C++ int8_dot_takes: every GGUF format, and int8 per channel where k is
    a multiple of 32, which with_int8_inputs checks)."""
    return w.int8_inputs and all(s.qtype in ql.INT8_FORMATS for s in w.segments)


def as_tested(w: ql.QuantWeight, int8_inputs: bool) -> ql.QuantWeight:
    return ql.with_int8_inputs(w) if int8_inputs else w


def rounded_inputs(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x as the integer-dot path sees it (csrc/quant_dot.h): blocks of 32 rounded to d q, d = amax / 127;
    and d where x / d is within float32 rounding of a tie (bf16 inputs hit x / d = 63.5 exactly): there the
    kernel's rounding (its reciprocal and product under -freciprocal-math) may fall either side, d apart."""
    m, k = x.shape
    blocks = x.reshape(m, k // 32, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    scaled = blocks * torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    q = torch.round(scaled).clamp(-127, 127)
    tie = ((scaled - scaled.floor() - 0.5).abs() <= 1e-5 * scaled.abs()).float()
    return (amax / 127 * q).reshape(m, k), (tie * amax / 127).reshape(m, k)


def assert_linear_close(got: torch.Tensor, x: torch.Tensor, deq: torch.Tensor, bias: torch.Tensor | None,
                        int8_inputs: bool = False) -> None:
    """got = x @ deq.T + bias to float32 rounding. A float32 sum of k products, in any order (SIMD lanes,
    MKL's blocking), is within k u sum|x_i w_i| of the exact sum (the classical bound, one rounding per add
    and product); (k + 2) u covers the bias add. One wrong, missing or swapped element moves y by ~|x w|,
    about 1/k of sum|x w| (2e-3 at k = 512): far above the bound (3e-5). The integer-dot path is held to the
    same bound against the inputs it rounds (rounded_inputs), computed exactly here, plus a step a tie."""
    xr, ties = rounded_inputs(x) if int8_inputs else (x, torch.zeros_like(x))
    ref = xr.double() @ deq.double().T + (0 if bias is None else bias.double())
    scale = xr.double().abs() @ deq.double().abs().T + (0 if bias is None else bias.double().abs())
    err = ((got.double() - ref).abs() - ties.double() @ deq.double().abs().T).clamp_min(0) / scale
    assert got.dtype == torch.float32 and got.shape == ref.shape
    assert float(err.max()) <= (x.shape[1] + 2) * U, float(err.max())


@pytest.fixture
def two_threads() -> Iterator[None]:
    """Two threads for the panel kernels (a split of the panels between them is what is tested), restored."""
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(params=[False, True], ids=["float-products", "int8-inputs"])
def int8_inputs(request: pytest.FixtureRequest) -> bool:
    """Both settings of QuantWeight.int8_inputs (Q4_0/Q4_1/Q5_x/Q8_0 products on int8-rounded inputs: the
    block kernel for few rows, from INT8_PANEL_ROWS the VNNI panels where the build has them)."""
    return request.param


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=IDS.get)
def test_decode_of_random_blocks_equals_gguf_exactly(qtype: int) -> None:
    raw = random_blocks(qtype, N, K, seed=qtype)
    w = ql.from_blocks(qtype, torch.from_numpy(raw), K)
    assert (w.shape, w.n, w.k, w.formats, w.nbytes) == ((N, K), N, K, (IDS[qtype],), raw.nbytes)
    got = ql.dequantize(w)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    assert torch.equal(got, reference(raw, qtype))


@pytest.mark.parametrize("qtype", [t for t in BLOCK_TYPES if ql.FORMATS[t][1] == 32], ids=IDS.get)
def test_decode_of_quantized_real_tensors_equals_gguf_exactly(qtype: int) -> None:
    g = torch.Generator().manual_seed(qtype)
    x = torch.randn(24, 96, generator=g) * torch.logspace(-3, 1, 24)[:, None]  # rows of very different scale
    try:
        raw = quants.quantize(x.numpy(), gguf.GGMLQuantizationType(qtype))
    except NotImplementedError:
        pytest.skip(f"gguf-py cannot quantize {IDS[qtype]}")
    got = ql.dequantize(ql.from_blocks(qtype, torch.from_numpy(raw), 96))
    assert torch.equal(got, reference(raw, qtype))
    assert float(((got - x).abs().amax(1) / x.abs().amax(1)).max()) < 0.2  # it is x, quantized


def test_from_blocks_refuses_rows_of_the_wrong_size() -> None:
    with pytest.raises(ValueError, match="Q4_K rows of 96 elements"):
        ql.from_blocks(12, torch.zeros(4, 54, dtype=torch.uint8), 96)  # k not a whole number of blocks
    with pytest.raises(ValueError, match="Q8_0"):
        ql.from_blocks(8, torch.zeros(4, 33, dtype=torch.uint8), 32)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=IDS.get)
def test_linear_equals_the_dequantized_matmul(int8_inputs: bool, qtype: int, rows: int) -> None:
    w = as_tested(weight(qtype, seed=qtype), int8_inputs)
    deq = ql.dequantize(w)
    g = torch.Generator().manual_seed(rows)
    x, bias = torch.randn(rows, K, generator=g), torch.randn(N, generator=g)
    assert_linear_close(ql.linear(x, w, bias), x, deq, bias, int8_dot(w))
    assert_linear_close(ql.linear(x, w, None), x, deq, None, int8_dot(w))
    wide = torch.cat([x, torch.randn(rows, 32, generator=g)], dim=1)[:, :K]  # row stride > k
    assert_linear_close(ql.linear(wide, w, bias), x, deq, bias, int8_dot(w))


@pytest.mark.parametrize("rows", [1, 3, 16, 17, 40])
def test_cat_of_formats_equals_the_dequantized_concatenation(int8_inputs: bool, rows: int,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    parts = [weight(8, 5, seed=1), weight(8, 6, seed=2), weight(14, 7, seed=3), weight(2, 3, seed=4)]
    fused = as_tested(ql.cat(parts), int8_inputs)
    assert [ql.FORMATS[s.qtype][0] for s in fused.segments] == ["Q8_0", "Q6_K", "Q4_0"]  # adjacent Q8_0 merge
    assert fused.shape == (21, K) and fused.formats == ("Q8_0", "Q6_K", "Q4_0")
    assert fused.nbytes == sum(p.nbytes for p in parts)
    deq = torch.cat([ql.dequantize(p) for p in parts])
    assert torch.equal(ql.dequantize(fused), deq)
    g = torch.Generator().manual_seed(rows)
    x, bias = torch.randn(rows, K, generator=g), torch.randn(21, generator=g)
    # every segment's product on the rounded inputs (int8_inputs), each checked apart
    got = ql.linear(x, fused, bias)
    for cols in (slice(0, 11), slice(11, 18), slice(18, 21)):
        assert_linear_close(got[:, cols], x, deq[cols], bias[cols], int8_inputs)
    # the path of CPUs without panels: tiles of 4 rows decoded row-major, segments split across several
    monkeypatch.setattr(ql, "_TILE_ELEMS", 4 * K)
    assert_linear_close(ql._tiles(x, fused, bias), x, deq, bias, False)
    with pytest.raises(ValueError, match="different widths"):
        ql.cat([weight(8, 2, k=64), weight(8, 2, k=96)])


@pytest.mark.parametrize("n", [150, 300])
@pytest.mark.parametrize("rows", [ql.FEW_ROWS + 1, 133])
@pytest.mark.parametrize(("qtype", "k"),
                         [(3, 576), (8, 608), (14, 768), (ql.INT8_ROW, 301), (ql.INT8_ROW, 608)],
                         ids=["Q4_1", "Q8_0", "Q6_K", "int8", "int8-k608"])
def test_panel_product_covers_every_panel_and_strip(two_threads: None, int8_inputs: bool, qtype: int, k: int,
                                                    rows: int, n: int) -> None:
    """Past FEW_ROWS a weight of several column panels, the last one partial (64-wide panels on AVX-512, 16
    on AVX2; n = 300 makes an odd count the threads split, one panel's rows shared), and a k that ends in a
    partial strip of 256 (int8: and in less than a vector, where its inputs stay float; k = 608 takes the
    int8 panels): each panel and strip decoded to its place and multiplied by every row."""
    g = torch.Generator().manual_seed(rows + k)
    w = ql.quantize_int8(torch.randn(n, k, generator=g)) if qtype == ql.INT8_ROW else weight(qtype, n, k, 7)
    w = as_tested(w, int8_inputs)  # int8: the VNNI panels are 32 wide, so 150 is 5 (an odd count), 300 is 10
    x, bias = torch.randn(rows, k, generator=g), torch.randn(n, generator=g)
    assert_linear_close(ql.linear(x, w, bias), x, ql.dequantize(w), bias, int8_dot(w))
    assert_linear_close(ql.linear(x, w, None), x, ql.dequantize(w), None, int8_dot(w))


def test_map_rows_permutes_rows_and_scales() -> None:
    w = ql.cat([weight(3, 6, seed=5), ql.quantize_int8(torch.randn(4, K))])  # Q4_1 rows, then int8 rows

    def swap_pairs(t: torch.Tensor) -> torch.Tensor:  # applied to each segment's rows (and int8's scales)
        return t[torch.arange(t.shape[0]).view(-1, 2).flip(1).flatten()]

    got = ql.dequantize(ql.map_rows(w, swap_pairs))
    assert torch.equal(got, ql.dequantize(w)[torch.tensor([1, 0, 3, 2, 5, 4, 7, 6, 9, 8])])


@pytest.mark.parametrize("qtype", BLOCK_TYPES + [ql.INT8_ROW], ids=IDS.get)
def test_embedding_is_the_dequantized_rows(qtype: int) -> None:
    table = ql.quantize_int8(torch.randn(50, 96)) if qtype == ql.INT8_ROW else weight(qtype, 50, K, seed=6)
    deq = ql.dequantize(table)
    ids = torch.tensor([3, 0, 49, 3, 17, 17, 2])  # repeats, out of order, the last row
    assert torch.equal(ql.embedding(ids, table, torch.float32), deq[ids])
    assert torch.equal(ql.embedding(ids.int(), table, torch.bfloat16), deq[ids].bfloat16())
    assert ql.embedding(ids[:0], table, torch.float32).shape == (0, table.k)
    with pytest.raises(ValueError, match="one format"):
        ql.embedding(ids, ql.cat([weight(8, 50, seed=1), weight(2, 50, seed=2)]), torch.float32)


@pytest.mark.parametrize("k", [96, 45])  # 45: not a multiple of any vector width (the scalar tail)
def test_int8_per_channel_error_is_at_most_half_a_step(k: int) -> None:
    g = torch.Generator().manual_seed(k)
    w = torch.randn(33, k, generator=g) * torch.logspace(-2, 2, 33)[:, None]
    w[5] = 0.0  # an all-zero row: a tiny scale, no division by zero
    q = ql.quantize_int8(w)
    assert q.formats == ("int8",) and q.shape == (33, k) and q.nbytes == 33 * k + 33 * 4
    scales = q.segments[0].scales
    deq = ql.dequantize(q)
    assert torch.equal(deq, q.segments[0].data.view(torch.int8).float() * scales[:, None])
    # round(w / s) s is within s / 2 of w, plus float32 rounding of the division and product (a few ulps of w)
    assert bool(((deq - w).abs() <= scales[:, None] / 2 + 4 * U * w.abs()).all())
    assert torch.equal(deq[5], torch.zeros(k)) and torch.isfinite(scales).all()
    assert torch.allclose(scales, w.abs().amax(1) / 127, rtol=0, atol=torch.finfo(torch.float32).tiny)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("k", [96, 45])
def test_int8_per_channel_linear_equals_its_dequantized_weight(int8_inputs: bool, rows: int, k: int) -> None:
    """int8 inputs (W8A8): k = 96 integer dots (the block kernel, then the int8 panels), the row scales on the
    sums; k = 45 is not marked (no blocks of 32) and keeps float products."""
    g = torch.Generator().manual_seed(rows * k)
    q = as_tested(ql.quantize_int8(torch.randn(N, k, generator=g)), int8_inputs)
    assert q.int8_inputs == (int8_inputs and k == 96)
    x, bias = torch.randn(rows, k, generator=g), torch.randn(N, generator=g)
    assert_linear_close(ql.linear(x, q, bias), x, ql.dequantize(q), bias, int8_dot(q))


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 40])
@pytest.mark.parametrize("qtype", [8, 3, 12, 14, ql.INT8_ROW], ids=IDS.get)
def test_bf16_inputs_are_computed_in_float32_and_rounded_once(int8_inputs: bool, qtype: int,
                                                               rows: int) -> None:
    """Below BF16_PANEL_ROWS (or without AVX512-BF16) the float32 product rounded once to bf16; from it, the
    bf16 panels' float32 sums (test_bf16_panels_multiply_bf16_pairs_into_float32_sums) rounded once."""
    w = ql.quantize_int8(torch.randn(N, K)) if qtype == ql.INT8_ROW else weight(qtype, seed=qtype)
    w, deq = as_tested(w, int8_inputs), ql.dequantize(w)
    g = torch.Generator().manual_seed(rows)
    x, bias = torch.randn(rows, K, generator=g).bfloat16(), torch.randn(N, generator=g).bfloat16()
    got = ql.linear(x, w, bias)
    assert got.dtype == torch.bfloat16
    if rows >= ql.BF16_PANEL_ROWS and ql.bf16_panels() and not w.int8_inputs:
        assert torch.equal(got, ql._bf16_panels(x, w, bias.float()).bfloat16())
        return
    want = ql.linear(x.float(), w, bias.float())  # the float32 result (checked above), rounded once to bf16
    assert torch.equal(got, want.bfloat16())
    assert_linear_close(want, x.float(), deq, bias.float(), int8_dot(w))


@pytest.mark.parametrize("n", [150, 300])
@pytest.mark.parametrize("rows", [ql.BF16_PANEL_ROWS, 133])
@pytest.mark.parametrize(("qtype", "k"), [(3, 576), (8, 608), (14, 768), (ql.INT8_ROW, 302)],
                         ids=["Q4_1", "Q8_0", "Q6_K", "int8"])
def test_bf16_panels_multiply_bf16_pairs_into_float32_sums(two_threads: None, qtype: int, k: int, rows: int,
                                                           n: int) -> None:
    """The bf16 panels (AVX512-BF16 builds) are the decoded weight rounded to bf16 (nearest even, as torch)
    times the bf16 inputs, exact products summed in float32: within float32's bound of x @ bf16(w).T, over
    several panels and partial strips. A wrong pair order or rounding moves a sum far past that bound."""
    if not ql.bf16_panels():
        pytest.skip("these kernels are built without AVX512-BF16 (the bf16 panels' instruction)")
    g = torch.Generator().manual_seed(rows + k)
    w = ql.quantize_int8(torch.randn(n, k, generator=g)) if qtype == ql.INT8_ROW else weight(qtype, n, k, 7)
    x, bias = torch.randn(rows, k, generator=g).bfloat16(), torch.randn(n, generator=g)
    w_bf16 = ql.dequantize(w).bfloat16().float()
    assert_linear_close(ql._bf16_panels(x, w, bias), x.float(), w_bf16, bias)
    assert_linear_close(ql._bf16_panels(x, w, None), x.float(), w_bf16, None)
