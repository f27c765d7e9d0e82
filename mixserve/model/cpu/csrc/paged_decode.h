// The paged attention kernel's decode item: one query token over every KV head of its sequence (float32, and
// bfloat16 where a key's row of every KV head fits MAX_DECODE_ROW floats: its products through vdpbf16ps
// where the CPU has AVX512-BF16, bf16_dot.h, else widened to float32).
//
// Keys go in spans of up to 256 (16 tiles of 16): every head's scores for the span, then one softmax step per
// head over the span, then P.V over it. The online softmax's bookkeeping (the max, the rescale factor, the
// accumulator's rescale) happens once a span, not once a tile: once per tile it cost more than the products
// themselves in bf16, where the arithmetic, not the reads, bounds a decode.
// A sliding window starts the keys at ctx - window: the blocks below it stay in the cache, unread.
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
constexpr int64_t SPAN_FLOATS = 4096;     // a span's scores of every head (spans of 32 to 256 keys)
constexpr int64_t MAX_SPAN = 256;

// The cache lines of one key tile's rows (every KV head) of K or of V, asked for a few at a time between
// pieces of another tile's arithmetic.
struct LineFeed {
    const char* row[KEY_TILE];
    int64_t rows = 0, lines = 0, r = 0, b = 0;  // lines per row; (r, b): the next line

