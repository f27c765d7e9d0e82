"""The C++ CPU attention kernel against attention by its definition, over the shapes it dispatches on."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from mixserve.core.batch import ForwardBatch, ForwardSeq
from mixserve.model.attention import get_backend
from mixserve.model.attention.cpu_paged import CpuPagedAttention
from mixserve.model.cpu import build as cpu_build


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """q (n, Hq, D) at positions start.., k/v (L, Hkv, D) -> (n, Hq, D), float64, causal, GQA."""
    rep = q.shape[1] // k.shape[1]
    q, k, v = q.double(), k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    scores = torch.einsum("nhd,lhd->hnl", q, k) / q.shape[-1] ** 0.5
    qpos = torch.arange(start, start + q.shape[0]).unsqueeze(1)
    scores = scores.masked_fill(torch.arange(k.shape[0]).unsqueeze(0) > qpos, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v)


# the kernel tests run on the native build and on the AVX2 one (conftest.py)
both_builds = pytest.mark.usefixtures("kernel_build")


def error_past_rounding(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest |got - want| past what rounding the exact answer to got's dtype loses: bf16 keeps 8
    significant bits, so the exact value rounded to bf16 is off by up to half an ulp, 2^-8 |want| (at
    q_scale 8 an output is nearly one V value: 4.2349 rounds to 4.25, 0.0151 that no bf16 kernel can avoid).
    float32 outputs: the whole error."""
    err = (got.double() - want).abs()
    if got.dtype == torch.bfloat16:
        err = err - 2 ** -8 * want.abs()
    return err.max().item()


