"""paged_varlen_attention (mixed batches over block tables) against its PyTorch reference, and its wiring.

On a machine without CUDA the kernel runs on CPU tensors through Triton's interpreter (tests/conftest.py
sets TRITON_INTERPRET=1), so the shapes stay small; float32 and float16 only (the interpreter's bfloat16
is broken). Small KV tiles (block_n=16) let short contexts cross several of them.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from mixserve import kernels  # noqa: E402
from mixserve.core import ForwardBatch, ForwardSeq  # noqa: E402
from mixserve.kernels import varlen_attention as va  # noqa: E402
from mixserve.model.attention.gpu import GpuAttention  # noqa: E402
from mixserve.model.attention.packed_flex import FlexPlan  # noqa: E402
from mixserve.model.attention.packed_varlen import VarlenPlan  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3}

# (query_len, seq_len) per sequence: a decode at a long context, a chunk resuming mid-sequence, a whole
# prompt, a decode of a one-token context, a short chunk crossing a block boundary. Query lengths 1, 7,
# 11, 1, 5: none a multiple of the block_m values below except by accident of 1.
MIXED = [(1, 37), (7, 27), (11, 11), (1, 1), (5, 8)]


def varlen_case(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                lens: list[tuple[int, int]] = MIXED, seed: int = 0) -> dict:
    """Random caches, a strided q (a slice of a fused qkv buffer) and scattered, shuffled block tables."""
    g = torch.Generator().manual_seed(seed)
    width = max(-(-length // block_size) for _, length in lens)
    num_blocks = len(lens) * width + 3
    k_cache, v_cache = (torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
                        for _ in range(2))
    num_tokens = sum(n for n, _ in lens)
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=g).to(dtype)
    q = qkv[:, :num_heads]  # strides ((Hq + 2 Hkv) D, D, 1): not contiguous
    tables = torch.randperm(num_blocks, generator=g)[: len(lens) * width].view(len(lens), width)
    query_start = torch.tensor([0] + [n for n, _ in lens]).cumsum(0)
    return {"q": q.to(DEVICE), "k_cache": k_cache.to(DEVICE), "v_cache": v_cache.to(DEVICE),
            "block_tables": tables.to(DEVICE), "seq_lens": torch.tensor([s for _, s in lens], device=DEVICE),
            "query_start": query_start.to(DEVICE)}


def assert_matches_reference(case: dict, block_m: int, **kwargs) -> None:
    query_lens = (case["query_start"][1:] - case["query_start"][:-1]).tolist()
    tile_seq, tile_start = (torch.tensor(t, device=DEVICE) for t in va.build_tiles(query_lens, block_m))
    got = va.paged_varlen_attention(**case, tile_seq=tile_seq, tile_start=tile_start, block_m=block_m,
                                    **kwargs)
    want = va.paged_varlen_attention_ref(**case, scale=kwargs.get("scale"))
    assert got.shape == case["q"].shape and got.dtype == case["q"].dtype
    assert not got.isnan().any()
    tol = TOLERANCE[case["q"].dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


# (Hq, Hkv, D, block_size): GQA groups 1, 4 and 8, head dims 16 and 64, blocks of 4 and 16.
SHAPES = [(2, 2, 16, 4), (8, 2, 16, 16), (8, 1, 64, 4), (4, 1, 64, 16)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "hq{}-hkv{}-d{}-bs{}".format(*s))
def test_mixed_batch_matches_reference(shape: tuple, dtype: torch.dtype):
    num_heads, num_kv_heads, head_dim, block_size = shape
    case = varlen_case(num_heads, num_kv_heads, head_dim, block_size, dtype)
    group = num_heads // num_kv_heads
    # One token per tile (decode-like), a non-power-of-two tile, and the default for the group.
    for block_m in sorted({1, 3, va.default_block_m(group)}):
        assert_matches_reference(case, block_m, block_n=16)


def test_default_tiles_and_explicit_scale():
    # block_n 64 over a 150-token context: 3 KV tiles; block_m 16 (group 4) splits the 40-token chunk.
    case = varlen_case(4, 1, 16, 16, torch.float32, lens=[(40, 150), (1, 70), (3, 3)], seed=1)
    assert_matches_reference(case, va.default_block_m(4))
    assert_matches_reference(case, 5, scale=0.3)


def test_odd_group_and_head_dim():
    # Group 3 and head dim 24 are padded inside the kernel (rows and dims masked); int32 block tables.
    case = varlen_case(6, 2, 24, 8, torch.float16, lens=[(6, 20), (1, 9), (4, 4)], seed=2)
    case["block_tables"] = case["block_tables"].to(torch.int32)
    assert_matches_reference(case, 2, block_n=16)
    assert_matches_reference(case, va.default_block_m(3), block_n=16)


def test_build_tiles_cut_each_sequence_on_its_own():
    assert va.build_tiles([1, 5, 3], 2) == ([0, 1, 1, 1, 2, 2], [0, 1, 3, 5, 6, 8])
    assert va.build_tiles([4, 1], 4) == ([0, 1], [0, 4])
    assert va.build_tiles([1, 1, 1], 64) == ([0, 1, 2], [0, 1, 2])  # decodes: one tile each
    assert va.build_tiles([], 8) == ([], [])
    with pytest.raises(ValueError, match="block_m"):
        va.build_tiles([3], 0)


def test_default_block_m_gives_16_to_64_rows():
    assert [va.default_block_m(g) for g in (1, 2, 3, 4, 8, 16, 64, 128)] == [64, 32, 16, 16, 8, 4, 1, 1]


# ---- wiring: GpuAttention's packed part ---------------------------------------------------------

def mixed_batch() -> ForwardBatch:
    """A decode at context 10, a chunk resuming at position 3, and a first chunk of 6 (block size 4)."""
    return ForwardBatch([ForwardSeq("a", [1], 9, [5, 6, 7]), ForwardSeq("b", [2, 3, 4], 3, [1, 9]),
                         ForwardSeq("c", [5, 6, 7, 8, 9, 10], 0, [2, 10])])


def run_backend(backend: GpuAttention, batch: ForwardBatch) -> tuple[torch.Tensor, object]:
    """One layer (Hq 8, Hkv 2: group 4) through `backend` on caches holding the same random history."""
    g = torch.Generator().manual_seed(4)
    k_cache, v_cache = (torch.randn(16, 4, 2, 16, generator=g).to(DEVICE) for _ in range(2))
    qkv = torch.randn(batch.num_tokens, 8 + 2 + 2, 16, generator=g).to(DEVICE)
    q, k, v = qkv[:, :8], qkv[:, 8:10], qkv[:, 10:]
    meta = backend.prepare(batch, 4, DEVICE)
    return backend.forward(q, k, v, k_cache, v_cache, meta), meta.plan


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """use_triton says yes for any tensor (CPU ones run in the interpreter); records each launch's block_m."""
    block_ms: list[int] = []
    real = va.paged_varlen_attention
    monkeypatch.setattr(kernels, "use_triton", lambda t: True)
    monkeypatch.setattr(va, "paged_varlen_attention",
                        lambda *a, **k: block_ms.append(a[8]) or real(*a, **k))
    return block_ms


