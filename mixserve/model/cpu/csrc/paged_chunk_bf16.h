// The chunk item (paged_chunk.h) in bf16 on a CPU with AVX512-BF16: scores and P.V through vdpbf16ps on K and
// V as they lie in the cache (bf16_dot.h), for head dims that are a multiple of 32.
//
// Scores key-major as in paged_chunk.h, every group of 16 query rows against a key's pair at once (one
// broadcast serves them all), in log2 units (the softmax scale times log2(e) applied once, exponentials as
// 2^x). The probabilities go to bf16 pairs of keys as the exponentials come out (as torch's CPU flash
// attention rounds them before P.V), so P.V reads them ready-made. A group's running max moves only when a
// tile's max passes it by more than RESCALE_LOG2 (the numerators then stay below 2^RESCALE_LOG2, exactly
// divided out at the end): most tiles then rescale nothing, where a max that crept up on every tile made
// every tile multiply every accumulator.
#pragma once
#include <stdint.h>
#include <string.h>

#include <algorithm>

#include "bf16_dot.h"
#include "common.h"
#include "paged_tiles.h"
#include "softmax16.h"
#include "vec16.h"

namespace mixserve {

#ifdef MIXSERVE_BF16_DOT
constexpr float RESCALE_LOG2 = 8.f;

// q's pairs of one group of 16 rows, key-major: qp[d / 2] lane i holds row i's q elements d, d + 1, gathered
// from the rows' byte offsets `at` (lanes past `valid` hold zeros).
template <int DC>
inline void gather_q_pairs(const uint16_t* base, const int32_t* at, int64_t valid, vi16* qp) {
    const __m512i offs = _mm512_loadu_si512(at);
    const __mmask16 live = valid >= 16 ? 0xffff : static_cast<__mmask16>((1u << valid) - 1);
    const char* p = reinterpret_cast<const char*>(base);
    for (int d = 0; d < DC; d += 2)
        qp[d / 2] = (vi16)_mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, offs, p + 2 * d, 1);
}

