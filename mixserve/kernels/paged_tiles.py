"""Triton building blocks the paged attention kernels share: one KV tile read through a block table, and
one step of the online softmax over it.

Called from inside @triton.jit kernels (paged_attention.py, varlen_attention.py); imports triton at module
level like them.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_kv_tile(k_cache_ptr, v_cache_ptr, block_tables_ptr, seq, kv_head, pos, valid, dims, dim_ok,
                 stride_bts, stride_btc, stride_cb, stride_cs, stride_ch, BLOCK_SIZE: tl.constexpr):
    """K and V rows (len(pos), len(dims)) of one sequence's cache positions `pos`, for one KV head.

    Position p lives in page block_tables[seq, p // BLOCK_SIZE] at slot p % BLOCK_SIZE. Pages are int64
    before scaling: num_blocks * block stride can pass 2**31 elements on a large cache. Rows where `valid`
    is false (and padded dims) read as 0.
    """
    page = tl.load(block_tables_ptr + seq * stride_bts + (pos // BLOCK_SIZE) * stride_btc,
                   mask=valid, other=0).to(tl.int64)
    slot_off = page * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
    kv_mask = valid[:, None] & dim_ok[None, :]
    k = tl.load(k_cache_ptr + slot_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + slot_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)
    return k, v


@triton.jit
def online_softmax_step(q, k, v, visible, scale, m_i, l_i, acc):
    """Fold one KV tile into the running (max m_i, sum l_i, output acc) of each query row, in fp32.

    visible: which (row, key) pairs count; each row must see at least one key of its first tile, so the
    running max is finite from there on (alpha = exp(-inf) = 0 on that tile).
    input_precision="ieee": fp32 caches are not rounded to tf32 (no effect on bf16/fp16 operands).
    """
    scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
    scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, l_i, acc