def test_backend_packed_path_runs_the_triton_kernel(launches: list[int]):
    backend = GpuAttention()
    assert backend.parts(DEVICE)[1].name == "triton"
    got, plan = run_backend(backend, mixed_batch())
    assert isinstance(plan, VarlenPlan) and plan.block_m == va.default_block_m(4)
    # prepare guessed group 1 (block_m 64); the first forward retiled for group 4, the next prepare knows.
    assert launches == [va.default_block_m(4)]
    again, plan = run_backend(backend, mixed_batch())
    assert plan.block_m == va.default_block_m(4) and launches == [16, 16]
    assert plan.tile_seq.tolist() == [0, 1, 2] and plan.tile_start.tolist() == [0, 1, 4]
    want, plan = run_backend(GpuAttention(packed_kernel="flex"), mixed_batch())
    assert isinstance(plan, FlexPlan) and len(launches) == 2
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(again, want, atol=1e-5, rtol=1e-5)


def test_a_configured_backend_tiles_for_its_group_from_the_first_step(launches: list[int]):
    backend = GpuAttention()
    backend.configure(num_heads=8, num_kv_heads=2, device=DEVICE)  # as ModelRunner does
    plan = backend.prepare(mixed_batch(), 4, DEVICE).plan
    assert isinstance(plan, VarlenPlan) and plan.block_m == va.default_block_m(4)


def test_backend_tiles_ride_in_the_one_h2d_copy(launches: list[int]):
    backend = GpuAttention()
    meta = backend.prepare(mixed_batch(), 4, DEVICE)
    plan = meta.plan
    assert isinstance(plan, VarlenPlan)
    one_buffer = meta.positions.untyped_storage().data_ptr()
    for t in (plan.tile_seq, plan.tile_start, meta.seq_lens, meta.block_tables):
        assert t.untyped_storage().data_ptr() == one_buffer


def test_backend_packed_path_stays_flex_without_triton():
    backend = GpuAttention(packed_kernel="triton")
    if not torch.cuda.is_available():
        assert backend.parts(DEVICE)[1].name == "flex"
        assert isinstance(backend.prepare(mixed_batch(), 4, DEVICE).plan, FlexPlan)
    with pytest.raises(ValueError, match="packed_kernel"):
        GpuAttention(packed_kernel="varlen")
