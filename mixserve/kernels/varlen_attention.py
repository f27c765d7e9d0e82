"""Varlen paged attention: a whole mixed batch (decodes and prefill chunks) in one launch per layer.

`paged_varlen_attention` replaces the flex path's per-layer K/V gather plus compiled FlexAttention (whose
compiles of new padded shapes take seconds in the middle of serving): each program reads K/V straight
out of the paged cache through the block table, so nothing is gathered or padded, and every launch is a
function of a few constexprs (group, head dim, block size, tile sizes) that do not change while serving.

The batch is cut into query tiles on the host (`build_tiles`): up to block_m consecutive query tokens of
ONE sequence per tile, so a decode is a tile of one token and a 500-token chunk is several tiles. The
grid is (tiles, KV heads); a program takes its tile's block_m tokens x the GROUP query heads of its KV
head as block_m * GROUP rows of one matrix (padded to >= 16 rows for tl.dot), so K/V of a GQA group are
read once for all its heads. It walks the cache positions 0 .. (last query position of the tile) in
BLOCK_N tiles with an online softmax in fp32; each row sees the keys at positions <= its own (causal),
and with a layer's sliding window w only those above its own - w (the walk then starts at the tile's first
query's window); a layer's softcap (a constexpr) caps the scores with a tanh before the softmax.

Only plain Triton (tl.load/store/dot/exp/log/max/sum/where): no descriptors or TMA, so the kernel runs
under the interpreter on CPU tensors (the tests) and should compile on any recent Triton.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from mixserve.kernels.paged_tiles import load_kv_tile, online_softmax_step

BLOCK_N = 64  # cache positions per tile of the KV loop
MIN_DOT_ROWS = 16  # tl.dot wants at least 16 rows: a tile's rows are padded up to this
TARGET_ROWS = 64  # block_m * GROUP rows per program: a standard flash-attention Q tile
FULL_WINDOW = 1 << 30  # the window of full attention: past any position (int32 arithmetic stays in range)


def default_block_m(group: int) -> int:
    """Query tokens per tile for a GQA group: block_m * next_pow2(group) is 16..64 rows where it can be.

    A power of two, so each program's rows form one power-of-two matrix; groups above 64 get one token
    per tile (group rows).
    """
    return max(1, TARGET_ROWS // triton.next_power_of_2(max(group, 1)))


def build_tiles(query_lens: list[int], block_m: int) -> tuple[list[int], list[int]]:
    """The query tiles of a packed batch: (tile_seq, tile_start), one entry per tile.

    Sequence i owns packed rows sum(query_lens[:i]) .. + query_lens[i]; it is cut into tiles of block_m
    consecutive rows (the last one shorter). tile_seq[t] is the sequence of tile t, tile_start[t] its
    first packed row. Pure Python on host ints: it runs in `prepare`, before the one H2D copy.
    """
    if block_m < 1:
        raise ValueError(f"block_m must be >= 1, got {block_m}")
    tile_seq: list[int] = []
    tile_start: list[int] = []
    row = 0
    for seq, n in enumerate(query_lens):
        for start in range(row, row + n, block_m):
            tile_seq.append(seq)
            tile_start.append(start)
        row += n
    return tile_seq, tile_start


@triton.jit
def _paged_varlen_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr,
    tile_seq_ptr, tile_start_ptr, out_ptr, scale, window,
    stride_qt, stride_qh, stride_qd,
    stride_cb, stride_cs, stride_ch,  # K and V caches share one contiguous layout; last stride is 1
    stride_bts, stride_btc,
    stride_ot, stride_oh,  # out (T, Hq, D), last stride 1
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """One (query tile, KV head): the tile's tokens x the GROUP query heads of that KV head, as ROWS rows.

    Row r is token r // GROUP_PAD of the tile, query head kv_head * GROUP + r % GROUP_PAD; rows past the
    tile's tokens or the group are padding (computed, never stored). window: the keys a query sees,
    itself included (past any position for full attention).
    """
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile).to(tl.int64)
    row0 = tl.load(tile_start_ptr + tile).to(tl.int64)  # first packed row of the tile
    q_begin = tl.load(query_start_ptr + seq).to(tl.int64)
    q_end = tl.load(query_start_ptr + seq + 1).to(tl.int64)
    # Positions in int32 (contexts are far below 2**31); packed rows and cache offsets in int64.
    query_len = (q_end - q_begin).to(tl.int32)
    tile_off = (row0 - q_begin).to(tl.int32)  # index of the tile's first token within its sequence
    first_pos = tl.load(seq_lens_ptr + seq).to(tl.int32) - query_len  # position of the first query token

    rows = tl.arange(0, ROWS)
    dims = tl.arange(0, HEAD_DIM_PAD)
    token = rows // GROUP_PAD
    head_in_group = rows % GROUP_PAD
    q_row = row0 + token  # packed row (int64)
    row_ok = (token < BLOCK_M) & (q_row < q_end) & (head_in_group < GROUP)
    dim_ok = dims < HEAD_DIM
    heads = kv_head * GROUP + head_in_group
    io_mask = row_ok[:, None] & dim_ok[None, :]

    q = tl.load(q_ptr + q_row[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :] * stride_qd,
                mask=io_mask, other=0.0)
    q = q.to(k_cache_ptr.dtype.element_ty)
    # Every row, padding included, sees itself; with a window, a row may see no key of the first KV tiles
    # (online_softmax_step keeps such a row neutral).
    q_pos = first_pos + tile_off + token
    # Keys the tile needs: from its first query's window start to its last real query's position (never
    # past seq_len). The keys below a window stay in the cache (no block is freed), unread.
    end = first_pos + tl.minimum(tile_off + BLOCK_M, query_len)
    begin = tl.maximum(first_pos + tile_off - window + 1, 0)

    m_i = tl.full([ROWS], float("-inf"), tl.float32)  # running max of the scores per row
    l_i = tl.zeros([ROWS], tl.float32)  # running sum of exp(score - m_i)
    acc = tl.zeros([ROWS, HEAD_DIM_PAD], tl.float32)
    offsets = tl.arange(0, BLOCK_N)
    for start in range(begin, end, BLOCK_N):
        pos = start + offsets
        valid = pos < end
        k, v = load_kv_tile(k_cache_ptr, v_cache_ptr, block_tables_ptr, seq, kv_head, pos, valid, dims,
                            dim_ok, stride_bts, stride_btc, stride_cb, stride_cs, stride_ch, BLOCK_SIZE)
        # length mask, causal mask, window
        visible = valid[None, :] & (pos[None, :] <= q_pos[:, None]) & (pos[None, :] > q_pos[:, None] - window)
        m_i, l_i, acc = online_softmax_step(q, k, v, visible, scale, m_i, l_i, acc, SOFTCAP)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + q_row[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=io_mask)


def paged_varlen_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start: torch.Tensor,
                           tile_seq: torch.Tensor, tile_start: torch.Tensor, block_m: int,
                           scale: float | None = None, *, block_n: int = BLOCK_N, window: int = 0,
                           softcap: float = 0.0) -> torch.Tensor:
    """Causal attention of packed queries q (T, Hq, D) over their sequences' K/V, read in place.

    Sequence i owns rows query_start[i]:query_start[i+1] of q; its query j sits at position
    seq_lens[i] - query_len_i + j and sees cache positions 0 .. that position, all already written.
    k_cache/v_cache: (num_blocks, block_size, Hkv, D), contiguous. block_tables: (S, width) int64 or
    int32 page ids covering seq_lens. tile_seq/tile_start: `build_tiles(query_lens, block_m)` on the device
    (nothing is read on the host here). q may be a strided view (a slice of a fused qkv buffer). block_n:
    positions per KV tile (a power of two >= 16; tests use 16 to cross several with small shapes).
    window > 0: query j sees only positions above its own - window; softcap > 0: scores capped as
    softcap * tanh(s / softcap). Returns (T, Hq, D) in q.dtype.
    """
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads, cache_dim = k_cache.shape[1:]
    if num_heads % num_kv_heads or cache_dim != head_dim:
        raise ValueError(f"q {tuple(q.shape)} does not fit a cache of {num_kv_heads} x {cache_dim}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and v_cache.shape == k_cache.shape):
        raise ValueError("k_cache and v_cache must be contiguous and of one shape")
    if tile_seq.shape != tile_start.shape or block_m < 1:
        raise ValueError(f"tiles {tuple(tile_seq.shape)} / {tuple(tile_start.shape)}, block_m {block_m}")
    if window < 0 or softcap < 0:
        raise ValueError(f"window {window} and softcap {softcap} must be 0 (off) or positive")
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale

    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    num_tiles = tile_seq.shape[0]
    if num_tokens == 0 or num_tiles == 0:
        return out
    _paged_varlen_kernel[(num_tiles, num_kv_heads)](
        q, k_cache, v_cache, block_tables, seq_lens, query_start, tile_seq, tile_start, out, scale,
        window if window > 0 else FULL_WINDOW,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), block_tables.stride(1),
        out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=group_pad, BLOCK_M=block_m,
        ROWS=max(MIN_DOT_ROWS, triton.next_power_of_2(block_m * group_pad)),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size, BLOCK_N=block_n, SOFTCAP=float(softcap),
    )
    return out


def paged_varlen_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start: torch.Tensor,
                               scale: float | None = None, window: int = 0,
                               softcap: float = 0.0) -> torch.Tensor:
    """The reference: one fp32 causal softmax per sequence over its K/V gathered from the cache (reads
    lengths on the host: for tests and the self-check only)."""
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    starts = query_start.tolist()
    for s, length in enumerate(seq_lens.tolist()):
        begin, end = starts[s], starts[s + 1]
        pos = torch.arange(length, device=q.device)
        pages = block_tables[s, pos // block_size].long()
        keys = k_cache[pages, pos % block_size].float().repeat_interleave(group, dim=1)  # (L, Hq, D)
        values = v_cache[pages, pos % block_size].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,lhd->htl", q[begin:end].float(), keys) * scale  # (Hq, n, L)
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = torch.arange(length - (end - begin), length, device=q.device)
        hidden = pos[None, None, :] > q_pos[None, :, None]
        if window > 0:
            hidden |= pos[None, None, :] <= q_pos[None, :, None] - window
        scores = scores.masked_fill(hidden, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[begin:end] = torch.einsum("htl,lhd->thd", probs, values).to(q.dtype)
    return out
