"""GpuAttention's packed part without Triton: a whole mixed batch in one FlexAttention call per layer.

Every sequence's queries are packed into one (1, Hq, Q, D) tensor and each sequence's K/V (positions
0 .. seq_len) gathered out of the paged cache into one packed (1, Hkv, KV, D) view; a BlockMask whose
mask_mod compares per-token sequence ids and absolute positions keeps attention inside each sequence and
causal. Q and KV lengths are padded to a few size buckets so the compiled kernel is reused. Compiled on
CUDA, eager elsewhere (it materialises the scores: small shapes only); a torch whose flex fails falls
back, once warned, to one SDPA call per sequence. A layer's window is one more term of the mask_mod (one
BlockMask per window and forward), its softcap a score_mod (one function per value, so compiles are reused).
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

# At import: a torch without FlexAttention raises ImportError here, so get_backend("auto") picks torch_ref.
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from mixserve.core import ForwardBatch
from mixserve.model.attention.base import AttentionMetadata, AttentionPlan, build_metadata
from mixserve.model.attention.sdpa import sequence_attention

FLEX_BLOCK = 128  # FlexAttention's sparse block size (rows and columns of the block mask)


def bucket(n: int, minimum: int = FLEX_BLOCK) -> int:
    """Padded length for n: a power of two up to 4096, then a multiple of 4096 (few compiled shapes)."""
    n = max(n, minimum, 1)
    if n <= 4096:
        return 1 << (n - 1).bit_length()
    return -(-n // 4096) * 4096


@dataclass
class FlexPlan(AttentionPlan):
    """Per-forward state of the FlexAttention packed path, shared by every layer."""

    num_tokens: int  # real query tokens T
    q_pad: int  # padded query length
    kv_pad: int  # padded packed KV length
    kv_slots: torch.Tensor  # (kv_pad,) int64: flat cache slot of each packed K/V entry
    block_mask: BlockMask  # full causal attention
    window_mask: Callable[[int], BlockMask] | None = None  # a window's BlockMask, made by build_flex_plan
    windowed: dict[int, BlockMask] = field(default_factory=dict)

    def mask_for(self, window: int) -> BlockMask:
        """The BlockMask of a layer's window (0: block_mask), made once per forward."""
        if window <= 0:
            return self.block_mask
        if window not in self.windowed:
            assert self.window_mask is not None  # build_flex_plan sets it
            self.windowed[window] = self.window_mask(window)
        return self.windowed[window]


@functools.cache
def softcap_score_mod(cap: float):
    """Gemma 2's logit softcap as a FlexAttention score_mod: a scaled score s becomes cap * tanh(s / cap)."""

    def score_mod(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    return score_mod


def _from_kv_blocks_kwargs() -> dict[str, Any]:
    # compute_q_blocks (transposed indices for the backward pass) is not needed for inference.
    params = inspect.signature(BlockMask.from_kv_blocks).parameters
    return {"compute_q_blocks": False} if "compute_q_blocks" in params else {}


def build_flex_plan(meta: AttentionMetadata, block_size: int) -> FlexPlan:
    """Packed-path state: query/KV sequence ids and positions, gather slots, and a sparse BlockMask.

    Sequences sit in the same order in Q and in KV, so a (Q block, KV block) pair can hold a visible pair
    only if their ranges of sequence ids overlap: that decides the sparse blocks without materialising
    the full Q x KV mask. Padded query rows see KV entry 0 (never an all-masked row). The gather slots
    (every context position, not only this step's) are computed here on the device from the tables.
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

    def windowed_mod(window: int):
        # the cache keeps the keys below a window (no block is freed): the mask drops them
        def mask_mod(b, h, q_idx, kv_idx):
            qs, qp, kp = q_seq[q_idx], q_pos[q_idx], kv_pos[kv_idx]
            same = (qs == kv_seq[kv_idx]) & (kp <= qp) & (kp > qp - window)
            return same | ((qs < 0) & (kv_idx == 0))

        return mask_mod

    blocks = block_ranges(q_seq, kv_seq, num_seqs)
    kv_num_blocks = blocks.sum(dim=1, dtype=torch.int32)
    # Stable sort puts the visible KV blocks first, in order, for each Q block.
    kv_indices = torch.argsort((~blocks).to(torch.int32), dim=1, stable=True).to(torch.int32)

    def block_mask(mod) -> BlockMask:
        return BlockMask.from_kv_blocks(
            kv_num_blocks[None, None], kv_indices[None, None], BLOCK_SIZE=FLEX_BLOCK, mask_mod=mod,
            seq_lengths=(q_pad, kv_pad), **_from_kv_blocks_kwargs(),
        )

    return FlexPlan(num_tokens, q_pad, kv_pad, kv_slots, block_mask(mask_mod),
                    lambda window: block_mask(windowed_mod(window)))


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


class FlexPacked:
    """The packed part on FlexAttention: compiled on CUDA (one fused kernel), eager elsewhere."""

    name = "flex"

    def __init__(self, compile: bool | None = None) -> None:
        self.compile = compile  # None: compile on CUDA only
        self._flex: dict[bool, Any] = {}
        self.fallback_reason: str | None = None  # set if flex failed here: packed steps use per-seq SDPA

    def flex_fn(self, device: torch.device):
        compiled = device.type == "cuda" if self.compile is None else self.compile
        if compiled not in self._flex:
            self._flex[compiled] = torch.compile(flex_attention) if compiled else flex_attention
        return self._flex[compiled]

    def prepare(self, batch: ForwardBatch, block_size: int, device: torch.device) -> AttentionMetadata:
        meta = build_metadata(batch, block_size, device)
        meta.plan = build_flex_plan(meta, block_size)
        return meta

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, meta: AttentionMetadata, scale: float | None, window: int,
               softcap: float) -> torch.Tensor:
        plan = meta.plan
        assert isinstance(plan, FlexPlan)  # prepare made it: a wrong type is our bug, not the user's
        if self.fallback_reason is None:
            try:
                return self._flex_forward(q, k_cache, v_cache, plan, scale, window, softcap)
            except Exception as e:  # noqa: BLE001 - a torch/triton build without working flex compile
                self.fallback_reason = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
                warnings.warn(f"FlexAttention failed, mixed steps fall back to per-sequence SDPA: "
                              f"{self.fallback_reason}", RuntimeWarning, stacklevel=3)
        return sequence_attention(q, k, v, k_cache, v_cache, meta, scale, window, softcap)

    def _flex_forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: FlexPlan,
                      scale: float | None, window: int, softcap: float) -> torch.Tensor:
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        # Gather straight into (Hkv, KV, D): index_select returns it contiguous, the layout flex wants.
        slots = plan.kv_slots
        keys, values = (torch.index_select(c.view(-1, num_kv_heads, head_dim).transpose(0, 1), 1, slots)
                        for c in (k_cache, v_cache))
        query = F.pad(q.transpose(0, 1), (0, 0, 0, plan.q_pad - plan.num_tokens))
        out = self.flex_fn(q.device)(query[None].to(keys.dtype), keys[None], values[None],
                                     score_mod=softcap_score_mod(softcap) if softcap > 0 else None,
                                     block_mask=plan.mask_for(window), scale=scale, enable_gqa=True)
        return out[0, :, : plan.num_tokens].transpose(0, 1).to(q.dtype)
