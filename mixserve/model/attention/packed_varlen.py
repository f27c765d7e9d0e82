"""GpuAttention's packed part with Triton: one paged varlen kernel per layer for a whole mixed batch.

It reads K/V straight from the cache over query tiles of one sequence each (mixserve/kernels/
varlen_attention.py), tiles built on the host in `prepare` and sent in the metadata's one H2D copy: no
gather, no BlockMask, no compiles of new padded shapes in the middle of serving.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mixserve.core import ForwardBatch
from mixserve.model.attention.base import AttentionMetadata, AttentionPlan, device_metadata, flatten


@dataclass
class VarlenPlan(AttentionPlan):
    """Query tiles of block_m tokens of one sequence each.

    block_m is picked for the model's GQA group, which the runner passes to `configure`; a backend used
    without it learns the group from its first packed forward, where `attend` rebuilds the tiles once
    (one more H2D copy).
    """

    query_lens: list[int]  # host copy, to rebuild the tiles for another block_m
    block_m: int
    tile_seq: torch.Tensor  # (tiles,) int64: sequence of each tile
    tile_start: torch.Tensor  # (tiles,) int64: first packed query row of each tile


class VarlenPacked:
    """The packed part on the Triton varlen kernel (CUDA tensors, or CPU ones in Triton's interpreter)."""

    name = "triton"

    def __init__(self, group: int = 1) -> None:
        self.group = group  # the model's GQA group: picks the query tile size

    def prepare(self, batch: ForwardBatch, block_size: int, device: torch.device) -> AttentionMetadata:
        from mixserve.kernels.varlen_attention import build_tiles, default_block_m  # imports triton

        host = flatten(batch, block_size)
        block_m = default_block_m(self.group)
        tile_seq, tile_start = build_tiles(host.query_lens, block_m)
        meta, tiles = device_metadata(host, device, {"tile_seq": tile_seq, "tile_start": tile_start})
        meta.plan = VarlenPlan(host.query_lens, block_m, tiles["tile_seq"], tiles["tile_start"])
        return meta

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, meta: AttentionMetadata, scale: float | None = None, window: int = 0,
               softcap: float = 0.0) -> torch.Tensor:
        from mixserve.kernels.varlen_attention import (  # imports triton: CUDA machines only
            build_tiles,
            default_block_m,
            paged_varlen_attention,
        )

        plan = meta.plan
        assert isinstance(plan, VarlenPlan)  # prepare made it: a wrong type is our bug, not the user's
        group = q.shape[1] // k_cache.shape[2]
        block_m = default_block_m(group)
        if plan.block_m != block_m:  # a backend nobody configured learns its group here: retile once
            tile_seq, tile_start = build_tiles(plan.query_lens, block_m)
            tiles = torch.tensor([tile_seq, tile_start], dtype=torch.int64).to(q.device)
            plan.block_m, plan.tile_seq, plan.tile_start = block_m, tiles[0], tiles[1]
            self.group = group
        return paged_varlen_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                      meta.query_start, plan.tile_seq, plan.tile_start, plan.block_m, scale,
                                      window=window, softcap=softcap)
