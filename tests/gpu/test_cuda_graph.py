"""Decode graphs: the ladder, padding to a rung, and the static-buffer path (run eagerly on the CPU)."""

from __future__ import annotations

import pytest
import torch

from mixserve.core import ForwardBatch, ForwardSeq
from mixserve.model.attention.gpu import GpuAttention, paged_capacity
from mixserve.model.attention.torch_ref import TorchAttention
from mixserve.runner.cuda_graph import (
    DecodeGraphs,
    DecodeLayout,
    decode_host_inputs,
    decode_model_fn,
    graph_ladder,
    graph_size,
)
from mixserve.runner.model_runner import ModelRunner

BLOCK_SIZE = 4
NUM_BLOCKS = 32
SCRATCH = NUM_BLOCKS - 1  # no sequence in these tests owns it


def test_ladder_is_powers_of_two_then_max():
    assert graph_ladder(1) == [1]
    assert graph_ladder(8) == [1, 2, 4, 8]
    assert graph_ladder(48) == [1, 2, 4, 8, 16, 32, 48]
    with pytest.raises(ValueError):
        graph_ladder(0)


def test_graph_size_pads_up_to_the_next_rung():
    ladder = graph_ladder(48)
    assert [graph_size(n, ladder) for n in (1, 3, 5, 17, 48)] == [1, 4, 8, 32, 48]
    assert graph_size(49, ladder) is None


def test_padding_rows_point_at_the_scratch_block():
    layout = DecodeLayout(size=4, width=3)
    batch = ForwardBatch([ForwardSeq("a", [7], 5, [2, 9]), ForwardSeq("b", [8], 0, [4])])
    flat = decode_host_inputs(batch, layout, BLOCK_SIZE, scratch_block=SCRATCH)
    views = layout.views(torch.tensor(flat))
    assert views["token_ids"].tolist() == [7, 8, 0, 0]
    assert views["positions"].tolist() == [5, 0, 0, 0]
    assert views["slot_mapping"].tolist() == [9 * 4 + 1, 4 * 4, SCRATCH * 4, SCRATCH * 4]
    assert views["seq_lens"].tolist() == [6, 1, 1, 1]
    assert views["block_tables"].tolist() == [[2, 9, 0], [4, 0, 0], [SCRATCH] * 3, [SCRATCH] * 3]


def test_only_small_decode_only_batches_have_a_key():
    graphs = DecodeGraphs(lambda ids, meta: ids, dense(), block_size=BLOCK_SIZE, max_num_seqs=4,
                          scratch_block=SCRATCH, device=torch.device("cpu"), max_ctx=64)
    decode = ForwardSeq("a", [1], 9, [0, 1, 2])
    assert graphs.key(ForwardBatch([decode] * 3)) == (4, 12)
    assert graphs.key(ForwardBatch([decode] * 5)) is None  # over max_num_seqs
    assert graphs.key(ForwardBatch([decode, ForwardSeq("b", [1, 2], 0, [3])])) is None  # a chunk: eager
    assert graphs.key(ForwardBatch([ForwardSeq("c", [1], 100, list(range(26)))])) is None  # past max_ctx


def test_paged_capacity_is_a_power_of_two_in_whole_blocks():
    assert [paged_capacity(n, 16) for n in (1, 16, 17, 513, 1024, 1025)] == [16, 16, 32, 1024, 1024, 2048]
    assert paged_capacity(100, 48) == 144  # 128 rounded up to whole blocks


def test_paged_graphs_take_any_decode_only_batch():
    def make(paged: bool) -> DecodeGraphs:
        attention = GpuAttention(decode_kernel="triton" if paged else "dense")
        attention.configure(4, 2, torch.device("cpu"))
        return DecodeGraphs(lambda ids, meta: ids, attention, block_size=BLOCK_SIZE, max_num_seqs=4,
                            scratch_block=SCRATCH, device=torch.device("cpu"), max_ctx=64)

    long, short = ForwardSeq("a", [1], 40, list(range(11))), ForwardSeq("b", [1], 2, [11])
    lopsided = ForwardBatch([long, short, short])  # 44 of 3 x 44 slots: the dense path goes eager
    assert make(False).key(lopsided) is None
    assert make(True).key(lopsided) == (4, 64)
    assert make(True).key(ForwardBatch([short])) == (1, 4)
    assert make(True).key(ForwardBatch([short, ForwardSeq("c", [1, 2], 0, [12])])) is None  # a chunk


def dense() -> GpuAttention:
    attention = GpuAttention(decode_kernel="dense")
    attention.configure(4, 2, torch.device("cpu"))
    return attention


def test_a_backend_without_graph_hooks_gets_no_graphs():
    with pytest.raises(ValueError, match="torch attention backend does not run in CUDA graphs"):
        DecodeGraphs(lambda ids, meta: ids, TorchAttention(), block_size=BLOCK_SIZE, max_num_seqs=4,
                     scratch_block=SCRATCH, device=torch.device("cpu"))


@pytest.mark.parametrize("triton, paged", [(False, False), (True, False), (True, True)])
def test_static_buffer_decode_matches_the_eager_runner(tiny_model_dir, triton, paged, monkeypatch):
    """The graph path (padded rows on the scratch block) equals the eager runner; with `triton` the graph
    path runs every Triton kernel (norms, RoPE, store_kv, paged decode) through the interpreter."""
    runner = ModelRunner.from_pretrained(str(tiny_model_dir), num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    prompts = {"a": ([5, 6, 7, 8, 9, 10, 11], [0, 1]), "b": ([12, 13, 14], [2]), "c": ([3, 4], [5])}
    runner.forward(ForwardBatch([ForwardSeq(r, toks, 0, table) for r, (toks, table) in prompts.items()]))
    decodes = ForwardBatch([ForwardSeq(r, [20 + i], len(toks), table)
                            for i, (r, (toks, table)) in enumerate(prompts.items())])
    saved = [(k.clone(), v.clone()) for k, v in runner.kv_cache.layers]
    eager = runner.forward(decodes)

    for (k, v), (k0, v0) in zip(runner.kv_cache.layers, saved, strict=True):
        k.copy_(k0)
        v.copy_(v0)
    attention = GpuAttention(decode_kernel="triton" if paged else "dense")
    attention.configure(runner.config.num_heads, runner.config.num_kv_heads, runner.device)
    graphs = DecodeGraphs(decode_model_fn(runner.model, runner.kv_cache.layers, attention), attention,
                          block_size=BLOCK_SIZE, max_num_seqs=8, scratch_block=SCRATCH, device=runner.device,
                          max_ctx=64)
    if triton:  # as on CUDA: the model's fused path and the backend's Triton decode and cache writes
        from mixserve import kernels

        monkeypatch.setattr(kernels, "use_triton", lambda t: True)
        from mixserve.model.ops import triton_ops

        runner.model.prepare(triton_ops())
    graphed = graphs.run(decodes)  # 3 rows padded to 4
    assert graphed.shape == eager.shape
    torch.testing.assert_close(graphed, eager, atol=1e-4, rtol=1e-4)
    key = (4, 8)  # contexts 8, 4, 3 (+1): capacity 8 both ways
    assert list(graphs.graphs) == [key]
    assert list(graphs._metas) == [key]  # kept alive: replays read its tensors
