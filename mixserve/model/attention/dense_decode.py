"""The dense decode path: decode-only steps as a few batched matmuls over K/V gathered to a capacity.

A decode-only step (one token per sequence) gathers each sequence's first C cache slots for a context
capacity C, then attends with two grouped matmuls and a length mask. Its shapes depend only on (S, C), so
a CUDA graph can capture it (mixserve/runner/cuda_graph.py). It is GpuAttention's decode part where the
paged Triton kernel is not used (no triton, kernels off, or GpuAttention(decode_kernel="dense")).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mixserve.model.attention.base import AttentionMetadata, AttentionPlan


def context_capacity(max_seq_len: int, block_size: int) -> int:
    """Context capacity C of the dense decode path: whole blocks, at most ~1/16 over the longest context.

    Steps of a sixteenth of the enclosing power of two keep the wasted reads small while contexts grow
    through only a few capacities (each one a CUDA graph per batch size).
    """
    n = max(max_seq_len, 1)
    step = max(1, (1 << (n - 1).bit_length()) // 16)
    step = -(-step // block_size) * block_size
    return -(-n // step) * step


@dataclass
class DecodePlan(AttentionPlan):
    """A decode-only step (eager or in a CUDA graph): meta.block_tables has ctx // block_size columns."""

    ctx: int  # context capacity C (multiple of block_size)
    block_size: int


def dense_decode_capacity(seq_lens: Sequence[int], block_size: int) -> int | None:
    """Context capacity for the dense decode path, or None when these decodes should go packed.

    The dense path reads ctx slots per sequence, so it is taken only for decodes whose contexts fill at
    least half of S x ctx (a mix of one long and many short contexts goes packed).
    """
    ctx = context_capacity(max(seq_lens), block_size)
    return ctx if 2 * sum(seq_lens) >= len(seq_lens) * ctx else None


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, ctx: int, scale: float | None = None,
                     window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Dense decode attention: q (S, Hq, D) against each sequence's first ctx cache slots, masked to seq_lens
    (and to its last `window` keys where window > 0); scores scaled by `scale` (None: D ** -0.5) and capped
    as c * tanh(s / c) where softcap c > 0.

    Static shapes for a given (S, ctx): safe inside a CUDA graph (window and softcap are per-layer constants,
    the masks computed on the device from seq_lens). K/V are gathered once, straight into (Hkv, S, C, D), so
    both matmuls read them in place; GQA groups the query heads of each KV head.
    """
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    table = block_tables[:, : ctx // block_size].reshape(-1)
    batch = num_kv_heads * num_seqs
    k = torch.index_select(k_cache.permute(2, 0, 1, 3), 1, table).view(batch, ctx, head_dim)
    v = torch.index_select(v_cache.permute(2, 0, 1, 3), 1, table).view(batch, ctx, head_dim)
    qb = q.view(num_seqs, num_kv_heads, group, head_dim).transpose(0, 1).reshape(batch, group, head_dim)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    scores = torch.bmm(qb.to(k.dtype), k.transpose(1, 2)).float() * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    keys = torch.arange(ctx, device=q.device)[None, :]
    visible = keys < seq_lens[:, None]  # (S, C)
    if window > 0:  # the cache keeps the keys below the window (no block is freed): masked here
        visible &= keys >= seq_lens[:, None] - window
    scores = scores.view(num_kv_heads, num_seqs, group, ctx).masked_fill(~visible[None, :, None, :],
                                                                          float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype).view(batch, group, ctx)
    out = torch.bmm(probs, v).view(num_kv_heads, num_seqs, group, head_dim).transpose(0, 1)
    return out.reshape(num_seqs, num_heads, head_dim).to(q.dtype)


class DenseDecode:
    """GpuAttention's decode part without Triton: decode_attention over capacities of context_capacity."""

    name = "dense"

    def capacity(self, seq_lens: Sequence[int], block_size: int) -> int | None:
        return dense_decode_capacity(seq_lens, block_size)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
               plan: DecodePlan, scale: float | None, window: int, softcap: float) -> torch.Tensor:
        return decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, plan.ctx, scale,
                                window, softcap)