def run_random_batch(seed: int, hq: int, hkv: int, d: int, bs: int, dtype: torch.dtype,
                     max_start: int = 70, max_chunk: int = 40, layout: list[tuple[int, int]] | None = None,
                     q_scale: float = 1.0) -> float:
    """A random mixed batch on scattered blocks (or sequences of the given (start, tokens)); returns the
    largest error against the reference past the output's own rounding (error_past_rounding). q_scale > 1
    spreads the scores (each row's running max then moves far, tile after tile)."""
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    num_blocks = 256 * max(1, (max_start + max_chunk) // 110)
    free = list(range(num_blocks))
    rng.shuffle(free)
    k_cache = torch.randn(num_blocks, bs, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, bs, hkv, d, generator=g).to(dtype)
    seqs, histories = [], []
    if layout is None:  # decodes, and chunks across tile edges
        layout = [(rng.choice([0, 0, rng.randint(1, max_start)]),
                   rng.choice([1, 1, rng.randint(1, max_chunk)])) for _ in range(rng.randint(1, 7))]
    for i, (start, n) in enumerate(layout):
        table = [free.pop() for _ in range(-(-(start + n) // bs))]
        seqs.append(ForwardSeq(str(i), [0] * n, start, table))
        histories.append((start, n, table))
    backend = CpuPagedAttention()
    meta = backend.prepare(ForwardBatch(seqs), bs, torch.device("cpu"))
    t = meta.positions.shape[0]
    # q as a strided view of a fused projection, the way the model hands it over
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g)
    qkv[:, : hq * d] *= q_scale
    qkv = qkv.to(dtype)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
    out = backend.forward(q, k, v, k_cache, v_cache, meta)
    worst, begin = 0.0, 0
    for start, n, table in histories:
        slots = [table[p // bs] * bs + p % bs for p in range(start + n)]
        keys = k_cache.view(-1, hkv, d)[slots]
        values = v_cache.view(-1, hkv, d)[slots]
        want = reference(q[begin : begin + n], keys, values, start)
        worst = max(worst, error_past_rounding(out[begin : begin + n], want))
        begin += n
    return worst


def bf16_bound(d: int) -> float:
    """bf16 inputs, float32 products and sums, one rounding of the output (which error_past_rounding takes
    off): what is left is float32's, as for float32 inputs (2e-5). With AVX512-BF16 in the build (head dims a
    multiple of 32) P.V runs vdpbf16ps on probabilities rounded to bf16, as torch's own CPU flash attention
    does for bf16 (its attn_reduced copy): that adds at most 2^-9 * sum_j p_j |v_j| <= 2^-9 * max |v| (under
    4.5 for these N(0, 1) values). Asked of the build, not the CPU: the AVX2 build on an AVX-512 CPU has no
    vdpbf16ps."""
    return 2e-5 + (2 ** -9 * 4.5 if "avx512_bf16" in cpu_build.kernel_isa() and d % 32 == 0 else 0.0)


# Head dims 32, 64, 80, 96, 128: decodes take the decode item (paged_decode.h), chunks the key-major one
# (paged_chunk.h); 16: the generic tile loop; (8, 1, 128): a tile of 16 tokens fills all 128 rows
@both_builds
@pytest.mark.parametrize(("hq", "hkv", "d"), [(9, 3, 64), (6, 3, 128), (8, 8, 16), (8, 1, 128), (4, 2, 80),
                                              (16, 2, 32), (12, 4, 96)])
@pytest.mark.parametrize("bs", [1, 4, 16])
def test_float32_mixed_batches_match_the_definition(hq: int, hkv: int, d: int, bs: int) -> None:
    for seed in range(3):
        assert run_random_batch(seed, hq, hkv, d, bs, torch.float32) < 2e-5


@both_builds
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("hq", "hkv", "d"), [(9, 3, 64), (8, 1, 128), (6, 3, 128), (12, 4, 96), (4, 2, 80)])
def test_long_contexts_and_chunks_match_the_definition(hq: int, hkv: int, d: int, dtype: torch.dtype) -> None:
    # Chunks of up to 90 tokens at positions up to 400: many key tiles before each chunk's diagonal, a
    # diagonal crossing tiles and tokens; partial last tiles (rows not a multiple of 16).
    for seed in range(2):
        bound = 2e-5 if dtype == torch.float32 else bf16_bound(d)
        assert run_random_batch(seed, hq, hkv, d, 16, dtype, max_start=400, max_chunk=90) < bound


# (9, 3, 64), (6, 3, 128): decodes are one item over every KV head, their rows widened per key tile;
# (16, 16, 128): a key's row of all heads (2048) is past the widening buffer, so decodes go per KV head
@both_builds
@pytest.mark.parametrize(("hq", "hkv", "d"), [(9, 3, 64), (6, 3, 128), (4, 2, 80), (16, 16, 128), (12, 4, 96),
                                              (16, 2, 32)])
@pytest.mark.parametrize("bs", [1, 4, 16])
def test_bfloat16_mixed_batches_match_the_definition(hq: int, hkv: int, d: int, bs: int) -> None:
    for seed in range(3):
        assert run_random_batch(seed, hq, hkv, d, bs, torch.bfloat16) < bf16_bound(d)


# A decode runs its keys in spans (256 keys for 9 heads, 128 for 32: SPAN_FLOATS / heads): contexts on
# both sides of span edges, next to a chunk; q spread wide so the chunk's running max moves again and again
# (the bf16 chunk rescales only when it moves far).
@both_builds
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("hq", "hkv", "d"), [(9, 3, 64), (32, 8, 64), (8, 2, 128)])
@pytest.mark.parametrize("q_scale", [1.0, 8.0])
def test_decodes_across_span_edges_match_the_definition(hq: int, hkv: int, d: int, dtype: torch.dtype,
                                                        q_scale: float) -> None:
    layout = [(c - 1, 1) for c in (1, 127, 128, 129, 255, 256, 257, 513, 700)] + [(300, 48)]
    # bf16 inputs, float32 sums, bf16 output (bf16_bound)
    tol = 2e-5 if dtype == torch.float32 else bf16_bound(d)
    assert run_random_batch(0, hq, hkv, d, 16, dtype, layout=layout, q_scale=q_scale) < tol


# A decode verifying drafts (2-8 query tokens) is one item over every KV head while its rows fit (n x hq <=
# 128): each token a key fewer than the next, across span edges; 32 heads at 5+ tokens take the tiles instead.
@both_builds
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("hq", "hkv", "d"), [(9, 3, 64), (32, 8, 64), (8, 2, 128), (12, 4, 96)])
def test_short_queries_across_span_edges_match_the_definition(hq: int, hkv: int, d: int,
                                                              dtype: torch.dtype) -> None:
    ends = (2, 17, 128, 129, 256, 257, 258, 300, 513)
    layout = [(c - n, n) for c, n in zip(ends, (2, 8, 5, 2, 3, 8, 7, 4, 6), strict=True)]
    tol = 2e-5 if dtype == torch.float32 else bf16_bound(d)
    assert run_random_batch(0, hq, hkv, d, 16, dtype, layout=layout, q_scale=8.0) < tol
    assert run_random_batch(1, hq, hkv, d, 16, dtype, layout=layout) < tol


@both_builds
@pytest.mark.parametrize(("hq", "hkv", "d"), [(9, 3, 64), (8, 2, 128)])
def test_bf16_decodes_with_spread_scores_are_the_exact_answer_rounded(hq: int, hkv: int, d: int) -> None:
    # q scaled by 8: each row's softmax is nearly one key, its output nearly one V value (up to ~4.3): the
    # outputs are the exact ones rounded to bf16, to float32's error, on the build without vdpbf16ps (its
    # span softmax, max and rescale all float32). An AVX2 CPU failed the span-edge test here with 0.0151 >
    # 2^-7 under a bound that took |output| <= 2, where rounding 4.2349 to bf16 alone costs that much.
    layout = [(c - 1, 1) for c in (127, 129, 256, 257, 513, 700)]
    bound = bf16_bound(d)
    assert run_random_batch(2, hq, hkv, d, 16, torch.bfloat16, layout=layout, q_scale=8.0) < bound
    if "avx512_bf16" not in cpu_build.kernel_isa():
        assert bound == 2e-5


def test_each_build_is_the_code_it_names(kernel_build: str) -> None:
    isa = cpu_build.kernel_isa()
    if kernel_build == "avx2":
        assert "-march=haswell" in cpu_build.flags() and isa == {"avx2"}
    else:
        assert "-march=native" in cpu_build.flags()
        assert ("avx512f" in isa) == ("avx512f" in cpu_build.cpu_flags().split())
    assert cpu_build.describe().startswith(f"-march={cpu_build.march()}: ")


def test_a_shape_the_kernel_cannot_take_is_a_clear_error() -> None:
    backend = CpuPagedAttention()
    meta = backend.prepare(ForwardBatch([ForwardSeq("x", [1], 0, [0])]), 4, torch.device("cpu"))
    cache = torch.zeros(1, 4, 1, 512)
    with pytest.raises(ValueError, match="cannot take this shape"):
        backend.forward(torch.zeros(1, 1, 512), torch.zeros(1, 1, 512), torch.zeros(1, 1, 512), cache, cache,
                        meta)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        half = torch.zeros(1, 1, 8, dtype=torch.float16)
        backend.forward(half, half, half, cache.half()[..., :8], cache.half()[..., :8], meta)


def test_no_compiler_falls_back_to_torch_with_one_warning(monkeypatch, tmp_path, caplog) -> None:
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
    monkeypatch.setenv("MIXSERVE_CACHE", str(tmp_path))
    cpu_build.load_library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="mixserve"):
            backend = get_backend("auto", "cpu")
        assert backend.name == "torch"
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "CPU attention kernel unavailable" in warnings[0].getMessage()
        with pytest.raises(cpu_build.KernelBuildError):
            get_backend("cpu", "cpu")
    finally:
        cpu_build.load_library.cache_clear()


def test_the_library_is_built_once_and_cached(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("MIXSERVE_CACHE", str(tmp_path))
    cpu_build.load_library.cache_clear()
    try:
        cpu_build.load_library()
        built = list(tmp_path.glob("cpu_kernels-*.so"))
        assert len(built) == 1 and built[0] == cpu_build.library_path()
        mtime = built[0].stat().st_mtime_ns
        cpu_build.load_library.cache_clear()
        cpu_build.load_library()
        assert built[0].stat().st_mtime_ns == mtime  # loaded again, not rebuilt
    finally:
        cpu_build.load_library.cache_clear()


def test_loading_the_library_leaves_denormals_alone() -> None:
    # -ffast-math would link crtfastmath.o, which sets flush-to-zero for the whole process on load
    cpu_build.load_library()
    tiny = 5e-324  # the smallest double: a denormal
    assert tiny * 1.0 != 0.0
    assert (torch.tensor([1e-40]) * 1.0).item() != 0.0
