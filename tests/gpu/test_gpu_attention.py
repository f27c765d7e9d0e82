"""GpuAttention on the CPU (dense decode, eager FlexAttention; small shapes): the host flattener, block
lists, the SDPA fallback, outputs vs torch_ref."""

from __future__ import annotations

import contextlib

import pytest
import torch

from mixserve.core import ForwardBatch, ForwardSeq
from mixserve.model.attention.base import flatten, is_decode_only
from mixserve.model.attention.dense_decode import DecodePlan, context_capacity, dense_decode_capacity
from mixserve.model.attention.gpu import GpuAttention
from mixserve.model.attention.packed_flex import FLEX_BLOCK, FlexPlan, block_ranges, bucket
from mixserve.model.attention.torch_ref import TorchAttention

BLOCK_SIZE = 4
HQ, HKV, D = 4, 2, 8
NUM_BLOCKS = 64


def seq(rid: str, n_tokens: int, start: int, blocks: list[int]) -> ForwardSeq:
    return ForwardSeq(rid, list(range(n_tokens)), start, blocks)


def mixed_batch() -> ForwardBatch:
    """Two decodes, a chunk resuming at position 7, and a first chunk of 9 tokens (scattered blocks)."""
    return ForwardBatch([
        seq("d1", 1, 5, [3, 9]),
        seq("d2", 1, 0, [4]),
        seq("c1", 6, 7, [11, 2, 30, 17]),
        seq("c2", 9, 0, [40, 41, 8]),
    ])


def run_both(batch: ForwardBatch, seed: int = 0, num_blocks: int = NUM_BLOCKS) -> tuple:
    """Fill the caches with the same history, run one layer's attention through both backends."""
    g = torch.Generator().manual_seed(seed)
    history = torch.randn(2, num_blocks, BLOCK_SIZE, HKV, D, generator=g)
    t = batch.num_tokens
    q, k, v = (torch.randn(t, h, D, generator=g) for h in (HQ, HKV, HKV))
    outs, caches = [], []
    for backend in (TorchAttention(), GpuAttention()):
        kc, vc = history[0].clone(), history[1].clone()
        meta = backend.prepare(batch, BLOCK_SIZE, torch.device("cpu"))
        outs.append(backend.forward(q, k, v, kc, vc, meta))
        caches.append((kc, vc))
    return outs[0], outs[1], caches[0], caches[1]


def test_bucket_pads_to_a_few_sizes():
    assert bucket(1) == FLEX_BLOCK and bucket(129) == 256 and bucket(4096) == 4096
    assert bucket(4097) == 8192 and bucket(9000) == 12288
    assert context_capacity(5, 16) == 16 and context_capacity(513, 16) == 576
    assert context_capacity(640, 16) == 640 and context_capacity(5, 4) == 8


def test_the_flattener_follows_the_block_tables():
    host = flatten(mixed_batch(), BLOCK_SIZE)
    assert host.positions[:3] == [5, 0, 7]
    # d1 position 5 -> block_table[1] = 9, offset 1; c1 position 7 -> block_table[1] = 2, offset 3
    assert host.slot_mapping[:3] == [9 * 4 + 1, 4 * 4, 2 * 4 + 3]
    assert host.seq_lens == [6, 1, 13, 9]
    assert host.width == 4 and len(host.block_tables) == 16
    assert host.block_tables[:4] == [3, 9, 0, 0]  # padded with 0 to the widest table the contexts need


def test_block_ranges_keep_only_overlapping_sequences():
    q_seq = torch.full((2 * FLEX_BLOCK,), -1)
    q_seq[:FLEX_BLOCK] = 0
    q_seq[FLEX_BLOCK:FLEX_BLOCK + 10] = 1
    kv_seq = torch.full((3 * FLEX_BLOCK,), 2)
    kv_seq[:FLEX_BLOCK] = 0
    kv_seq[FLEX_BLOCK:FLEX_BLOCK + 5] = 0
    kv_seq[FLEX_BLOCK + 5:2 * FLEX_BLOCK + 3] = 1
    blocks = block_ranges(q_seq, kv_seq, num_seqs=2)
    assert blocks.tolist() == [[True, True, False], [True, True, True]]


