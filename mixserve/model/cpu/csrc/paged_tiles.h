// What the paged attention kernel's tile loops share: sizes, a work item, the shape, and the reads of one
// key tile's K/V rows from the paged cache (pointers into it, or widened copies for bfloat16).
#pragma once
#include <stdint.h>

#include <algorithm>

#include "common.h"
#include "vec16.h"

namespace mixserve {

constexpr int KEY_TILE = 16;
constexpr int PREFETCH_TILES = 2;  // how far ahead the K/V rows are asked for (1 measured the same)
constexpr int TILE_TOKENS = 16;
constexpr int MAX_ROWS = 128;  // TILE_TOKENS * the largest GQA group a tile takes (G <= 8)
constexpr int MAX_HEAD_DIM = 256;
// A finite "minus infinity": the library is built with -ffinite-math-only, which assumes no infinities.
constexpr float NEG_BIG = -1e30f;

// A cache line asked for ahead of its use goes to L2 (prefetcht1), not L1: a decode streams ~100 KB of K/V a
// sequence and layer, and prefetches into L1 held its few fill buffers until the line arrived, so the loads
// they were for queued behind them (docs/decisions/cpu-prefetch-to-l2.md).
inline void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 2); }

struct Item {
    int64_t seq, kv_head, q_begin, q_end;  // q_begin/q_end: packed token indices of the tile
};

struct Shape {
    int64_t num_heads, num_kv_heads, head_dim, block_size, max_blocks;
    int64_t q_stride_t, q_stride_h, o_stride_t, o_stride_h;
    float scale;
    int64_t window;  // 0: full causal; w > 0: a query at p sees keys p - w < j <= p
    float softcap;   // 0: none; c > 0: each scaled score s becomes c * tanh(s / c)
};

// The first key a query at position p sees (the window's start, or 0).
inline int64_t first_key(int64_t p, const Shape& sh) {
    return sh.window > 0 ? std::max<int64_t>(0, p - sh.window + 1) : 0;
}

// Rows of K (or V) for one key tile as float pointers: float32 caches are read in place, bfloat16 rows
// are widened into `buf` once per tile.
template <typename T, int DC>
inline void tile_rows(const T* cache, const int64_t* table, int64_t k0, int64_t nk, int64_t head_off,
                      const Shape& sh, float (*buf)[MAX_HEAD_DIM], const float** rows) {
    const int64_t D = DC ? DC : sh.head_dim, kv_row = sh.num_kv_heads * D;
    int64_t blk = k0 / sh.block_size, off = k0 % sh.block_size;  // one division a tile, not two a key
    for (int64_t j = 0; j < nk; ++j, ++off) {
        if (off == sh.block_size) off = 0, ++blk;
        const T* src = cache + (table[blk] * sh.block_size + off) * kv_row + head_off;
        if constexpr (sizeof(T) == sizeof(float)) {
            rows[j] = reinterpret_cast<const float*>(src);
        } else {
            for (int64_t d = 0; d < D; ++d) buf[j][d] = load(src + d);
            rows[j] = buf[j];
        }
    }
}

// Pointers to the rows of keys [k0, k0 + nk) as they lie in the cache (any dtype; kv_row: elements a key's
// row of every KV head takes, head_off: where the wanted head's row starts in it).
template <typename T>
inline void raw_rows(const T* cache, const int64_t* table, int64_t k0, int64_t nk, int64_t kv_row,
                     int64_t head_off, const Shape& sh, const T** rows) {
    int64_t blk = k0 / sh.block_size, off = k0 % sh.block_size;
    for (int64_t j = 0; j < nk; ++j, ++off) {
        if (off == sh.block_size) off = 0, ++blk;
        rows[j] = cache + (table[blk] * sh.block_size + off) * kv_row + head_off;
    }
}

// Asks for the rows of keys [k0, k0 + nk) of one KV head ahead of their use. Each row is a short run (head_dim
// elements) at a stride of num_kv_heads rows, which the hardware prefetchers follow poorly: without this a
// decode waited on memory at each key tile (~20% of its attention time here).
// `heads` KV heads from head_off on (adjacent in the cache): a decode over all heads asks for whole rows.
template <typename T>
inline void prefetch_rows(const T* cache, const int64_t* table, int64_t k0, int64_t nk, int64_t head_off,
                          int64_t D, const Shape& sh, int64_t heads = 1) {
    const int64_t kv_row = sh.num_kv_heads * D, bytes = heads * D * static_cast<int64_t>(sizeof(T));
    int64_t blk = k0 / sh.block_size, off = k0 % sh.block_size;
    for (int64_t j = 0; j < nk; ++j, ++off) {
        if (off == sh.block_size) off = 0, ++blk;
        const char* src = reinterpret_cast<const char*>(cache + (table[blk] * sh.block_size + off) * kv_row
                                                        + head_off);
        for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(src + b);
    }
}

// The K and V rows of the keys PREFETCH_TILES tiles past key tile k0 (the first tile, k0 == k_first, asks for
// all of them), of keys below num_keys.
template <typename T>
inline void prefetch_ahead(const T* k_cache, const T* v_cache, const int64_t* table, int64_t k0, int64_t k_first,
                           int64_t num_keys, int64_t head_off, int64_t D, const Shape& sh, int64_t heads = 1) {
    const int64_t p0 = k0 == k_first ? k0 + KEY_TILE : k0 + PREFETCH_TILES * KEY_TILE;
    const int64_t p1 = std::min<int64_t>(num_keys, k0 + (PREFETCH_TILES + 1) * KEY_TILE);
    if (p0 < p1) {
        prefetch_rows(k_cache, table, p0, p1 - p0, head_off, D, sh, heads);
        prefetch_rows(v_cache, table, p0, p1 - p0, head_off, D, sh, heads);
    }
}

// A chunk item's output: row r (query token r / G, head kv_head * G + r % G) is acc[r] / its softmax sum, the
// sums held as one vf16 per group of 16 rows (0 for a row that saw no key).
template <typename T, int DC>
inline void write_chunk_rows(const Item& it, const float (*acc)[DC], const vf16* l, int64_t rows, int64_t G,
                             const Shape& sh, T* out) {
    for (int64_t g = 0; g < (rows + 15) / 16; ++g) {
        alignas(64) float lsum[16];
        store16(lsum, l[g]);
        for (int64_t i = 0; i < 16 && 16 * g + i < rows; ++i) {
            const int64_t r = 16 * g + i;
            T* dst = out + (it.q_begin + r / G) * sh.o_stride_t + (it.kv_head * G + r % G) * sh.o_stride_h;
            const float inv = lsum[i] > 0.f ? 1.f / lsum[i] : 0.f;
            for (int64_t d = 0; d < DC; ++d) store(dst + d, acc[r][d] * inv);
        }
    }
}

}  // namespace mixserve
