"""Paged attention kernels (store_kv, paged_decode_attention) against their PyTorch references.

On a machine without CUDA they run on CPU tensors through Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1), so the shapes stay small; float32 and float16 only (the interpreter's bfloat16 is
broken). Small tiles (block_n=16) let small contexts cross several tiles and several splits.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from mixserve import kernels  # noqa: E402
from mixserve.core import ForwardBatch, ForwardSeq  # noqa: E402
from mixserve.kernels import paged_attention as pa  # noqa: E402
from mixserve.model.attention.gpu import GpuAttention  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3}


def paged_case(num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, ctx: int,
               dtype: torch.dtype, seed: int = 0, table_dtype: torch.dtype = torch.int64) -> dict:
    """Random caches, a strided q (a slice of a fused qkv buffer) and scattered, shuffled block tables.

    Row 0 looks like a CUDA graph's padding row: seq_len 1 and every table entry the same scratch block.
    The others run from very short to the full ctx.
    """
    g = torch.Generator().manual_seed(seed)
    width = ctx // block_size
    num_blocks = num_seqs * width + 5
    k_cache, v_cache = (torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
                        for _ in range(2))
    qkv = torch.randn(num_seqs, num_heads + 2 * num_kv_heads, head_dim, generator=g).to(dtype)
    q = qkv[:, :num_heads]  # strides ((Hq + 2 Hkv) D, D, 1): not contiguous
    tables = torch.randperm(num_blocks, generator=g)[: num_seqs * width].view(num_seqs, width)
    scratch = num_blocks - 1
    tables[0] = scratch
    lengths = [1, ctx, 3, ctx // 2 + 1, ctx - block_size + 1][:num_seqs]
    return {"q": q.to(DEVICE), "k_cache": k_cache.to(DEVICE), "v_cache": v_cache.to(DEVICE),
            "block_tables": tables.to(DEVICE, table_dtype), "seq_lens": torch.tensor(lengths, device=DEVICE),
            "ctx": ctx}


def assert_matches_reference(case: dict, **kwargs) -> None:
    got = pa.paged_decode_attention(**case, **kwargs)
    want = pa.paged_decode_attention_ref(**case, scale=kwargs.get("scale"))
    assert got.shape == case["q"].shape and got.dtype == case["q"].dtype
    assert not got.isnan().any()
    tol = TOLERANCE[case["q"].dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


# (Hq, Hkv, D, block_size, ctx): GQA groups 4, 4, 1 and 8, head dims 16 and 64, blocks of 4 and 16.
# Few heads and sequences: the interpreter's time grows with the number of programs.
SHAPES = [(8, 2, 16, 4, 96), (16, 4, 64, 16, 64), (4, 4, 16, 16, 64), (16, 2, 64, 4, 48)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "hq{}-hkv{}-d{}-bs{}-ctx{}".format(*s))
def test_decode_matches_reference_over_splits(shape: tuple, dtype: torch.dtype):
    num_heads, num_kv_heads, head_dim, block_size, ctx = shape
    case = paged_case(4, num_heads, num_kv_heads, head_dim, block_size, ctx, dtype)
    tiles = ctx // 16
    # One split; two; one per tile (the short rows leave most splits wholly past their length).
    for num_splits in (1, 2, tiles):
        assert_matches_reference(case, num_splits=num_splits, block_n=16)


def test_decode_with_default_tiles_and_splits():
    # block_n 64 over ctx 256: 4 tiles; the default splits 2 sequences x 2 KV heads into 4.
    case = paged_case(2, 8, 2, 16, 16, 256, torch.float32, seed=1)
    assert pa.default_num_splits(2, 2, 256) == 4
    assert_matches_reference(case)


def test_decode_odd_shapes_int32_tables_and_explicit_scale():
    # Head dim 24 and group 3 are padded inside the kernel; three splits of two tiles over 5 tiles.
    case = paged_case(4, 6, 2, 24, 8, 80, torch.float16, seed=2, table_dtype=torch.int32)
    assert_matches_reference(case, num_splits=3, block_n=16, scale=0.3)


def test_default_splits_fill_the_gpu_only_when_the_batch_is_small():
    assert pa.default_num_splits(64, 8, 512) == 1  # 512 programs already cover 2 x 132 SMs
    assert pa.default_num_splits(1, 8, 512) == 8  # capped at ctx // BLOCK_N tiles
    assert pa.default_num_splits(4, 8, 4096) == 9  # ceil(264 / 32)
    assert pa.default_num_splits(2, 8, 32) == 1  # less than one tile: never split


def test_store_kv_writes_exactly_the_named_slots():
    g = torch.Generator().manual_seed(3)
    num_kv_heads, head_dim, num_tokens = 3, 24, 5
    qkv = torch.randn(num_tokens, 4 + 2 * num_kv_heads, head_dim, generator=g)
    k, v = qkv[:, 4:4 + num_kv_heads], qkv[:, 4 + num_kv_heads:]  # strided views, cast to fp16 on the way
    cache = torch.randn(2, 6, 4, num_kv_heads, head_dim, generator=g).to(torch.float16)
    slots = torch.tensor([17, 2, 23, 8, 9])
    got = [c.clone().to(DEVICE) for c in cache]
    pa.store_kv(k.to(DEVICE), v.to(DEVICE), *got, slots.to(DEVICE))
    want = [c.clone() for c in cache]
    pa.store_kv_ref(k, v, *want, slots)
    for g_cache, w_cache, before in zip(got, want, cache, strict=True):
        assert torch.equal(g_cache.cpu(), w_cache)
        changed = (w_cache != before).flatten(0, 1).any(dim=(1, 2)).nonzero().flatten()
        assert changed.tolist() == sorted(slots.tolist())  # the named slots, nothing else


# ---- wiring: GpuAttention's decode part ----------------------------------------------------

def decode_batch() -> ForwardBatch:
    """Three decodes (block size 4, contexts of 10, 8 and 9 tokens) over scattered blocks."""
    return ForwardBatch([ForwardSeq("a", [1], 9, [5, 6, 7]), ForwardSeq("b", [2], 7, [1, 9]),
                         ForwardSeq("c", [3], 8, [2, 10, 12])])


def run_backend(backend: GpuAttention, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    k_cache, v_cache = (torch.randn(16, 4, 2, 16, generator=g).to(DEVICE) for _ in range(2))
    qkv = torch.randn(batch.num_tokens, 8 + 2 + 2, 16, generator=g).to(DEVICE)
    q, k, v = qkv[:, :8], qkv[:, 8:10], qkv[:, 10:]
    meta = backend.prepare(batch, 4, DEVICE)
    return backend.forward(q, k, v, k_cache, v_cache, meta), k_cache


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """use_triton says yes for any tensor (CPU ones run in the interpreter); counts each kernel's calls."""
    counts = {"paged_decode_attention": 0, "store_kv": 0}
    monkeypatch.setattr(kernels, "use_triton", lambda t: True)
    for name in counts:
        kernel = getattr(pa, name)

        def counted(*args, _kernel=kernel, _name=name, **kwargs):
            counts[_name] += 1
            return _kernel(*args, **kwargs)

        monkeypatch.setattr(pa, name, counted)
    return counts


def test_backend_decode_runs_the_triton_kernel_when_use_triton(calls: dict[str, int]):
    auto = GpuAttention()
    assert auto.parts(DEVICE)[0].name == "triton"
    got, got_cache = run_backend(auto, decode_batch())
    assert calls == {"paged_decode_attention": 1, "store_kv": 1}
    want, want_cache = run_backend(GpuAttention(decode_kernel="dense"), decode_batch())
    assert calls == {"paged_decode_attention": 1, "store_kv": 2}  # dense attention; the write is store_kv
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got_cache, want_cache)


def test_backend_decode_stays_dense_without_triton():
    if not torch.cuda.is_available():
        assert GpuAttention().parts(DEVICE)[0].name == "dense"
    kernels.set_enabled(False)  # as a failed start-up self-check leaves them
    try:
        assert GpuAttention().parts(DEVICE)[0].name == "dense"
    finally:
        kernels.set_enabled(True)
    with pytest.raises(ValueError, match="decode_kernel"):
        GpuAttention(decode_kernel="paged")
