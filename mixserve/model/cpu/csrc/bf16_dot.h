// bfloat16 attention scores through vdpbf16ps (AVX512-BF16): each instruction multiplies 16 pairs of bf16 and
// adds both products to 16 float32 sums, so a score takes half the instructions of widening K to float32 and
// using FMAs, and K is read from the cache as it lies (no widened copy per tile). Products of two bf16 are
// exact in float32 and the sums are float32's; the softmax scale is applied to the float32 score, not folded
// into a bf16 q (which would round it).
#pragma once
#include <stdint.h>
#include <string.h>

#include "paged_tiles.h"
#include "vec16.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#define MIXSERVE_BF16_DOT 1
#endif

namespace mixserve {

#ifdef MIXSERVE_BF16_DOT
constexpr bool BF16_DOT = true;

inline vf16 dot_pairs(vf16 acc, vi16 a, vi16 b) {
    return (vf16)_mm512_dpbf16_ps((__m512)acc, (__m512bh)a, (__m512bh)b);
}
inline vi16 load_pairs(const uint16_t* p) { return (vi16)_mm512_loadu_si512(p); }
inline vi16 broadcast_pair(const uint16_t* p) {  // elements p[0], p[1] in every 32-bit lane
    int32_t pair;
    memcpy(&pair, p, sizeof pair);
    return (vi16)_mm512_set1_epi32(pair);
}

// sc[j] = scale * q . krow[j] (DC elements, bf16) for j < nk, 0 past nk: one query row against a key tile,
// the sums folded as few_row_scores folds them.
template <int DC>
inline void row_scores_bf16(const uint16_t* q, const uint16_t* const* krow, int64_t nk, float scale, float* sc) {
    static_assert(DC % 32 == 0, "head dim a multiple of 32");
    constexpr int C = DC / 32;
    vi16 qv[C];
    for (int c = 0; c < C; ++c) qv[c] = load_pairs(q + 32 * c);
    vf16 p[16];
    for (int64_t j = 0; j < 16; ++j) {
        vf16 a = {};
        if (j < nk)
            for (int c = 0; c < C; ++c) a = dot_pairs(a, qv[c], load_pairs(krow[j] + 32 * c));
        p[j] = a;
    }
    vf16 a8[8], a4[4], a2[2];
    for (int i = 0; i < 8; ++i) a8[i] = fold8(p[2 * i], p[2 * i + 1]);
    for (int i = 0; i < 4; ++i) a4[i] = fold4(a8[2 * i], a8[2 * i + 1]);
    for (int i = 0; i < 2; ++i) a2[i] = fold2(a4[2 * i], a4[2 * i + 1]);
    store16(sc, fold1(a2[0], a2[1]) * scale);
}

// s[g][j] = scale * K[key j] . q (lanes: group g's 16 query rows) for g < NG, j < nk, key-major as the chunk
// item keeps them; qp[g][d/2] lane i holds row 16g + i's q elements d, d + 1 (a pair), krow[j] the key's bf16
// row in the cache. Each broadcast of a key's pair serves all NG groups: one broadcast a product, with a
// group at a time, was a third of the chunk's attention time.
template <int DC, int NG>
inline void key_major_scores_bf16(const uint16_t* const* krow, int64_t nk, const vi16 (*qp)[DC / 2], float scale,
                                  vf16 (*s)[KEY_TILE]) {
    constexpr int KB = NG <= 3 ? 8 : NG <= 6 ? 4 : 2;  // NG x KB sums, a broadcast, q's pairs from L1
    int64_t j0 = 0;
    for (; j0 + KB <= nk; j0 += KB) {
        vf16 a[NG][KB] = {};
        for (int d = 0; d < DC; d += 2)
            for (int j = 0; j < KB; ++j) {
                const vi16 k = broadcast_pair(krow[j0 + j] + d);
                for (int g = 0; g < NG; ++g) a[g][j] = dot_pairs(a[g][j], k, qp[g][d / 2]);
            }
        for (int g = 0; g < NG; ++g)
            for (int j = 0; j < KB; ++j) s[g][j0 + j] = a[g][j] * scale;
    }
    for (; j0 < nk; ++j0) {
        vf16 a[NG] = {};
        for (int d = 0; d < DC; d += 2) {
            const vi16 k = broadcast_pair(krow[j0] + d);
            for (int g = 0; g < NG; ++g) a[g] = dot_pairs(a[g], k, qp[g][d / 2]);
        }
        for (int g = 0; g < NG; ++g) s[g][j0] = a[g] * scale;
    }
}

// The same for a group count known only at run time (1 .. MAX_ROWS / 16).
template <int DC>
inline void key_major_scores_bf16(const uint16_t* const* krow, int64_t nk, const vi16 (*qp)[DC / 2], int64_t groups,
                                  float scale, vf16 (*s)[KEY_TILE]) {
    static_assert(MAX_ROWS / 16 == 8, "a case per group count");
    switch (groups) {
        case 1: return key_major_scores_bf16<DC, 1>(krow, nk, qp, scale, s);
        case 2: return key_major_scores_bf16<DC, 2>(krow, nk, qp, scale, s);
        case 3: return key_major_scores_bf16<DC, 3>(krow, nk, qp, scale, s);
        case 4: return key_major_scores_bf16<DC, 4>(krow, nk, qp, scale, s);
        case 5: return key_major_scores_bf16<DC, 5>(krow, nk, qp, scale, s);
        case 6: return key_major_scores_bf16<DC, 6>(krow, nk, qp, scale, s);
        case 7: return key_major_scores_bf16<DC, 7>(krow, nk, qp, scale, s);
        default: return key_major_scores_bf16<DC, 8>(krow, nk, qp, scale, s);
    }
}

// vp[jj][c] lane i holds V[2jj][16c + i] and V[2jj + 1][16c + i] (a bf16 pair, as vdpbf16ps takes it): the V
// rows of a key tile interleaved a pair of keys at a time, one vpermt2w per 16 dims. Rows from nv on are zeros.
template <int DC>
inline void interleave_pairs(const uint16_t* const* vrow, int64_t nv, vi16 (*vp)[DC / 16]) {
    constexpr int C = DC / 16;
    const int64_t np = (nv + 1) / 2;
    alignas(64) static const uint16_t zero_row[DC] = {};
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                        39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int64_t jj = 0; jj < np; ++jj) {
        const uint16_t* a = vrow[2 * jj];
        const uint16_t* b = 2 * jj + 1 < nv ? vrow[2 * jj + 1] : zero_row;
        for (int c = 0; c < C; c += 2) {
            const __m512i x = _mm512_loadu_si512(a + 16 * c), y = _mm512_loadu_si512(b + 16 * c);
            vp[jj][c] = (vi16)_mm512_permutex2var_epi16(x, lo, y);
            vp[jj][c + 1] = (vi16)_mm512_permutex2var_epi16(x, hi, y);
        }
    }
}

