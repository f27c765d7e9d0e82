"""What every backend's slow-but-sure paths share: the KV write, the gather, one sequence's SDPA call."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mixserve import kernels
from mixserve.model.attention.base import AttentionMetadata


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store each packed token's K/V at its flat slot (block * block_size + offset).

    One Triton launch (store_kv) where `kernels.use_triton(k)`, else two index_copy_.
    """
    if kernels.use_triton(k):
        from mixserve.kernels.paged_attention import store_kv  # imports triton: CUDA machines only

        store_kv(k, v, k_cache, v_cache, slot_mapping)
        return
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, length: int) -> torch.Tensor:
    """Positions 0..length-1 of each (B, blocks) table's sequence as (B, Hkv, length, D)."""
    b, block_size = block_tables.shape[0], cache.shape[1]
    num_blocks = -(-length // block_size)
    # index_select on the flat block ids is 2-4x faster on the CPU than advanced indexing with a 2-D index
    ids = block_tables[:, :num_blocks].reshape(-1)
    kv = cache.index_select(0, ids).view(b, num_blocks * block_size, *cache.shape[2:])
    return kv[:, :length].transpose(1, 2)


def causal_mask(n: int, length: int, device: torch.device) -> torch.Tensor | None:
    """(n, length) bool for n queries ending a context of `length`: query j sits at position length - n + j
    and sees keys 0..that position (bottom-right causal). None for a first chunk (n == length)."""
    if n == length:
        return None
    qpos = torch.arange(length - n, length).unsqueeze(1)
    return (torch.arange(length).unsqueeze(0) <= qpos).to(device)


def attend_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, table: torch.Tensor, begin: int, n: int, length: int,
                    mask: torch.Tensor | None) -> torch.Tensor:
    """(n, Hq, D): one sequence's queries (packed rows begin..begin+n) over its context of `length`.

    mask None (see causal_mask): a first chunk sees only itself, so causal SDPA on this step's k/v and no
    cache read; else K/V are read back from the cache through `table` (1, blocks).
    """
    # (1, Hq, n, D): 4-D inputs take torch's flash kernel on the CPU, 3-D ones the slow math path
    qi = q[begin:begin + n].transpose(0, 1).unsqueeze(0)
    if mask is None:
        ki = k[begin:begin + n].transpose(0, 1).unsqueeze(0)
        vi = v[begin:begin + n].transpose(0, 1).unsqueeze(0)
    else:
        ki, vi = gather_kv(k_cache, table, length), gather_kv(v_cache, table, length)
    oi = F.scaled_dot_product_attention(qi.to(ki.dtype), ki, vi, attn_mask=mask, is_causal=mask is None,
                                        enable_gqa=True)
    return oi[0].transpose(0, 1).to(q.dtype)


def sequence_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """The slow, sure fallback: one SDPA call per sequence (K/V already written to the cache)."""
    out = torch.empty_like(q)
    begin = 0
    for i, (n, length) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)):
        out[begin:begin + n] = attend_sequence(q, k, v, k_cache, v_cache, meta.block_tables[i:i + 1], begin,
                                               n, length, causal_mask(n, length, q.device))
        begin += n
    return out
