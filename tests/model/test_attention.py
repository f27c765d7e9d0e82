"""The CPU attention backends (reference and C++ paged kernel): paged K/V writes, causal attention, GQA."""

from __future__ import annotations

import pytest
import torch

from mixserve.core.batch import ForwardBatch, ForwardSeq
from mixserve.model.attention import get_backend
from mixserve.model.attention.base import build_metadata

HQ, HKV, D, BS, NBLOCKS = 4, 2, 8, 4, 32


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """q (n, HQ, D) at positions start.., k/v (L, HKV, D) at 0..L-1 -> (n, HQ, D), by the definition."""
    rep = HQ // HKV
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q, k) / D**0.5
    qpos = torch.arange(start, start + q.shape[0]).unsqueeze(1)
    scores = scores.masked_fill(torch.arange(k.shape[0]).unsqueeze(0) > qpos, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v)


@pytest.mark.parametrize("name", ["torch", "cpu"])
def test_backend_matches_definition_on_a_mixed_batch(name: str) -> None:
    g = torch.Generator().manual_seed(0)
    backend = get_backend(name, "cpu")
    k_cache = torch.zeros(NBLOCKS, BS, HKV, D)
    v_cache = torch.zeros(NBLOCKS, BS, HKV, D)
    # (start, new tokens, block table): decodes of different lengths (batched together), a middle chunk,
    # a first chunk, a chunk ending mid-block, a one-token prompt
    specs = [(9, 1, [7, 3, 30]), (5, 6, [1, 20, 2]), (0, 7, [11, 4]), (2, 3, [25, 26]), (3, 1, [8, 9]),
             (0, 1, [12])]
    full_k, full_v, seqs = [], [], []
    for i, (start, n, table) in enumerate(specs):
        kk = torch.randn(start + n, HKV, D, generator=g)
        vv = torch.randn(start + n, HKV, D, generator=g)
        for p in range(start):  # history a previous step wrote
            k_cache[table[p // BS], p % BS] = kk[p]
            v_cache[table[p // BS], p % BS] = vv[p]
        full_k.append(kk)
        full_v.append(vv)
        seqs.append(ForwardSeq(str(i), [0] * n, start, table))
    meta = backend.prepare(ForwardBatch(seqs), BS, torch.device("cpu"))
    q = torch.randn(meta.positions.shape[0], HQ, D, generator=g)
    k_new = torch.cat([kk[s:] for kk, (s, _, _) in zip(full_k, specs, strict=True)])
    v_new = torch.cat([vv[s:] for vv, (s, _, _) in zip(full_v, specs, strict=True)])
    out = backend.forward(q, k_new, v_new, k_cache, v_cache, meta)
    begin = 0
    for (start, n, table), kk, vv in zip(specs, full_k, full_v, strict=True):
        want = naive_attention(q[begin : begin + n], kk, vv, start)
        torch.testing.assert_close(out[begin : begin + n], want, atol=1e-5, rtol=1e-5)
        for p in range(start, start + n):  # the new K/V landed in the slots the block table names
            assert torch.equal(k_cache[table[p // BS], p % BS], kk[p])
            assert torch.equal(v_cache[table[p // BS], p % BS], vv[p])
        begin += n


def test_metadata_of_a_mixed_batch() -> None:
    batch = ForwardBatch([ForwardSeq("d", [5], 6, [3, 9]), ForwardSeq("c", [1, 2, 3], 3, [4, 0])])
    meta = build_metadata(batch, BS, torch.device("cpu"))
    assert meta.positions.tolist() == [6, 3, 4, 5]
    assert meta.slot_mapping.tolist() == [9 * BS + 2, 4 * BS + 3, 0 * BS + 0, 0 * BS + 1]
    assert meta.query_start.tolist() == [0, 1, 4]
    assert meta.seq_lens.tolist() == [7, 6]
    assert meta.last_token_index.tolist() == [0, 3]
    assert meta.block_tables.tolist() == [[3, 9], [4, 0]]


def test_block_table_too_short_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="block table of 1 blocks cannot hold 6 positions"):
        build_metadata(ForwardBatch([ForwardSeq("x", [1, 2], 4, [0])]), BS, torch.device("cpu"))


def test_get_backend_names() -> None:
    assert get_backend("auto", "cpu").name == "cpu"  # the C++ kernel, for float32 and bfloat16
    assert get_backend("auto", "cpu", torch.bfloat16).name == "cpu"
    assert get_backend("auto", "cpu", torch.float16).name == "torch"  # the kernel has no float16
    assert get_backend("torch", "cpu").name == "torch"
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        get_backend("nope", "cpu")


def test_runner_refuses_a_block_id_past_the_cache(tiny_model_dir) -> None:
    from mixserve import ModelRunner

    runner = ModelRunner.from_pretrained(str(tiny_model_dir), num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="block id 4 out of range: the KV cache has 4 blocks"):
        runner.forward(ForwardBatch([ForwardSeq("x", [1, 2, 3], 0, [4])]))