template <int DC>
void attend_chunk_bf16(const Item& it, const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache,
                       uint16_t* out, const int64_t* query_start, const int64_t* seq_lens,
                       const int64_t* block_tables, const Shape& sh) {
    static_assert(DC % 32 == 0 && DC <= MAX_HEAD_DIM, "head dim a multiple of 32");
    constexpr int MAX_GROUPS = MAX_ROWS / 16, RB = DC / 16 <= 4 ? 4 : 2;
    const int64_t G = sh.num_heads / sh.num_kv_heads;
    const int64_t n_tok = it.q_end - it.q_begin, rows = n_tok * G, groups = (rows + 15) / 16;
    const int64_t qlen = query_start[it.seq + 1] - query_start[it.seq];
    const int64_t pos0 = seq_lens[it.seq] - qlen + (it.q_begin - query_start[it.seq]);  // of the first token
    const int64_t* table = block_tables + it.seq * sh.max_blocks;
    const int64_t head_off = it.kv_head * DC, kv_row = sh.num_kv_heads * DC;

    vi16 qp[MAX_GROUPS][DC / 2];  // qp[g][d / 2] lane i: row 16g + i's q elements d, d + 1
    vi16 row_pos[MAX_GROUPS];     // each lane's absolute position (-1: a padding row, which sees no key)
    vf16 m[MAX_GROUPS], l[MAX_GROUPS];
    alignas(64) float acc[MAX_ROWS][DC];
    alignas(64) int32_t pp[KEY_TILE / 2][MAX_ROWS];  // pp[jj][r]: row r's probabilities of keys 2jj, 2jj + 1
    alignas(64) float alpha[MAX_ROWS];
    alignas(64) static const uint16_t zero_row[DC] = {};
    const uint16_t *kraw[KEY_TILE], *vraw[KEY_TILE];
    const uint16_t* q0 = q + it.q_begin * sh.q_stride_t + it.kv_head * G * sh.q_stride_h;
    for (int64_t g = 0; g < groups; ++g) {
        alignas(64) int32_t pos[16], at[16];
        for (int64_t i = 0; i < 16; ++i) {
            const int64_t r = std::min<int64_t>(16 * g + i, rows - 1);
            pos[i] = 16 * g + i < rows ? static_cast<int32_t>(pos0 + r / G) : -1;
            at[i] = static_cast<int32_t>(2 * ((r / G) * sh.q_stride_t + (r % G) * sh.q_stride_h));
        }
        gather_q_pairs<DC>(q0, at, rows - 16 * g, qp[g]);
        row_pos[g] = *reinterpret_cast<const vi16*>(pos);
        m[g] = vf16{} + NEG_BIG;
        l[g] = vf16{};
    }
    memset(acc, 0, sizeof(float) * DC * 16 * groups);

    const int64_t num_keys = pos0 + n_tok;  // the last query of the tile sees keys up to pos0 + n_tok - 1
    const int64_t k_first = first_key(pos0, sh);  // the first query's window starts earliest
    const float log2e = 1.44269504088896341f, cap = sh.softcap * log2e;  // the softcap in log2 units
    const vf16 zero = {}, neg = zero + NEG_BIG;
    for (int64_t k0 = k_first; k0 < num_keys; k0 += KEY_TILE) {
        const int64_t nk = std::min<int64_t>(KEY_TILE, num_keys - k0);
        prefetch_ahead(k_cache, v_cache, table, k0, k_first, num_keys, head_off, DC, sh);
        raw_rows(k_cache, table, k0, nk, kv_row, head_off, sh, kraw);
        raw_rows(v_cache, table, k0, nk, kv_row, head_off, sh, vraw);
        for (int64_t j = nk; j < KEY_TILE; ++j) vraw[j] = zero_row;  // P.V runs whole tiles (p = 0 there)
        // Keys past pos0 may lie beyond some rows (the chunk's diagonal): those tiles need the causal mask;
        // keys below the last row's window start (first_key) need the window's.
        const bool diagonal = k0 + nk - 1 > pos0;
        const bool windowed = sh.window > 0 && k0 < first_key(pos0 + n_tok - 1, sh);
        vf16 sg[MAX_GROUPS][KEY_TILE];
        key_major_scores_bf16<DC>(kraw, nk, qp, groups, sh.scale * log2e, sg);
        bool rescaled[MAX_GROUPS];
        for (int64_t g = 0; g < groups; ++g) {
            vf16* s = sg[g];
            if (sh.softcap > 0.f) softcap_scores(reinterpret_cast<float*>(s), 16 * nk, cap);
            const vi16 lowest = row_pos[g] - static_cast<int32_t>(sh.window);  // with a window: keys above this
            vf16 mx = neg;
            for (int64_t j = 0; j < KEY_TILE; ++j) {
                const vi16 key = vi16{} + static_cast<int32_t>(k0 + j);
                if (j >= nk) s[j] = neg;
                else if (diagonal) s[j] = key <= row_pos[g] ? s[j] : neg;
                if (windowed) s[j] = key > lowest ? s[j] : neg;
                mx = mx > s[j] ? mx : s[j];
            }
            rescaled[g] = _mm512_cmp_ps_mask((__m512)(mx - m[g]), _mm512_set1_ps(RESCALE_LOG2), _CMP_GT_OQ) != 0;
            const vf16 m_new = !rescaled[g] ? m[g] : m[g] > mx ? m[g] : mx;
            vf16 sum = zero;
            for (int64_t jj = 0; jj < KEY_TILE / 2; ++jj) {
                vf16 e0 = exp2_16(s[2 * jj] - m_new), e1 = exp2_16(s[2 * jj + 1] - m_new);
                e0 = s[2 * jj] > neg ? e0 : zero;  // masked keys: exactly 0
                e1 = s[2 * jj + 1] > neg ? e1 : zero;
                sum += e0 + e1;
                store_pair_lanes_bf16(pp[jj] + 16 * g, e0, e1);
            }
            if (rescaled[g]) {  // ~0 (underflow) on a row's first tile
                const vf16 a = exp2_16(m[g] - m_new);
                l[g] *= a;
                store16(alpha + 16 * g, a);
            }
            l[g] += sum;
            m[g] = m_new;
        }
        vi16 vp[KEY_TILE / 2][DC / 16];
        interleave_pairs<DC>(vraw, KEY_TILE, vp);
        for (int64_t r = 0; r < 16 * groups; r += RB)  // 16 rows a group: whole blocks
            pair_rows<DC, RB>(acc + r, pp[0] + r, 1, MAX_ROWS, vp, rescaled[r / 16] ? alpha + r : nullptr);
    }
    write_chunk_rows<uint16_t, DC>(it, acc, l, rows, G, sh, out);
}
#else
template <int DC>
void attend_chunk_bf16(const Item&, const uint16_t*, const uint16_t*, const uint16_t*, uint16_t*, const int64_t*,
                       const int64_t*, const int64_t*, const Shape&) {}
#endif

}  // namespace mixserve
