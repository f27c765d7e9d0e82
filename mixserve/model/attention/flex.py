"""FlexAttention backend: a whole mixed batch (decodes and prefill chunks) in one attention launch per layer.

Mixed steps pack every sequence's queries into one (1, Hq, Q, D) tensor and gather each sequence's K/V
(positions 0 .. seq_len) out of the paged cache into one packed (1, Hkv, KV, D) view; a BlockMask whose
mask_mod compares per-token sequence ids and absolute positions keeps attention inside each sequence and
causal. Q and KV lengths are padded to a few size buckets so the compiled kernel is reused.

Decode-only steps (one token per sequence) take a decode path instead, whose launches depend only on
(S, C) for a context capacity C, so a CUDA graph can capture it (mixserve/runner/cuda_graph.py). Where
`mixserve.kernels.use_triton(q)` (CUDA tensors, triton installed and enabled) that path is one Triton
flash-decoding kernel reading K/V in place through the block tables (mixserve/kernels/paged_attention.py);
elsewhere, or with decode_kernel="dense", it is the dense PyTorch path (dense_decode.py). The cache
write likewise is one Triton launch (store_kv) where use_triton says so, two index_copy_ elsewhere.

Mixed steps on CUDA with triton (`use_triton`, packed_kernel "auto" or "triton") skip the gather and the
BlockMask: one Triton kernel per layer (mixserve/kernels/varlen_attention.py) reads K/V straight from the
cache over query tiles of one sequence each, built on the host in `prepare` (no FlexAttention compiles of
new padded shapes in the middle of serving). FlexAttention stays the packed path elsewhere.

Everything is built once per forward in `prepare` (no host sync: one pinned H2D copy, device_metadata.py);
`forward` per layer only writes the cache, gathers and attends.
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

# At import: a torch without FlexAttention raises ImportError here, so get_backend("auto") picks torch_ref.
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from mixserve import kernels
from mixserve.core import ForwardBatch
from mixserve.model.attention.base import AttentionBackend, AttentionMetadata
from mixserve.model.attention.dense_decode import (
    DecodePlan,
    decode_attention,
    dense_decode_capacity,
)
from mixserve.model.attention.device_metadata import build_device_metadata

FLEX_BLOCK = 128  # FlexAttention's sparse block size (rows and columns of the block mask)
DECODE_KERNELS = ("auto", "triton", "dense")  # FlexAttentionBackend(decode_kernel=...): see decode_kernel_for
PACKED_KERNELS = ("auto", "triton", "flex")  # FlexAttentionBackend(packed_kernel=...): see packed_kernel_for


def bucket(n: int, minimum: int = FLEX_BLOCK) -> int:
    """Padded length for n: a power of two up to 4096, then a multiple of 4096 (few compiled shapes)."""
    n = max(n, minimum, 1)
    if n <= 4096:
        return 1 << (n - 1).bit_length()
    return -(-n // 4096) * 4096


@dataclass
class FlexPlan:
    """Per-forward state of the packed (mixed) path, shared by every layer."""

    num_tokens: int  # real query tokens T
    q_pad: int  # padded query length
    kv_pad: int  # padded packed KV length
    kv_slots: torch.Tensor  # (kv_pad,) int64: flat cache slot of each packed K/V entry
    block_mask: BlockMask


@dataclass
class VarlenPlan:
    """Per-forward state of the packed path's Triton kernel: query tiles of block_m tokens of one sequence.

    block_m is picked for the model's GQA group, which the runner passes to `configure`; a backend used
    without it learns the group from its first packed forward, where `_varlen_forward` rebuilds the tiles
    once (one more H2D copy).
    """

    query_lens: list[int]  # host copy, to rebuild the tiles for another block_m
    block_m: int
    tile_seq: torch.Tensor  # (tiles,) int64: sequence of each tile
    tile_start: torch.Tensor  # (tiles,) int64: first packed query row of each tile


def _from_kv_blocks_kwargs() -> dict[str, Any]:
    # compute_q_blocks (transposed indices for the backward pass) is not needed for inference.
    params = inspect.signature(BlockMask.from_kv_blocks).parameters
    return {"compute_q_blocks": False} if "compute_q_blocks" in params else {}


def build_flex_plan(meta: AttentionMetadata, block_size: int) -> FlexPlan:
    """Packed-path state: query/KV sequence ids and positions, gather slots, and a sparse BlockMask.

    Sequences sit in the same order in Q and in KV, so a (Q block, KV block) pair can hold a visible pair
    only if their ranges of sequence ids overlap: that decides the sparse blocks without materialising
    the full Q x KV mask. Padded query rows see KV entry 0 (never an all-masked row).
    """
    device = meta.positions.device
    num_seqs = len(meta.seq_lens_cpu)
    num_tokens = sum(meta.query_lens_cpu)
    total_kv = sum(meta.seq_lens_cpu)
    q_pad, kv_pad = bucket(num_tokens), bucket(total_kv)
    seq_ids = torch.arange(num_seqs, device=device)
    query_lens = meta.query_start[1:] - meta.query_start[:-1]

    q_seq = torch.full((q_pad,), -1, dtype=torch.int64, device=device)
    q_seq[:num_tokens] = torch.repeat_interleave(seq_ids, query_lens, output_size=num_tokens)
    q_pos = torch.zeros(q_pad, dtype=torch.int64, device=device)
    q_pos[:num_tokens] = meta.positions

    kv_seq = torch.full((kv_pad,), num_seqs, dtype=torch.int64, device=device)
    kv_seq[:total_kv] = torch.repeat_interleave(seq_ids, meta.seq_lens, output_size=total_kv)
    kv_start = torch.cumsum(meta.seq_lens, 0) - meta.seq_lens
    kv_pos = torch.zeros(kv_pad, dtype=torch.int64, device=device)
    real = kv_seq[:total_kv]
    kv_pos[:total_kv] = torch.arange(total_kv, device=device) - kv_start[real]
    kv_slots = torch.zeros(kv_pad, dtype=torch.int64, device=device)
    pos = kv_pos[:total_kv]
    kv_slots[:total_kv] = meta.block_tables[real, pos // block_size] * block_size + pos % block_size

    def mask_mod(b, h, q_idx, kv_idx):
        qs = q_seq[q_idx]
        same = (qs == kv_seq[kv_idx]) & (kv_pos[kv_idx] <= q_pos[q_idx])
        return same | ((qs < 0) & (kv_idx == 0))

    blocks = block_ranges(q_seq, kv_seq, num_seqs)
    kv_num_blocks = blocks.sum(dim=1, dtype=torch.int32)
    # Stable sort puts the visible KV blocks first, in order, for each Q block.
    kv_indices = torch.argsort((~blocks).to(torch.int32), dim=1, stable=True).to(torch.int32)
    block_mask = BlockMask.from_kv_blocks(
        kv_num_blocks[None, None], kv_indices[None, None], BLOCK_SIZE=FLEX_BLOCK, mask_mod=mask_mod,
        seq_lengths=(q_pad, kv_pad), **_from_kv_blocks_kwargs(),
    )
    return FlexPlan(num_tokens, q_pad, kv_pad, kv_slots, block_mask)


def block_ranges(q_seq: torch.Tensor, kv_seq: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """(Q blocks, KV blocks) bool: which block pairs can hold a visible (query, key) pair.

    q_seq: padded with -1; kv_seq: padded with num_seqs; both lengths multiples of FLEX_BLOCK.
    """
    q = q_seq.view(-1, FLEX_BLOCK)
    real = q >= 0
    q_min = torch.where(real, q, num_seqs).amin(dim=1)
    q_max = torch.where(real, q, -1).amax(dim=1)
    k = kv_seq.view(-1, FLEX_BLOCK)
    k_min, k_max = k.amin(dim=1), k.amax(dim=1)
    blocks = (k_min[None, :] <= q_max[:, None]) & (k_max[None, :] >= q_min[:, None])
    blocks[:, 0] = True  # padded query rows attend KV entry 0
    return blocks


def sequence_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       meta: AttentionMetadata) -> torch.Tensor:
    """The slow, sure fallback: one SDPA call per sequence over its K/V read back from the cache."""
    out = torch.empty_like(q)
    block_size = k_cache.shape[1]
    begin = 0
    for i, (n, length) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)):
        table = meta.block_tables[i, : -(-length // block_size)]
        keys, values = (c[table].flatten(0, 1)[:length].transpose(0, 1)[None] for c in (k_cache, v_cache))
        # Query j sits at position length - n + j and sees keys 0 .. that position.
        visible = (torch.arange(length, device=q.device)[None, :]
                   <= torch.arange(length - n, length, device=q.device)[:, None])
        query = q[begin:begin + n].transpose(0, 1)[None].to(keys.dtype)
        o = F.scaled_dot_product_attention(query, keys, values, attn_mask=visible, enable_gqa=True)
        out[begin:begin + n] = o[0].transpose(0, 1).to(q.dtype)
        begin += n
    return out


def write_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                slot_mapping: torch.Tensor) -> None:
    """Write this step's K/V rows at their flat slots (cache viewed as (slots, Hkv, D)).

    One Triton launch (store_kv) where `kernels.use_triton(k)`, else two index_copy_.
    """
    if kernels.use_triton(k):
        from mixserve.kernels.paged_attention import store_kv  # imports triton: CUDA machines only

        store_kv(k, v, k_cache, v_cache, slot_mapping)
        return
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


class FlexAttentionBackend(AttentionBackend):
    """One attention launch per layer for a whole mixed batch: the Triton varlen kernel on CUDA with
    triton, compiled FlexAttention on CUDA without it, eager FlexAttention elsewhere."""

    name = "flex"

    def __init__(self, compile: bool | None = None, decode_kernel: str = "auto",
                 packed_kernel: str = "auto") -> None:
        if decode_kernel not in DECODE_KERNELS:
            raise ValueError(f"decode_kernel must be one of {', '.join(DECODE_KERNELS)}, "
                             f"got {decode_kernel!r}")
        if packed_kernel not in PACKED_KERNELS:
            raise ValueError(f"packed_kernel must be one of {', '.join(PACKED_KERNELS)}, "
                             f"got {packed_kernel!r}")
        self.compile = compile  # None: compile on CUDA only
        self.decode_kernel = decode_kernel  # "auto": triton where kernels.use_triton(q), else dense
        self.packed_kernel = packed_kernel  # "auto": triton where kernels.use_triton(q), else flex
        self._group = 1  # the model's GQA group (configure): picks prepare's query tile size
        self._flex: dict[Any, Any] = {}
        self.fallback_reason: str | None = None  # set if flex failed here: packed steps use torch_ref

    def configure(self, num_heads: int, num_kv_heads: int) -> None:
        """The GQA group sizes the packed kernel's query tiles, which prepare builds on the host."""
        self._group = max(1, num_heads // max(1, num_kv_heads))

    def _flex_fn(self, device: torch.device):
        # Compiled on CUDA (one fused kernel); eager elsewhere (materialises scores: small shapes only).
        compiled = device.type == "cuda" if self.compile is None else self.compile
        if compiled not in self._flex:
            self._flex[compiled] = torch.compile(flex_attention) if compiled else flex_attention
        return self._flex[compiled]

    def decode_kernel_for(self, q: torch.Tensor) -> str:
        """The kernel the decode-only path runs for q: "triton" (paged_decode_attention) or "dense"."""
        if self.decode_kernel == "auto":
            return "triton" if kernels.use_triton(q) else "dense"
        return self.decode_kernel

    def packed_kernel_for(self, t: torch.Tensor) -> str:
        """The kernel the packed (mixed) path runs for tensors like t: "triton" (paged_varlen_attention)
        or "flex". Triton needs `kernels.use_triton(t)`: a CPU, a missing triton or kernels turned off
        after a failed self-check all keep FlexAttention, whatever packed_kernel says."""
        if self.packed_kernel != "flex" and kernels.use_triton(t):
            return "triton"
        return "flex"

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                plan: DecodePlan) -> torch.Tensor:
        if self.decode_kernel_for(q) == "triton":
            from mixserve.kernels.paged_attention import paged_decode_attention  # imports triton

            return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, plan.ctx)
        return decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, plan.ctx)

    def prepare(self, batch: ForwardBatch, block_size: int, device: torch.device) -> AttentionMetadata:
        """Metadata for one forward: the dense decode plan for decode-only batches, else the Triton
        kernel's query tiles (packed_kernel_for says "triton") or the flex plan."""
        ctx = dense_decode_capacity(batch, block_size)
        if ctx is not None:
            meta = build_device_metadata(batch, block_size, device, width=ctx // block_size)
            meta.extra["decode"] = DecodePlan(ctx=ctx, block_size=block_size)
            return meta
        if self.packed_kernel_for(torch.empty(0, device=device)) == "triton":
            return self._prepare_varlen(batch, block_size, device)
        meta = build_device_metadata(batch, block_size, device)
        meta.extra["flex"] = build_flex_plan(meta, block_size)
        return meta

    def _prepare_varlen(self, batch: ForwardBatch, block_size: int,
                        device: torch.device) -> AttentionMetadata:
        """Metadata plus the Triton kernel's query tiles, all in one H2D copy (no FlexPlan, no BlockMask)."""
        from mixserve.kernels.varlen_attention import build_tiles, default_block_m  # imports triton

        query_lens = [len(s.tokens) for s in batch.seqs]
        block_m = default_block_m(self._group)
        tile_seq, tile_start = build_tiles(query_lens, block_m)
        meta = build_device_metadata(batch, block_size, device,
                                     extra_lists={"tile_seq": tile_seq, "tile_start": tile_start})
        meta.extra["varlen"] = VarlenPlan(query_lens, block_m, meta.extra.pop("tile_seq"),
                                          meta.extra.pop("tile_start"))
        return meta

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q (T, Hq, D), k/v (T, Hkv, D); writes k/v into the caches, returns (T, Hq, D)."""
        write_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        decode = meta.extra.get("decode")
        if decode is not None:
            return self._decode(q, k_cache, v_cache, meta, decode)
        varlen = meta.extra.get("varlen")
        if varlen is not None:
            return self._varlen_forward(q, k_cache, v_cache, meta, varlen)
        if self.fallback_reason is None:
            try:
                return self._flex_forward(q, k_cache, v_cache, meta.extra["flex"])
            except Exception as e:  # noqa: BLE001 - a torch/triton build without working flex compile
                self.fallback_reason = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
                warnings.warn(f"FlexAttention failed, mixed steps fall back to per-sequence SDPA: "
                              f"{self.fallback_reason}", RuntimeWarning, stacklevel=2)
        return sequence_attention(q, k_cache, v_cache, meta)

    def _varlen_forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, plan: VarlenPlan) -> torch.Tensor:
        from mixserve.kernels.varlen_attention import (  # imports triton: CUDA machines only
            build_tiles,
            default_block_m,
            paged_varlen_attention,
        )

        group = q.shape[1] // k_cache.shape[2]
        block_m = default_block_m(group)
        if plan.block_m != block_m:  # a backend nobody configured learns its group here: retile once
            tile_seq, tile_start = build_tiles(plan.query_lens, block_m)
            tiles = torch.tensor([tile_seq, tile_start], dtype=torch.int64).to(q.device)
            plan.block_m, plan.tile_seq, plan.tile_start = block_m, tiles[0], tiles[1]
            self._group = group
        return paged_varlen_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                      meta.query_start, plan.tile_seq, plan.tile_start, plan.block_m)

    def _flex_forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      plan: FlexPlan) -> torch.Tensor:
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        # Gather straight into (Hkv, KV, D): index_select returns it contiguous, the layout flex wants.
        slots = plan.kv_slots
        keys, values = (torch.index_select(c.view(-1, num_kv_heads, head_dim).transpose(0, 1), 1, slots)
                        for c in (k_cache, v_cache))
        query = F.pad(q.transpose(0, 1), (0, 0, 0, plan.q_pad - plan.num_tokens))
        out = self._flex_fn(q.device)(query[None].to(keys.dtype), keys[None], values[None],
                              block_mask=plan.block_mask, enable_gqa=True)
        return out[0, :, : plan.num_tokens].transpose(0, 1).to(q.dtype)
