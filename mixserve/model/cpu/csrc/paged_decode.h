// The paged attention kernel's decode item: one query token over every KV head of its sequence (float32, and
// bfloat16 where a key's row of every KV head fits MAX_DECODE_ROW floats: its products through vdpbf16ps
// where the CPU has AVX512-BF16, bf16_dot.h, else widened to float32).
#pragma once
#include <stdint.h>

#include <algorithm>
#include <type_traits>

#include "bf16_dot.h"
#include "common.h"
#include "paged_tiles.h"
#include "softmax16.h"
#include "vec16.h"

namespace mixserve {

constexpr int64_t MAX_DECODE_ROW = 1024;  // bf16: a key's K (or V) row of every KV head, widened per tile

// The cache lines of one key tile's K and V rows (every KV head), asked for a few at a time between pieces
// of another tile's arithmetic.
struct LineFeed {
    const char* row[2 * KEY_TILE];
    int64_t rows = 0, lines = 0, r = 0, b = 0;  // lines per row; (r, b): the next line

    template <typename T>
    void aim(const T* k_cache, const T* v_cache, const int64_t* table, int64_t kt, int64_t ctx,
             int64_t kv_row, const Shape& sh) {  // kv_row: elements a key's row of every KV head takes
        rows = r = b = 0;
        lines = (kv_row * static_cast<int64_t>(sizeof(T)) + 63) / 64;
        if (kt >= ctx) return;
        const int64_t nk = std::min<int64_t>(KEY_TILE, ctx - kt);
        int64_t blk = kt / sh.block_size, off = kt % sh.block_size;
        for (int64_t j = 0; j < nk; ++j, ++off) {
            if (off == sh.block_size) off = 0, ++blk;
            const int64_t at = (table[blk] * sh.block_size + off) * kv_row;
            row[rows++] = reinterpret_cast<const char*>(k_cache + at);
            row[rows++] = reinterpret_cast<const char*>(v_cache + at);
        }
    }
    int64_t total() const { return rows * lines; }
    void issue(int64_t count) {
        for (; count > 0 && r < rows; --count) {
            __builtin_prefetch(row[r] + 64 * b);
            if (++b == lines) b = 0, ++r;
        }
    }
};

// A tile's rows of every KV head: float32 rows are read in place, bfloat16 rows widened into `buf`.
template <typename T, int64_t W>
inline void whole_rows(const T* cache, const int64_t* table, int64_t k0, int64_t nk, int64_t kv_row,
                       const Shape& sh, float (*buf)[W], const float** rows) {
    int64_t blk = k0 / sh.block_size, off = k0 % sh.block_size;
    for (int64_t j = 0; j < nk; ++j, ++off) {
        if (off == sh.block_size) off = 0, ++blk;
        const T* src = cache + (table[blk] * sh.block_size + off) * kv_row;
        if constexpr (sizeof(T) == sizeof(float)) {
            rows[j] = reinterpret_cast<const float*>(src);
        } else {
            for (int64_t d = 0; d < kv_row; ++d) buf[j][d] = load(src + d);
            rows[j] = buf[j];
        }
    }
}

// One decode (a single query token) over every KV head at once: a key's rows for all heads lie side by side
// in the cache, so each block is streamed once, where an item per KV head read it num_kv_heads times at a
// stride. Same arithmetic as attend_tile's few-row path, head group by head group.
template <typename T, int DC>
void attend_decode(const Item& it, const T* q, const T* k_cache, const T* v_cache, T* out,
                   const int64_t* seq_lens, const int64_t* block_tables, const Shape& sh) {
    const int64_t nkv = sh.num_kv_heads, G = sh.num_heads / nkv, rows = sh.num_heads, ctx = seq_lens[it.seq];
    const int64_t* table = block_tables + it.seq * sh.max_blocks;
    alignas(64) float qs[MAX_ROWS][DC];
    alignas(64) float acc[MAX_ROWS][DC];
    alignas(64) float sc[MAX_ROWS][KEY_TILE];
    float m[MAX_ROWS], l[MAX_ROWS], alpha_r[MAX_ROWS];
    const float *krow[KEY_TILE], *vrow[KEY_TILE], *kh[KEY_TILE], *vh[KEY_TILE];
    constexpr int64_t W = sizeof(T) == sizeof(float) ? 1 : MAX_DECODE_ROW;
    alignas(64) float kw[KEY_TILE][W];
    alignas(64) float vw[KEY_TILE][W];
    // bf16 with AVX512-BF16: scores and P.V by vdpbf16ps on K and V as they lie in the cache (bf16_dot.h)
    constexpr bool DOT = BF16_DOT && !std::is_same_v<T, float> && DC % 32 == 0;
    const T *kraw[KEY_TILE], *kq[KEY_TILE], *vraw[KEY_TILE], *vq[KEY_TILE];
    for (int64_t h = 0; h < rows; ++h) {
        const T* src = q + it.q_begin * sh.q_stride_t + h * sh.q_stride_h;
        for (int64_t d = 0; d < DC; ++d) qs[h][d] = load(src + d) * sh.scale, acc[h][d] = 0.f;
        m[h] = NEG_BIG, l[h] = 0.f;
    }
    // Tiles 1 .. PREFETCH_TILES - 1 up front, then tile t + PREFETCH_TILES in small doses between tile t's
    // pieces of arithmetic (2 x heads + KV heads of them). One burst of a tile's 384 prefetches (9 heads of 64)
    // stalled the core until fill buffers freed up, so reads and arithmetic took turns: 1.35x slower
    // (32 decodes at context 300, two kernel builds alternated in one process).
    const int64_t kv_row = nkv * DC, pieces = 2 * rows + nkv;
    LineFeed feed;
    for (int64_t t = 1; t < PREFETCH_TILES; ++t) {
        feed.aim(k_cache, v_cache, table, t * KEY_TILE, ctx, kv_row, sh);
        feed.issue(feed.total());
    }
    for (int64_t k0 = 0; k0 < ctx; k0 += KEY_TILE) {  // the token is at ctx - 1: it sees every key
        const int64_t nk = std::min<int64_t>(KEY_TILE, ctx - k0);
        feed.aim(k_cache, v_cache, table, k0 + PREFETCH_TILES * KEY_TILE, ctx, kv_row, sh);
        const int64_t dose = (feed.total() + pieces - 1) / pieces;
        if constexpr (DOT) {
            raw_rows(k_cache, table, k0, nk, kv_row, 0, sh, kraw);
            raw_rows(v_cache, table, k0, nk, kv_row, 0, sh, vraw);
        } else {
            whole_rows<T, W>(k_cache, table, k0, nk, kv_row, sh, kw, krow);
            whole_rows<T, W>(v_cache, table, k0, nk, kv_row, sh, vw, vrow);
        }
        for (int64_t hk = 0; hk < nkv; ++hk) {
            if constexpr (DOT) {
                for (int64_t j = 0; j < nk; ++j) kq[j] = kraw[j] + hk * DC;
            } else {
                for (int64_t j = 0; j < nk; ++j) kh[j] = krow[j] + hk * DC;
            }
            for (int64_t g = 0; g < G; ++g) {
                const int64_t h = hk * G + g;
                if constexpr (DOT)
                    row_scores_bf16<DC>(q + it.q_begin * sh.q_stride_t + h * sh.q_stride_h, kq, nk, sh.scale,
                                        sc[h]);
                else
                    few_row_scores<DC, DC>(qs + h, kh, 1, nk, sc + h);
                feed.issue(dose);
            }
        }
        for (int64_t r = 0; r < rows; ++r) {
            alpha_r[r] = softmax_tile_row(sc[r], nk, m[r], l[r]);
            feed.issue(dose);
        }
        for (int64_t hk = 0; hk < nkv; ++hk) {
            if constexpr (DOT) {
                for (int64_t j = 0; j < nk; ++j) vq[j] = vraw[j] + hk * DC;
                scale_accumulate_bf16<DC>(acc + hk * G, alpha_r + hk * G, sc[hk * G], KEY_TILE, 1, vq, nk, G);
            } else {
                for (int64_t j = 0; j < nk; ++j) vh[j] = vrow[j] + hk * DC;
                scale_accumulate<DC, DC>(acc + hk * G, alpha_r + hk * G, sc[hk * G], KEY_TILE, 1, vh, nk, G);
            }
            feed.issue(dose);
        }
    }
    for (int64_t h = 0; h < rows; ++h) {
        T* dst = out + it.q_begin * sh.o_stride_t + h * sh.o_stride_h;
        const float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;
        for (int64_t d = 0; d < DC; ++d) store(dst + d, acc[h][d] * inv);
    }
}

}  // namespace mixserve
