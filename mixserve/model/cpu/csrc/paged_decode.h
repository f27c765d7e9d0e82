// The paged attention kernel's float32 decode item: one query token over every KV head of its sequence.
#pragma once
#include <stdint.h>

#include <algorithm>

#include "common.h"
#include "paged_tiles.h"
#include "softmax16.h"
#include "vec16.h"

namespace mixserve {

// One decode (a single query token, float32) over every KV head at once: a key's rows for all heads lie side
// by side in the cache, so each block is streamed once, where an item per KV head read it num_kv_heads
// times at a stride. Same arithmetic as attend_tile's few-row path, head group by head group.
template <int DC>
void attend_decode(const Item& it, const float* q, const float* k_cache, const float* v_cache, float* out,
                   const int64_t* seq_lens, const int64_t* block_tables, const Shape& sh) {
    const int64_t nkv = sh.num_kv_heads, G = sh.num_heads / nkv, rows = sh.num_heads, ctx = seq_lens[it.seq];
    const int64_t* table = block_tables + it.seq * sh.max_blocks;
    alignas(64) float qs[MAX_ROWS][DC];
    alignas(64) float acc[MAX_ROWS][DC];
    alignas(64) float sc[MAX_ROWS][KEY_TILE];
    float m[MAX_ROWS], l[MAX_ROWS], alpha_r[MAX_ROWS];
    const float *krow[KEY_TILE], *vrow[KEY_TILE], *kh[KEY_TILE], *vh[KEY_TILE];
    for (int64_t h = 0; h < rows; ++h) {
        const float* src = q + it.q_begin * sh.q_stride_t + h * sh.q_stride_h;
        for (int64_t d = 0; d < DC; ++d) qs[h][d] = src[d] * sh.scale, acc[h][d] = 0.f;
        m[h] = NEG_BIG, l[h] = 0.f;
    }
    for (int64_t k0 = 0; k0 < ctx; k0 += KEY_TILE) {  // the token is at ctx - 1: it sees every key
        const int64_t nk = std::min<int64_t>(KEY_TILE, ctx - k0);
        prefetch_ahead(k_cache, v_cache, table, k0, ctx, 0, DC, sh, nkv);
        tile_rows<float, DC>(k_cache, table, k0, nk, 0, sh, nullptr, krow);
        tile_rows<float, DC>(v_cache, table, k0, nk, 0, sh, nullptr, vrow);
        for (int64_t hk = 0; hk < nkv; ++hk) {
            for (int64_t j = 0; j < nk; ++j) kh[j] = krow[j] + hk * DC;
            few_row_scores<DC, DC>(qs + hk * G, kh, G, nk, sc + hk * G);
        }
        for (int64_t r = 0; r < rows; ++r) alpha_r[r] = softmax_tile_row(sc[r], nk, m[r], l[r]);
        for (int64_t hk = 0; hk < nkv; ++hk) {
            for (int64_t j = 0; j < nk; ++j) vh[j] = vrow[j] + hk * DC;
            scale_accumulate<DC, DC>(acc + hk * G, alpha_r + hk * G, sc[hk * G], KEY_TILE, 1, vh, nk, G);
        }
    }
    for (int64_t h = 0; h < rows; ++h) {
        float* dst = out + it.q_begin * sh.o_stride_t + h * sh.o_stride_h;
        const float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;
        for (int64_t d = 0; d < DC; ++d) dst[d] = acc[h][d] * inv;
    }
}

}  // namespace mixserve
