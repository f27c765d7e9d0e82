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


def causal_mask(n: int, length: int, device: torch.device, window: int = 0) -> torch.Tensor | None:
    """(n, length) bool for n queries ending a context of `length`: query j at position p = length - n + j
    sees keys 0..p (bottom-right causal), or with a window w > 0 only keys p - w < key <= p. None for a
    first chunk (n == length) that no window cuts."""
    cut = 0 < window < length
    if n == length and not cut:
        return None
    qpos = torch.arange(length - n, length).unsqueeze(1)
    keys = torch.arange(length).unsqueeze(0)
    mask = keys <= qpos
    if cut:  # the cache still holds the keys below the window: they are masked, not freed
        mask &= keys > qpos - window
    return mask.to(device)


def capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                     scale: float, softcap: float) -> torch.Tensor:
    """SDPA's result with Gemma 2's logit softcap, from explicit float32 scores (SDPA has no score hook):
    q (B, Hq, n, D), k/v (B, Hkv, L, D), mask bool broadcastable to (B, Hq, n, L) or None (all keys)."""
    b, hq, n, d = q.shape
    hkv, length = k.shape[1], k.shape[2]
    qg = q.float().view(b, hkv, hq // hkv, n, d)
    scores = (qg @ k.float().unsqueeze(2).transpose(-1, -2)).view(b, hq, n, length) * scale
    scores = softcap * torch.tanh(scores / softcap)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = scores.softmax(-1).view(b, hkv, hq // hkv, n, length)
    return (probs @ v.float().unsqueeze(2)).view(b, hq, n, d).to(v.dtype)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, is_causal: bool,
              scale: float | None, softcap: float) -> torch.Tensor:
    """SDPA (GQA) over (B, H, n, D) inputs, or capped_attention when the layer caps its scores."""
    if softcap > 0:
        if is_causal:
            mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
        return capped_attention(q, k, v, mask, q.shape[-1] ** -0.5 if scale is None else scale, softcap)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                          enable_gqa=True)


def attend_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, table: torch.Tensor, begin: int, n: int, length: int,
                    mask: torch.Tensor | None, scale: float | None = None,
                    softcap: float = 0.0) -> torch.Tensor:
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
    oi = attention(qi.to(ki.dtype), ki, vi, mask, mask is None, scale, softcap)
    return oi[0].transpose(0, 1).to(q.dtype)


def sequence_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, meta: AttentionMetadata, scale: float | None = None,
                       window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """The slow, sure fallback: one SDPA call per sequence (K/V already written to the cache)."""
    out = torch.empty_like(q)
    begin = 0
    for i, (n, length) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)):
        out[begin:begin + n] = attend_sequence(q, k, v, k_cache, v_cache, meta.block_tables[i:i + 1], begin,
                                               n, length, causal_mask(n, length, q.device, window), scale,
                                               softcap)
        begin += n
    return out