    template <typename T>
    void aim(const T* cache, const int64_t* table, int64_t kt, int64_t ctx, int64_t kv_row, const Shape& sh) {
        rows = r = b = 0;  // kv_row: elements a key's row of every KV head takes
        lines = (kv_row * static_cast<int64_t>(sizeof(T)) + 63) / 64;
        if (kt >= ctx) return;
        const int64_t nk = std::min<int64_t>(KEY_TILE, ctx - kt);
        int64_t blk = kt / sh.block_size, off = kt % sh.block_size;
        for (int64_t j = 0; j < nk; ++j, ++off) {
            if (off == sh.block_size) off = 0, ++blk;
            row[rows++] = reinterpret_cast<const char*>(cache + (table[blk] * sh.block_size + off) * kv_row);
        }
    }
    int64_t total() const { return rows * lines; }
    void issue(int64_t count) {
        for (; count > 0 && r < rows; --count) {
            prefetch_l2(row[r] + 64 * b);
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

// One online-softmax step of a query row over a span of n keys: s[0..n) its scores (whole tiles of 16, the
// lanes past n ignored) become the numerators exp(s - m_new), 0 past n, in place, or with `pairs` (the bf16
// P.V) as bf16 pairs there instead; m and l are updated, and the factor the row's accumulator must be scaled
// by is returned (~0 on the first span).
inline float softmax_span_row(float* s, int64_t n, float& m, float& l, int32_t* pairs) {
    const vi16 iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const vf16 zero = {}, neg = zero + NEG_BIG;
    const int64_t nt = (n + KEY_TILE - 1) / KEY_TILE;
    const vi16 keep = iota < static_cast<int32_t>(n - (nt - 1) * KEY_TILE);  // the last tile's keys
    vf16 mx = neg;
    for (int64_t t = 0; t < nt; ++t) {
        vf16 v = load16(s + t * KEY_TILE);
        if (t == nt - 1) v = keep ? v : neg;
        mx = mx > v ? mx : v;
    }
    const float m_new = std::max(m, hmax16(mx)), alpha = fast_exp(m - m_new);
    vf16 sum = zero;
    for (int64_t t = 0; t < nt; ++t) {
        vf16 e = exp16(load16(s + t * KEY_TILE) - m_new);
        if (t == nt - 1) e = keep ? e : zero;
        sum += e;
        if (pairs) store_pairs_bf16(pairs + t * (KEY_TILE / 2), e);
        else store16(s + t * KEY_TILE, e);
    }
    l = l * alpha + hsum16(sum);
    m = m_new;
    return alpha;
}

// True where a decode reads its K/V rows as they lie (float32, and bf16 through vdpbf16ps), so no row of every KV
// head has to fit a widening buffer (MAX_DECODE_ROW).
template <typename T, int DC>
constexpr bool decode_reads_in_place() {
    return sizeof(T) == sizeof(float) || (BF16_DOT && DC % 32 == 0);
}

// A decode's query token, or a few consecutive ones (a decode verifying drafts), over every KV head at once: a
// key's rows for all heads lie side by side in the cache, so each block is streamed once, where an item per KV
// head read it num_kv_heads times at a stride. The last token sees keys 0..ctx - 1, each earlier one a key
// fewer; no sliding window cuts any of them (the caller's rule). Row r is head r / n's query of token r % n,
// so a KV head's rows are adjacent. CAP: the layer caps its scores (sh.softcap), compiled apart so the
// uncapped loop carries no branch.
template <typename T, int DC, bool CAP>
void attend_decode(const Item& it, const T* q, const T* k_cache, const T* v_cache, T* out, int64_t ctx,
                   const int64_t* block_tables, const Shape& sh) {
    const int64_t n = it.q_end - it.q_begin, nkv = sh.num_kv_heads, G = sh.num_heads / nkv;
    const int64_t rows = n * sh.num_heads, group = G * n;  // group: the rows of one KV head
    const int64_t* table = block_tables + it.seq * sh.max_blocks;
    const int64_t span = std::min<int64_t>(MAX_SPAN, SPAN_FLOATS / rows / KEY_TILE * KEY_TILE);
    alignas(64) float qs[MAX_ROWS][DC];
    alignas(64) float acc[MAX_ROWS][DC];
    alignas(64) float sc[SPAN_FLOATS];  // sc[h * span + j]: head h's score (then numerator) of the span's key j
    alignas(64) int32_t pp[SPAN_FLOATS / 2];  // bf16 path: pp[h * span / 2 + jj], keys 2jj, 2jj + 1 as a pair
    float m[MAX_ROWS], l[MAX_ROWS], ones[MAX_ROWS];
    const float *krow[KEY_TILE], *vrow[KEY_TILE], *kh[KEY_TILE], *vh[KEY_TILE];
    // bf16 with AVX512-BF16: scores and P.V by vdpbf16ps on K and V as they lie in the cache (bf16_dot.h)
    constexpr bool DOT = !std::is_same_v<T, float> && decode_reads_in_place<T, DC>();
    constexpr int64_t W = sizeof(T) == sizeof(float) || DOT ? 1 : MAX_DECODE_ROW;  // widened bf16 rows
    alignas(64) float kw[KEY_TILE][W];
    alignas(64) float vw[KEY_TILE][W];
    alignas(64) static const uint16_t zero_row[DC] = {};
    const T *kraw[KEY_TILE], *kq[KEY_TILE], *vraw[KEY_TILE], *vq[KEY_TILE];
    auto q_row = [&](int64_t r) { return q + (it.q_begin + r % n) * sh.q_stride_t + r / n * sh.q_stride_h; };
    for (int64_t r = 0; r < rows; ++r) {
        const T* src = q_row(r);
        for (int64_t d = 0; d < DC; ++d) qs[r][d] = load(src + d) * sh.scale, acc[r][d] = 0.f;
        m[r] = NEG_BIG, l[r] = 0.f, ones[r] = 1.f;
    }
    // K tiles of a span, then its V tiles, then the next span's: the feed runs PREFETCH_TILES tiles ahead of
    // that order, in small doses between pieces of arithmetic (one burst of a tile's prefetches stalled the
    // core until fill buffers freed up: 1.35x slower, measured on the per-tile kernel this replaced).
    const int64_t kv_row = nkv * DC;
    LineFeed feed;
    auto aim = [&](int64_t s0, int64_t nt, int64_t pos) {  // pos: tiles past the span's first K tile
        pos += PREFETCH_TILES;
        if (pos < nt) feed.aim(k_cache, table, s0 + pos * KEY_TILE, ctx, kv_row, sh);
        else if (pos < 2 * nt) feed.aim(v_cache, table, s0 + (pos - nt) * KEY_TILE, ctx, kv_row, sh);
        else feed.aim(k_cache, table, s0 + span + (pos - 2 * nt) * KEY_TILE, ctx, kv_row, sh);
    };
    const int64_t k_first = first_key(ctx - 1, sh);  // the last token is at ctx - 1: it sees keys k_first..ctx - 1
    for (int64_t t = 0; t < PREFETCH_TILES; ++t) {
        feed.aim(k_cache, table, k_first + t * KEY_TILE, ctx, kv_row, sh);
        feed.issue(feed.total());
    }
    for (int64_t s0 = k_first; s0 < ctx; s0 += span) {
        const int64_t keys = std::min<int64_t>(span, ctx - s0), nt = (keys + KEY_TILE - 1) / KEY_TILE;
        for (int64_t t = 0; t < nt; ++t) {  // every head's scores of the span
            const int64_t k0 = s0 + t * KEY_TILE, nk = std::min<int64_t>(KEY_TILE, ctx - k0);
            aim(s0, nt, t);
            const int64_t dose = (feed.total() + rows - 1) / rows;
            if constexpr (DOT) raw_rows(k_cache, table, k0, nk, kv_row, 0, sh, kraw);
            else whole_rows<T, W>(k_cache, table, k0, nk, kv_row, sh, kw, krow);
            for (int64_t hk = 0; hk < nkv; ++hk) {
                for (int64_t j = 0; j < nk; ++j) {
                    if constexpr (DOT) kq[j] = kraw[j] + hk * DC;
                    else kh[j] = krow[j] + hk * DC;
                }
                for (int64_t r = hk * group; r < (hk + 1) * group; ++r) {
                    float* s = sc + r * span + t * KEY_TILE;
                    if constexpr (DOT) row_scores_bf16<DC>(q_row(r), kq, nk, sh.scale, s);
                    else few_row_scores<DC, DC>(qs + r, kh, 1, nk, reinterpret_cast<float(*)[KEY_TILE]>(s));
                    feed.issue(dose);
                }
            }
        }
        if constexpr (CAP)
            for (int64_t h = 0; h < rows; ++h) softcap_scores(sc + h * span, nt * KEY_TILE, sh.softcap);
        for (int64_t r = 0; r < rows; ++r) {  // one online-softmax step a row, over the keys its token sees
            const int64_t seen = std::clamp<int64_t>(ctx - (n - 1 - r % n) - s0, 0, keys);
            const int64_t from = (seen + KEY_TILE - 1) / KEY_TILE * KEY_TILE;  // whole tiles past them: zeros
            float* s = sc + r * span;
            int32_t* pairs = DOT ? pp + r * (span / 2) : nullptr;
            const float alpha = softmax_span_row(s, seen, m[r], l[r], pairs);
            if constexpr (DOT) std::fill(pairs + from / 2, pairs + nt * KEY_TILE / 2, 0);
            else std::fill(s + from, s + nt * KEY_TILE, 0.f);
            for (int64_t d = 0; d < DC; d += 16) store16(acc[r] + d, load16(acc[r] + d) * alpha);
        }
        for (int64_t t = 0; t < nt; ++t) {  // P.V over the span
            const int64_t k0 = s0 + t * KEY_TILE, nk = std::min<int64_t>(KEY_TILE, ctx - k0);
            aim(s0, nt, nt + t);
            const int64_t dose = (feed.total() + nkv - 1) / nkv;
            if constexpr (DOT) raw_rows(v_cache, table, k0, nk, kv_row, 0, sh, vraw);
            else whole_rows<T, W>(v_cache, table, k0, nk, kv_row, sh, vw, vrow);
            for (int64_t hk = 0; hk < nkv; ++hk) {
                if constexpr (DOT) {
                    for (int64_t j = 0; j < KEY_TILE; ++j) vq[j] = j < nk ? vraw[j] + hk * DC : zero_row;
                    pairs_accumulate_bf16<DC>(acc + hk * group, pp + hk * group * (span / 2) + t * (KEY_TILE / 2),
                                              span / 2, vq, group);
                } else {
                    for (int64_t j = 0; j < nk; ++j) vh[j] = vrow[j] + hk * DC;
                    scale_accumulate<DC, DC>(acc + hk * group, ones, sc + hk * group * span + t * KEY_TILE, span, 1,
                                             vh, nk, group);
                }
                feed.issue(dose);
            }
        }
    }
    for (int64_t r = 0; r < rows; ++r) {
        T* dst = out + (it.q_begin + r % n) * sh.o_stride_t + r / n * sh.o_stride_h;
        const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
        for (int64_t d = 0; d < DC; ++d) store(dst + d, acc[r][d] * inv);
    }
}

}  // namespace mixserve