// e's 16 lanes rounded to bf16 (nearest even) and stored as 8 pairs: dst[jj] holds lanes 2jj, 2jj + 1.
inline void store_pairs_bf16(int32_t* dst, vf16 e) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh((__m512)e));
}

// e0's and e1's lanes rounded to bf16 (nearest even) and interleaved: dst[i] holds lane i of e0, then of e1
// (the probabilities of two keys for 16 rows, as P.V's pairs take them).
inline void store_pair_lanes_bf16(int32_t* dst, vf16 e0, vf16 e1) {
    const __m512i x = (__m512i)_mm512_cvtne2ps_pbh((__m512)e1, (__m512)e0);  // e0's 16 words, then e1's
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                         23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    _mm512_storeu_si512(dst, _mm512_permutexvar_epi16(idx, x));
}

// R rows of acc (scaled by alpha first, unless null) += their probabilities of a key tile's 8 pairs times the
// tile's V pairs (vp): row i's pair jj is pp[i * row_step + jj * pair_step]. The rows' sums stay in
// registers over the tile, R x DC / 16 independent chains.
template <int DC, int R>
inline void pair_rows(float (*acc)[DC], const int32_t* pp, int64_t row_step, int64_t pair_step,
                      const vi16 (*vp)[DC / 16], const float* alpha = nullptr) {
    constexpr int C = DC / 16;
    vf16 av[R][C];
    for (int i = 0; i < R; ++i)
        for (int c = 0; c < C; ++c) av[i][c] = alpha ? load16(acc[i] + 16 * c) * alpha[i] : load16(acc[i] + 16 * c);
    for (int jj = 0; jj < KEY_TILE / 2; ++jj)
        for (int i = 0; i < R; ++i) {
            const vi16 w = (vi16)_mm512_set1_epi32(pp[i * row_step + jj * pair_step]);
            for (int c = 0; c < C; ++c) av[i][c] = dot_pairs(av[i][c], w, vp[jj][c]);
        }
    for (int i = 0; i < R; ++i)
        for (int c = 0; c < C; ++c) store16(acc[i] + 16 * c, av[i][c]);
}

// acc[r] += sum over a whole key tile of p(r, j) v_j for r < rows, the probabilities already bf16 pairs
// (pp[r * pp_row + jj]: keys 2jj, 2jj + 1; zeros past the keys) and vrow[0..16) every key's V row (a row of
// zeros past the keys): the decode's P.V, trip counts known at compile time.
template <int DC>
inline void pairs_accumulate_bf16(float (*acc)[DC], const int32_t* pp, int64_t pp_row,
                                  const uint16_t* const* vrow, int64_t rows) {
    constexpr int RB = DC / 16 <= 4 ? 4 : 2;
    vi16 vp[KEY_TILE / 2][DC / 16];
    interleave_pairs<DC>(vrow, KEY_TILE, vp);
    int64_t r = 0;
    for (; r + RB <= rows; r += RB) pair_rows<DC, RB>(acc + r, pp + r * pp_row, pp_row, 1, vp);
    if (rows - r == 3) pair_rows<DC, 3>(acc + r, pp + r * pp_row, pp_row, 1, vp);
    if (rows - r == 2) pair_rows<DC, 2>(acc + r, pp + r * pp_row, pp_row, 1, vp);
    if (rows - r == 1) pair_rows<DC, 1>(acc + r, pp + r * pp_row, pp_row, 1, vp);
}

#else
constexpr bool BF16_DOT = false;

template <int DC>
inline void row_scores_bf16(const uint16_t*, const uint16_t* const*, int64_t, float, float*) {}
inline void store_pairs_bf16(int32_t*, vf16) {}
template <int DC>
inline void pairs_accumulate_bf16(float (*)[DC], const int32_t*, int64_t, const uint16_t* const*, int64_t) {}
#endif

}  // namespace mixserve
