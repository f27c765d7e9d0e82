// The paged attention kernel's chunk item: up to TILE_TOKENS query tokens of one sequence (a prefill chunk)
// over one KV head, every query head of its GQA group at once, head dims that are a multiple of 16.
//
// Scores are kept key-major, 16 query rows to a vector (lane i = row i of a group of 16): a key's scores
// against the group are D broadcast-FMAs of that key's row into one vector, and the online softmax's max,
// exponentials and sums run down the keys, lane by lane. Row-major (a row's 16 keys in a vector) needed a
// horizontal max and a horizontal sum per row per key tile, and a transpose of every K tile: measured, that
// was ~30% of a chunk's attention time. K rows are copied once per tile into one buffer, so the
// broadcasts address it from one register.
#pragma once
#include <stdint.h>
#include <string.h>

#include <algorithm>

#include "common.h"
#include "paged_tiles.h"
#include "softmax16.h"
#include "vec16.h"

namespace mixserve {

constexpr int MAX_GROUPS = MAX_ROWS / 16;

// s[j] = K[key j] . qt (lanes: the group's 16 rows) for j < nk.
template <int DC>
inline void key_major_scores(const float (*kbuf)[DC], int64_t nk, const vf16* qt, vf16* s) {
    if constexpr (VF16_REGS < 32) {  // AVX2: on halves (vec16.h's vf8), 4 keys a pass: 8 sums, 2 q halves
        const float* q = reinterpret_cast<const float*>(qt);  // qt[d]: 16 floats, lanes of the group's rows
        float* out = reinterpret_cast<float*>(s);
        for (int64_t j0 = 0; j0 < KEY_TILE; j0 += 4) {
            vf8 lo[4] = {}, hi[4] = {};
            for (int d = 0; d < DC; ++d) {
                const vf8 ql = load8(q + 16 * d), qh = load8(q + 16 * d + 8);
                for (int j = 0; j < 4; ++j) {
                    const vf8 k = vf8{} + (j0 + j < nk ? kbuf[j0 + j][d] : 0.f);
                    lo[j] += k * ql;
                    hi[j] += k * qh;
                }
            }
            for (int j = 0; j < 4; ++j) store8(out + 16 * (j0 + j), lo[j]), store8(out + 16 * (j0 + j) + 8, hi[j]);
        }
        return;
    }
    if (nk == KEY_TILE) {  // the common case: independent FMA chains in registers, the trip counts known
        constexpr int KB = KEY_TILE;
        for (int j0 = 0; j0 < KEY_TILE; j0 += KB) {
            vf16 a[KB] = {};
            for (int d = 0; d < DC; ++d) {
                const vf16 qd = qt[d];
                for (int j = 0; j < KB; ++j) a[j] += kbuf[j0 + j][d] * qd;
            }
            for (int j = 0; j < KB; ++j) s[j0 + j] = a[j];
        }
    } else {
        for (int j = 0; j < KEY_TILE; ++j) s[j] = vf16{};
        for (int d = 0; d < DC; ++d)
            for (int64_t j = 0; j < nk; ++j) s[j] += kbuf[j][d] * qt[d];
    }
}

// One online-softmax step of a group's rows over a key tile, key-major, on lanes of type VF (VL of them;
// AVX2 takes a group's 16 rows as two halves of 8, where GCC's vf16 code went through the stack): sc + 16 j
// holds key j's scores of the 16 rows, from `lane` on; the numerators go to p + j * MAX_ROWS; m, l, alpha
// and row_pos are the group's running max, sum, rescale factor and positions (-1: a padding row). `diagonal`
// masks keys past a row's position, `window` > 0 keys at or below its position - window.
template <typename VF, typename VI>
inline void softmax_tile_lanes(float* sc, int64_t nk, bool diagonal, int64_t window, int64_t k0,
                               const int32_t* row_pos, float* m, float* l, float* alpha, float* p) {
    auto ld = [](const float* a) { VF v; memcpy(&v, a, sizeof v); return v; };
    auto st = [](float* a, VF v) { memcpy(a, &v, sizeof v); };
    VI pos;
    memcpy(&pos, row_pos, sizeof pos);
    const VF zero = {}, neg = zero + NEG_BIG;
    VF mx = neg;
    const VI lowest = pos - static_cast<int32_t>(window);  // with a window: keys above this
    for (int64_t j = 0; j < nk; ++j) {
        VF v = ld(sc + 16 * j);
        const VI key = VI{} + static_cast<int32_t>(k0 + j);
        if (diagonal) v = key <= pos ? v : neg;
        if (window > 0) v = key > lowest ? v : neg;
        if (diagonal || window > 0) st(sc + 16 * j, v);
        mx = mx > v ? mx : v;
    }
    const VF m_old = ld(m), m_new = m_old > mx ? m_old : mx;
    const VF a = exp_lanes<VF, VI>(m_old - m_new);  // 0 (underflow) on a row's first tile; 1 where nothing is new
    VF sum = zero;
    for (int64_t j = 0; j < nk; ++j) {
        const VF v = ld(sc + 16 * j);
        VF e = exp_lanes<VF, VI>(v - m_new);
        e = v > neg ? e : zero;  // masked keys: exactly 0
        st(p + j * MAX_ROWS, e);
        sum += e;
    }
    st(l, ld(l) * a + sum);
    st(m, m_new);
    st(alpha, a);
}

template <typename T, int DC>
void attend_chunk(const Item& it, const T* q, const T* k_cache, const T* v_cache, T* out,
                  const int64_t* query_start, const int64_t* seq_lens, const int64_t* block_tables,
                  const Shape& sh) {
    static_assert(DC % 16 == 0 && DC <= MAX_HEAD_DIM, "head dim a multiple of 16");
    const int64_t G = sh.num_heads / sh.num_kv_heads;
    const int64_t n_tok = it.q_end - it.q_begin, rows = n_tok * G, groups = (rows + 15) / 16;
    const int64_t qlen = query_start[it.seq + 1] - query_start[it.seq];
    const int64_t pos0 = seq_lens[it.seq] - qlen + (it.q_begin - query_start[it.seq]);  // of the first token
    const int64_t* table = block_tables + it.seq * sh.max_blocks;
    const int64_t head_off = it.kv_head * DC;

    vf16 qt[MAX_GROUPS][DC];  // qt[g][d] lane i: row 16g + i's query at dim d (scaled; 0 for padding rows)
    vi16 row_pos[MAX_GROUPS];  // each lane's absolute position (-1: a padding row, which sees no key)
    vf16 m[MAX_GROUPS], l[MAX_GROUPS];
    alignas(64) float acc[MAX_ROWS][DC];
    alignas(64) float p[KEY_TILE][MAX_ROWS];  // the tile's softmax numerators, key-major
    alignas(64) float alpha[MAX_ROWS];
    alignas(64) float kbuf[KEY_TILE][DC];
    alignas(64) float vbuf[KEY_TILE][MAX_HEAD_DIM];
    const float* krow[KEY_TILE];
    const float* vrow[KEY_TILE];

    for (int64_t g = 0; g < groups; ++g) {
        alignas(64) float lane[16][DC];
        alignas(64) int32_t pos[16];
        for (int64_t i = 0; i < 16; ++i) {
            const int64_t r = 16 * g + i;
            pos[i] = r < rows ? static_cast<int32_t>(pos0 + r / G) : -1;
            const T* src = q + (it.q_begin + r / G) * sh.q_stride_t + (it.kv_head * G + r % G) * sh.q_stride_h;
            for (int64_t d = 0; d < DC; ++d) lane[i][d] = r < rows ? load(src + d) * sh.scale : 0.f;
        }
        for (int64_t d = 0; d < DC; ++d)
            for (int i = 0; i < 16; ++i) qt[g][d][i] = lane[i][d];
        row_pos[g] = *reinterpret_cast<const vi16*>(pos);
        m[g] = vf16{} + NEG_BIG;
        l[g] = vf16{};
    }
    memset(acc, 0, sizeof(float) * DC * 16 * groups);

    const int64_t num_keys = pos0 + n_tok;  // the last query of the tile sees keys up to pos0 + n_tok - 1
    const int64_t k_first = first_key(pos0, sh);  // the first query's window starts earliest
    for (int64_t k0 = k_first; k0 < num_keys; k0 += KEY_TILE) {
        const int64_t nk = std::min<int64_t>(KEY_TILE, num_keys - k0);
        prefetch_ahead(k_cache, v_cache, table, k0, k_first, num_keys, head_off, DC, sh);
        tile_rows<T, DC>(k_cache, table, k0, nk, head_off, sh, vbuf, krow);
        for (int64_t j = 0; j < nk; ++j) memcpy(kbuf[j], krow[j], sizeof(float) * DC);
        tile_rows<T, DC>(v_cache, table, k0, nk, head_off, sh, vbuf, vrow);
        // Keys past pos0 may lie beyond some rows (the chunk's diagonal): those tiles need the causal mask;
        // keys below the last row's window start (first_key) need the window's.
        const bool diagonal = k0 + nk - 1 > pos0;
        const int64_t window = sh.window > 0 && k0 < first_key(pos0 + n_tok - 1, sh) ? sh.window : 0;
        for (int64_t g = 0; g < groups; ++g) {
            vf16 s[KEY_TILE];
            key_major_scores<DC>(kbuf, nk, qt[g], s);
            float* sc = reinterpret_cast<float*>(s);
            if (sh.softcap > 0.f) softcap_scores(sc, 16 * nk, sh.softcap);
            const int32_t* pos = reinterpret_cast<const int32_t*>(row_pos + g);
            float *mg = reinterpret_cast<float*>(m + g), *lg = reinterpret_cast<float*>(l + g);
            if constexpr (VF16_REGS < 32) {
                for (int h = 0; h < 16; h += 8)
                    softmax_tile_lanes<vf8, vi8>(sc + h, nk, diagonal, window, k0, pos + h, mg + h, lg + h,
                                                 alpha + 16 * g + h, p[0] + 16 * g + h);
            } else {
                softmax_tile_lanes<vf16, vi16>(sc, nk, diagonal, window, k0, pos, mg, lg, alpha + 16 * g,
                                               p[0] + 16 * g);
            }
        }
        scale_accumulate<DC, DC>(acc, alpha, p[0], 1, MAX_ROWS, vrow, nk, 16 * groups);
    }
    write_chunk_rows<T, DC>(it, acc, l, rows, G, sh, out);
}

}  // namespace mixserve