def test_mixed_batch_matches_reference():
    ref, flex, ref_cache, flex_cache = run_both(mixed_batch())
    torch.testing.assert_close(flex, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(flex_cache[0], ref_cache[0])
    torch.testing.assert_close(flex_cache[1], ref_cache[1])


def test_decode_only_batch_takes_dense_path_and_matches_reference():
    batch = ForwardBatch([seq("a", 1, 9, [5, 6, 7]), seq("b", 1, 7, [1, 9]), seq("c", 1, 8, [2, 10, 12])])
    assert is_decode_only(batch)
    meta = GpuAttention().prepare(batch, BLOCK_SIZE, torch.device("cpu"))
    assert isinstance(meta.plan, DecodePlan) and meta.block_tables.shape == (3, 12 // BLOCK_SIZE)
    assert dense_decode_capacity([10, 8, 9], BLOCK_SIZE) == 12
    ref, flex, _, _ = run_both(batch, seed=1)
    torch.testing.assert_close(flex, ref, atol=1e-5, rtol=1e-5)


def test_unbalanced_decodes_take_the_packed_path():
    short = [seq(f"s{i}", 1, 2, [30 + i]) for i in range(4)]
    batch = ForwardBatch([seq("long", 1, 90, list(range(23))), *short])
    assert dense_decode_capacity([s.start + 1 for s in batch.seqs], BLOCK_SIZE) is None
    assert isinstance(GpuAttention().prepare(batch, BLOCK_SIZE, torch.device("cpu")).plan, FlexPlan)
    ref, flex, _, _ = run_both(batch, seed=4)
    torch.testing.assert_close(flex, ref, atol=1e-5, rtol=1e-5)


def test_long_packed_batch_spanning_several_flex_blocks():
    # 3 chunks whose packed KV crosses several 128-entry blocks, so the sparse block lists matter.
    batch = ForwardBatch([
        seq("a", 70, 100, list(range(0, 43))),
        seq("b", 1, 150, list(range(43, 81))),
        seq("c", 90, 0, list(range(81, 104))),
    ])
    ref, flex, _, _ = run_both(batch, seed=2, num_blocks=128)
    torch.testing.assert_close(flex, ref, atol=1e-5, rtol=1e-5)


def test_sparse_block_lists_cover_every_visible_pair():
    # Eager flex ignores block sparsity, so check the lists the compiled kernel iterates directly.
    batch = ForwardBatch([
        seq("a", 200, 100, list(range(0, 75))),
        seq("b", 1, 150, list(range(75, 113))),
        seq("c", 90, 0, list(range(113, 136))),
    ])
    plan = GpuAttention().prepare(batch, BLOCK_SIZE, torch.device("cpu")).plan
    assert isinstance(plan, FlexPlan)
    bm = plan.block_mask
    q_idx = torch.arange(plan.q_pad)[:, None]
    kv_idx = torch.arange(plan.kv_pad)[None, :]
    visible = bm.mask_mod(0, 0, q_idx, kv_idx)
    needed = visible.view(plan.q_pad // FLEX_BLOCK, FLEX_BLOCK, -1, FLEX_BLOCK).any(dim=3).any(dim=1)
    listed = torch.zeros_like(needed)
    for i, n in enumerate(bm.kv_num_blocks[0, 0].tolist()):
        listed[i, bm.kv_indices[0, 0, i, :n].long()] = True
    assert bool((listed | ~needed).all()), "a visible (query, key) pair sits in an unlisted block"
    assert int(listed.sum()) < listed.numel(), "nothing was pruned"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_flex_matches_reference_on_cuda():
    dev = torch.device("cuda")
    batch = mixed_batch()
    g = torch.Generator().manual_seed(3)
    t = batch.num_tokens
    q, k, v = (torch.randn(t, h, D, generator=g).to(dev, torch.bfloat16) for h in (HQ, HKV, HKV))
    outs = []
    # packed_kernel="flex": compiled FlexAttention; the default runs the Triton varlen kernel where it can.
    for backend in (TorchAttention(), GpuAttention(packed_kernel="flex"), GpuAttention()):
        kc = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, HKV, D, device=dev, dtype=torch.bfloat16)
        vc = torch.zeros_like(kc)
        meta = backend.prepare(batch, BLOCK_SIZE, dev)
        outs.append(backend.forward(q, k, v, kc, vc, meta).float())
    torch.testing.assert_close(outs[1], outs[0], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(outs[2], outs[0], atol=2e-2, rtol=2e-2)


def test_a_failing_flex_falls_back_to_the_reference(monkeypatch):
    backend = GpuAttention()
    packed = backend.parts(torch.device("cpu"))[1]

    def broken(device):
        raise RuntimeError("no flex here")

    monkeypatch.setattr(packed, "flex_fn", broken)
    batch = mixed_batch()
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(batch.num_tokens, h, D, generator=g) for h in (HQ, HKV, HKV))
    outs = []
    for b in (TorchAttention(), backend):
        kc, vc = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, HKV, D), torch.zeros(NUM_BLOCKS, BLOCK_SIZE, HKV, D)
        with pytest.warns(RuntimeWarning) if b is backend else contextlib.nullcontext():
            outs.append(b.forward(q, k, v, kc, vc, b.prepare(batch, BLOCK_SIZE, torch.device("cpu"))))
    torch.testing.assert_close(outs[1], outs[0])
    assert backend.fallback_reason == "RuntimeError: no flex here"
