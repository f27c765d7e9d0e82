"""Paged KV cache kernels: store_kv (K and V rows into their slots) and flash-decoding over block tables.

`paged_decode_attention` replaces the dense decode path's gather + ~15 small kernels per layer: each
program reads its sequence's K/V straight out of the paged cache (page id from the block table, once per
position), so K/V are read once and never copied. It is flash-decoding: the context capacity `ctx` is cut
into `num_splits` ranges so that small batches still fill the GPU; each (sequence, KV head, split) program
keeps an online softmax in fp32 and writes a partial output with its log-sum-exp, and a small second
kernel merges the splits. With one split the first kernel writes the output itself.

Everything the kernels branch on at run time (sequence lengths, block tables) is read on the device, and
every launch parameter is a function of shapes only (S, Hkv, ctx), so both kernels can be captured in a
CUDA graph (mixserve/runner/cuda_graph.py) and replayed for any lengths up to ctx. The split count is a
run-time argument (only "one split or several" is compiled in), so the graphs of every batch size and
context capacity share two compiled variants of the decode kernel and one of the merge kernel.

A layer's sliding window is a run-time argument too (each sequence's keys start at seq_len - window, on the
device; the splits cover only the window), its softcap a constexpr (a tanh on the scores; Gemma 2 has one
value), so a graph captures each layer with its own values.

Only plain Triton (tl.load/store/dot/exp/log/max/sum/where): no descriptors or TMA, so the kernels run
under the interpreter on CPU tensors (the tests) and should compile on any recent Triton.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from mixserve.kernels.paged_tiles import load_kv_tile, online_softmax_step

BLOCK_N = 64  # cache positions per tile of the decode kernel
MIN_DOT_ROWS = 16  # tl.dot wants at least 16 rows: the GQA group of query heads is padded up to this
TARGET_PROGRAMS = 2 * 132  # about two programs per SM of an H100/H200: enough to fill it


def default_num_splits(num_seqs: int, num_kv_heads: int, ctx: int, block_n: int = BLOCK_N) -> int:
    """Splits of the context per (sequence, KV head): a pure function of shapes, so graphs stay static.

    Small batches get enough splits that S * Hkv * splits reaches TARGET_PROGRAMS; a split never holds
    less than one tile of block_n positions, and large batches (already >= TARGET_PROGRAMS programs) get
    one split.
    """
    programs = max(num_seqs * num_kv_heads, 1)
    wanted = -(-TARGET_PROGRAMS // programs)
    return max(1, min(wanted, ctx // block_n))


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, part_out_ptr, part_lse_ptr,
    ctx, split_len, scale, window,
    stride_qs, stride_qh, stride_qd,
    stride_cb, stride_cs, stride_ch,  # K and V caches share one contiguous layout; last stride is 1
    stride_bts, stride_btc,
    stride_os, stride_oh,  # out (S, Hq, D), last stride 1
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE_SPLIT: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """One (sequence, KV head, split): the GROUP query heads of that KV head over its split's positions.

    window: the keys a query sees (>= ctx for full attention), so splits start at seq_len - window.
    """
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    rows = tl.arange(0, GROUP_PAD)  # query heads kv_head * GROUP + rows (rows >= GROUP are padding)
    dims = tl.arange(0, HEAD_DIM_PAD)
    row_ok = rows < GROUP
    dim_ok = dims < HEAD_DIM
    heads = kv_head * GROUP + rows

    q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + dims[None, :] * stride_qd,
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    q = q.to(k_cache_ptr.dtype.element_ty)

    # Positions this program reads: its split's range from the window's first key, cut at the sequence's
    # length (never past ctx, the block table's width). A split wholly past the length runs no iteration: a
    # neutral partial below. The keys below a window stay in the cache (no block is freed), unread.
    seq_len = tl.minimum(tl.load(seq_lens_ptr + seq).to(tl.int32), ctx)
    begin = tl.maximum(seq_len - window, 0) + split * split_len
    end = tl.minimum(begin + split_len, seq_len)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)  # running max of the scores per row
    l_i = tl.zeros([GROUP_PAD], tl.float32)  # running sum of exp(score - m_i)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    offsets = tl.arange(0, BLOCK_N)
    for start in range(begin, end, BLOCK_N):
        pos = start + offsets
        valid = pos < end
        k, v = load_kv_tile(k_cache_ptr, v_cache_ptr, block_tables_ptr, seq, kv_head, pos, valid, dims,
                            dim_ok, stride_bts, stride_btc, stride_cb, stride_cs, stride_ch, BLOCK_SIZE)
        # Every tile holds at least one valid position (pos < end), so the running max stays finite.
        m_i, l_i, acc = online_softmax_step(q, k, v, valid[None, :], scale, m_i, l_i, acc, SOFTCAP)

    # An empty split keeps l_i = 0: output 0 with weight exp(-inf) = 0 (no 0/0, no log(0)).
    nonempty = l_i > 0
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    store_mask = row_ok[:, None] & dim_ok[None, :]
    if SINGLE_SPLIT:
        tl.store(out_ptr + seq * stride_os + heads[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        lse = tl.where(nonempty, m_i + tl.log(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        # Partials are contiguous (S, Hq, splits[, HEAD_DIM]) fp32; Hq = GROUP * Hkv.
        part = (seq * GROUP * tl.num_programs(1) + heads) * tl.num_programs(2) + split
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :], out, mask=store_mask)
        tl.store(part_lse_ptr + part, lse, mask=row_ok)


@triton.jit
def _merge_splits_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, stride_os, stride_oh, num_splits,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):
    """One (sequence, KV head): each query head's split partials weighted by exp(lse - its max lse)."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    row_ok = rows < GROUP
    mask = row_ok[:, None] & (dims < HEAD_DIM)[None, :]
    heads = kv_head * GROUP + rows
    # Partials are contiguous (S, Hq, num_splits[, HEAD_DIM]): split j of a head at part + j.
    part = (seq * GROUP * tl.num_programs(1) + heads) * num_splits

    top = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    for j in range(num_splits):
        top = tl.maximum(top, tl.load(part_lse_ptr + part + j, mask=row_ok, other=float("-inf")))
    top = tl.where(top == float("-inf"), 0.0, top)  # no split saw a position (never for seq_len >= 1)
    total = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    for j in range(num_splits):
        lse = tl.load(part_lse_ptr + part + j, mask=row_ok, other=float("-inf"))
        weight = tl.exp(lse - top)  # 0 for an empty split (lse -inf)
        split_out = tl.load(part_out_ptr + (part + j)[:, None] * HEAD_DIM + dims[None, :], mask=mask,
                            other=0.0)
        acc += split_out * weight[:, None]
        total += weight
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(out_ptr + seq * stride_os + heads[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, ctx: int,
                           scale: float | None = None, num_splits: int | None = None, *,
                           block_n: int = BLOCK_N, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Decode attention of q (S, Hq, D) over each sequence's first seq_lens cache positions, read in place.

    k_cache/v_cache: (num_blocks, block_size, Hkv, D), contiguous. block_tables: (S, >= ctx / block_size)
    int64 or int32 page ids. seq_lens: (S,) on the device, at most ctx (never read on the host: this runs
    inside CUDA graphs; only the static capacity ctx sizes the launch). q may be a strided view (a slice
    of a fused qkv buffer). num_splits: None for default_num_splits; block_n: positions per tile (a power
    of two >= 16; tests use small tiles to cross several with small shapes). window > 0: each query sees only
    its sequence's last `window` keys; softcap > 0: scores capped as softcap * tanh(s / softcap). Returns
    (S, Hq, D) in q.dtype.
    """
    num_seqs, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, cache_dim = k_cache.shape
    if num_heads % num_kv_heads or cache_dim != head_dim:
        raise ValueError(f"q {tuple(q.shape)} does not fit a cache of {num_kv_heads} x {cache_dim}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and v_cache.shape == k_cache.shape):
        raise ValueError("k_cache and v_cache must be contiguous and of one shape")
    if block_tables.shape[0] < num_seqs or block_tables.shape[1] * block_size < ctx:
        raise ValueError(f"block_tables {tuple(block_tables.shape)} cannot cover ctx {ctx}")
    if window < 0 or softcap < 0:
        raise ValueError(f"window {window} and softcap {softcap} must be 0 (off) or positive")
    group = num_heads // num_kv_heads
    span = min(ctx, window) if window > 0 else ctx  # the most keys a query reads
    splits = num_splits or default_num_splits(num_seqs, num_kv_heads, span, block_n)
    # Each split covers whole tiles; recount so that no split starts past the span.
    tiles = max(-(-span // block_n), 1)
    tiles_per_split = -(-tiles // max(1, min(splits, tiles)))
    splits = -(-tiles // tiles_per_split)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale

    out = torch.empty(num_seqs, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    if splits > 1:
        part_out = torch.empty(num_seqs, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(num_seqs, num_heads, splits, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused by the single-split kernel
    head_dim_pad = triton.next_power_of_2(head_dim)
    _paged_decode_kernel[(num_seqs, num_kv_heads, splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part_out, part_lse,
        ctx, tiles_per_split * block_n, scale, window if window > 0 else ctx,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), block_tables.stride(1),
        out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=max(MIN_DOT_ROWS, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=max(16, head_dim_pad),
        BLOCK_SIZE=block_size, BLOCK_N=block_n, SINGLE_SPLIT=splits == 1, SOFTCAP=float(softcap),
    )
    if splits > 1:
        _merge_splits_kernel[(num_seqs, num_kv_heads)](
            part_out, part_lse, out, out.stride(0), out.stride(1), splits,
            GROUP=group, GROUP_PAD=triton.next_power_of_2(group), HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
        )
    return out


def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, seq_lens: torch.Tensor, ctx: int,
                               scale: float | None = None, window: int = 0,
                               softcap: float = 0.0) -> torch.Tensor:
    """The reference: one fp32 softmax per sequence over its K/V gathered from the cache (reads lengths
    on the host: for tests only)."""
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    out = torch.empty(num_seqs, num_heads, head_dim, dtype=q.dtype, device=q.device)
    for s, length in enumerate(seq_lens.tolist()):
        length = min(length, ctx)
        pos = torch.arange(max(0, length - window) if window > 0 else 0, length, device=q.device)
        pages = block_tables[s, pos // block_size].long()
        keys = k_cache[pages, pos % block_size].float().repeat_interleave(group, dim=1)  # (L, Hq, D)
        values = v_cache[pages, pos % block_size].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[s].float(), keys) * scale
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        out[s] = torch.einsum("hl,lhd->hd", torch.softmax(scores, dim=-1), values).to(q.dtype)
    return out


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr,
    stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
    stride_cslot, stride_ch,  # caches as (slots, Hkv, D), last stride 1
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):
    """One token: its K and V rows (Hkv, D), cast to the cache dtype, into flat slot slots[token]."""
    token = tl.program_id(0)
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    mask = (heads < NUM_KV_HEADS)[:, None] & (dims < HEAD_DIM)[None, :]
    slot = tl.load(slots_ptr + token).to(tl.int64)
    dst = slot * stride_cslot + heads[:, None] * stride_ch + dims[None, :]
    k = tl.load(k_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :] * stride_kd, mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :] * stride_vd, mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write K and V rows (T, Hkv, D) at flat slots slot_mapping (T,) of caches seen as (slots, Hkv, D).

    One launch for both (the eager path takes two index_copy_ plus two casts); k and v may be strided
    views of a fused qkv buffer. Slots must be valid and distinct (as the scheduler hands them out).
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and v_cache.shape == k_cache.shape):
        raise ValueError("k_cache and v_cache must be contiguous and of one shape")
    if v.shape != k.shape or k_cache.shape[-2:] != (num_kv_heads, head_dim):
        raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} do not fit cache {tuple(k_cache.shape)}")
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        num_kv_heads * head_dim, head_dim,
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads), HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
    )


def store_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """The reference: two index_copy_ into the caches viewed as (slots, Hkv, D)."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))
