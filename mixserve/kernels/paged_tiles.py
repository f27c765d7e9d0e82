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
def tanh_f32(x):
    """tanh in fp32 from tl.exp alone (the interpreter has no libdevice): an odd Taylor polynomial to x^15
    below |x| = 0.5, where (1 - e) / (1 + e) would lose digits to cancellation; that form above it."""
    ax = tl.abs(x)
    x2 = x * x
    p = x2 * -1.4558343870513183e-3 + 3.5921280365724810e-3
    p = p * x2 - 8.8632355299021966e-3
    p = p * x2 + 2.1869488536155203e-2
    p = p * x2 - 5.3968253968253968e-2
    p = p * x2 + 1.3333333333333333e-1
    p = p * x2 - 3.3333333333333333e-1
    p = p * x2 + 1.0
    e = tl.exp(-2.0 * ax)
    t = tl.where(ax < 0.5, p * ax, (1.0 - e) / (1.0 + e))
    return tl.where(x < 0, -t, t)


@triton.jit
def online_softmax_step(q, k, v, visible, scale, m_i, l_i, acc, SOFTCAP: tl.constexpr):
    """Fold one KV tile into the running (max m_i, sum l_i, output acc) of each query row, in fp32.

    visible: which (row, key) pairs count. A row that has seen no key yet (a sliding window starting past
    this tile) keeps m_i = -inf, l_i = 0 and acc = 0: its exponentials are taken against 0, not -inf.
    SOFTCAP > 0: each scaled score s becomes SOFTCAP * tanh(s / SOFTCAP) (Gemma 2), before the mask.
    input_precision="ieee": fp32 caches are not rounded to tf32 (no effect on bf16/fp16 operands).
    """
    scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
    if SOFTCAP > 0:
        scores = SOFTCAP * tanh_f32(scores / SOFTCAP)
    scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_ref)
    p = tl.exp(scores - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, l_i, acc
