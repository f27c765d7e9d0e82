"""Reference attention on plain torch (any device): SDPA per sequence over K/V gathered from its blocks."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mixserve.model.attention.base import AttentionBackend, AttentionMetadata


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store each packed token's K/V at its flat slot (block * block_size + offset)."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """Positions 0..length-1 of one sequence as (length, Hkv, D), read through its block table."""
    block_size = cache.shape[1]
    num_blocks = -(-length // block_size)
    return cache[block_table[:num_blocks]].flatten(0, 1)[:length]


class TorchAttention(AttentionBackend):
    """The reference backend: a Python loop over sequences, one SDPA call each."""

    name = "torch"

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        begin = 0
        for i, (n, length) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)):
            end = begin + n
            start = length - n
            qi = q[begin:end].transpose(0, 1)  # (Hq, n, D)
            if start == 0:
                # A whole prompt (or first chunk): its own K/V are all it sees; no cache read needed.
                ki, vi = k[begin:end], v[begin:end]
                mask, causal = None, n > 1
            else:
                ki = gather_kv(k_cache, meta.block_tables[i], length)
                vi = gather_kv(v_cache, meta.block_tables[i], length)
                causal = False
                mask = None
                if n > 1:
                    # Query j sits at position start + j; it sees keys 0..start + j (bottom-right causal).
                    qpos = torch.arange(start, length, device=q.device).unsqueeze(1)
                    mask = torch.arange(length, device=q.device).unsqueeze(0) <= qpos
            oi = F.scaled_dot_product_attention(
                qi, ki.transpose(0, 1), vi.transpose(0, 1), attn_mask=mask, is_causal=causal, enable_gqa=True
            )
            out[begin:end] = oi.transpose(0, 1)
            begin = end
        return out
