// Few-row products of the 32-element block formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) and of Q4_K / Q6_K (the
// two a Q4_K_M file is mostly made of) and Q5_K in float32, each block decoded in registers and multiplied there: no
// decoded copy goes through memory. The products are those of
// dequantize-then-matmul (float32 rounding aside), so a decode step's logits equal a whole prefill's.
#pragma once
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include <type_traits>

#include "few_row_simd.h"
#include "quant_dot.h"

#if defined(MIXSERVE_QUANT_DOT) && defined(MIXSERVE_FEW_ROW_SIMD)
#define MIXSERVE_QUANT_FUSED 1

namespace mixserve {

// A block's quants as two vectors of 16 bytes (elements 0-15, 16-31), unsigned or (Q8_0) signed, and the
// affine that makes weights of them: w = d q + m.
struct Block32 {
    __m128i lo, hi;
    float d, m;
};

template <int TYPE>
inline Block32 block32(const uint8_t* b) {
    if constexpr (TYPE == INT8_ROW) {  // 32 of a row's int8 values; the row's scale is applied to its sums
        return {load16(b), load16(b + 16), 1.f, 0.f};
    } else if constexpr (TYPE == Q8_0) {
        return {load16(b + 2), load16(b + 18), half_to_float(read_half(b)), 0.f};
    } else {
        const float d = half_to_float(read_half(b));
        const float m = TYPE == Q4_0 ? -8 * d : TYPE == Q5_0 ? -16 * d : half_to_float(read_half(b + 2));
        constexpr int nib = TYPE == Q4_0 ? 2 : TYPE == Q4_1 ? 4 : TYPE == Q5_0 ? 6 : 8;
        const __m128i q = load16(b + nib);
        __m128i lo = low_nibbles(q), hi = high_nibbles(q);
        if constexpr (TYPE == Q5_0 || TYPE == Q5_1) {
            const __m256i fifth = fifth_bits_u8(b + (TYPE == Q5_0 ? 2 : 4));
            lo = _mm_or_si128(lo, _mm256_castsi256_si128(fifth));
            hi = _mm_or_si128(hi, _mm256_extracti128_si256(fifth, 1));
        }
        return {lo, hi, d, m};
    }
}

constexpr int V16 = 16 / LANES;  // vectors a run of 16 floats takes
constexpr int block_elems_of(int type) { return type == Q4_K || type == Q5_K || type == Q6_K ? 256 : 32; }

// 16 quants -> 16 weights d q + m, as V16 vectors
template <bool SIGNED>
inline void weights16(__m128i q, Vf d, Vf m, Vf* w) {
#if defined(__AVX512F__)
    const __m512i i = SIGNED ? _mm512_cvtepi8_epi32(q) : _mm512_cvtepu8_epi32(q);
    w[0] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(i), m);
#else
    const __m128i up = _mm_srli_si128(q, 8);
    const __m256i a = SIGNED ? _mm256_cvtepi8_epi32(q) : _mm256_cvtepu8_epi32(q);
    const __m256i b = SIGNED ? _mm256_cvtepi8_epi32(up) : _mm256_cvtepu8_epi32(up);
    w[0] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(a), m);
    w[1] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(b), m);
#endif
}

// A 32-element block's weights d q + m as V16 vectors each of elements 0-15 (lo) and 16-31 (hi). On AVX-512
// the 4- and 5-bit formats widen their 16 quant bytes once and take both nibbles from them (element j low,
// j + 16 high), Q5's fifth bits OR-ed in under lane masks: fewer instructions than two byte-wise halves.
template <int TYPE>
inline void block_weights(const uint8_t* b, Vf* lo, Vf* hi) {
#if defined(__AVX512F__)
    if constexpr (TYPE == Q4_0 || TYPE == Q4_1 || TYPE == Q5_0 || TYPE == Q5_1) {
        constexpr int QS = TYPE == Q4_0 ? 2 : TYPE == Q4_1 ? 4 : TYPE == Q5_0 ? 6 : 8;  // where the quants start
        const float d = half_to_float(read_half(b));
        const float m = TYPE == Q4_0 ? -8 * d : TYPE == Q5_0 ? -16 * d : half_to_float(read_half(b + 2));
        const __m512i q = _mm512_cvtepu8_epi32(load16(b + QS));
        __m512i qlo = _mm512_and_si512(q, _mm512_set1_epi32(0x0f)), qhi = _mm512_srli_epi32(q, 4);
        if constexpr (TYPE == Q5_0 || TYPE == Q5_1) {
            uint32_t bits;  // bit j: element j's fifth bit
            memcpy(&bits, b + QS - 4, sizeof bits);
            const __m512i fifth = _mm512_set1_epi32(16);
            qlo = _mm512_mask_or_epi32(qlo, static_cast<__mmask16>(bits), qlo, fifth);
            qhi = _mm512_mask_or_epi32(qhi, static_cast<__mmask16>(bits >> 16), qhi, fifth);
        }
        const Vf dv = vbroadcast(d), mv = vbroadcast(m);
        lo[0] = _mm512_fmadd_ps(dv, _mm512_cvtepi32_ps(qlo), mv);
        hi[0] = _mm512_fmadd_ps(dv, _mm512_cvtepi32_ps(qhi), mv);
        return;
    }
#endif
    constexpr bool SIGNED = TYPE == Q8_0 || TYPE == INT8_ROW;
    const Block32 q = block32<TYPE>(b);
    const Vf d = vbroadcast(q.d), m = vbroadcast(q.m);
    weights16<SIGNED>(q.lo, d, m, lo);
    weights16<SIGNED>(q.hi, d, m, hi);
}

#if defined(__AVX512F__)
constexpr int FUSED_ROWS = 8;  // sums: 2 columns x 8 rows in 32 registers (a block decoded once for 8 rows)
inline float fused_hsum(Vf v) { return _mm512_reduce_add_ps(v); }
#else
constexpr int FUSED_ROWS = 2;  // in AVX2's 16 registers
inline float fused_hsum(Vf v) { return hsum8(v); }
#endif

// sums[c][r] = dot(w row c, x row r) over nb blocks, for 2 weight rows (cols of them real) and ROWS inputs.
template <int TYPE, int ROWS>
void fused_pass(const uint8_t* w, int64_t row_bytes, int cols, const float* x, int64_t ldx, int64_t nb,
                float (*sums)[8]) {
    constexpr int COLS2 = 2;
    // Few rows sum a block's two halves apart: twice the chains of FMAs in flight; 8 rows have chains enough
    constexpr int H = ROWS > 4 ? 1 : 2;
    Vf acc[COLS2][ROWS][H];
    for (int c = 0; c < COLS2; ++c)
        for (int r = 0; r < ROWS; ++r)
            for (int h = 0; h < H; ++h) acc[c][r][h] = vzero();
    walk_blocks<COLS2>(w, row_bytes, cols, nb, TYPE == INT8_ROW ? 32 : block_bytes(TYPE),
                       [&](int c, int64_t b, const uint8_t* blk) {
        Vf lo[V16], hi[V16];
        block_weights<TYPE>(blk, lo, hi);
        for (int r = 0; r < ROWS; ++r) {
            const float* xr = x + r * ldx + 32 * b;
            for (int v = 0; v < V16; ++v) {
                acc[c][r][0] = vfmadd(lo[v], vload(xr + LANES * v), acc[c][r][0]);
                acc[c][r][H - 1] = vfmadd(hi[v], vload(xr + 16 + LANES * v), acc[c][r][H - 1]);
            }
        }
    });
    for (int c = 0; c < cols; ++c)
        for (int r = 0; r < ROWS; ++r) sums[c][r] = fused_hsum(H == 2 ? vadd(acc[c][r][0], acc[c][r][H - 1])
                                                                       : acc[c][r][0]);
}

// acc[r][h] += w[0..NV) . x row r's NV * LANES elements from `x`, for ROWS rows
template <int ROWS, int H, int NV>
inline void fma_span(const Vf* w, const float* x, int64_t ldx, int h, Vf (*acc)[H]) {
    for (int r = 0; r < ROWS; ++r)
        for (int v = 0; v < NV; ++v) acc[r][h] = vfmadd(w[v], vload(x + r * ldx + LANES * v), acc[r][h]);
}

// One Q4_K super-block (256 elements, quant_blocks.h's decode_q4_k) against x's rows from `x`: each pair of
// sub-blocks shares 32 bytes, the low nibbles the first one's 32 weights, the high nibbles the second's.
// FIFTH: a Q5_K super-block (decode_q5_k), 32 bytes of fifth bits before the nibbles, bit j for sub-block j.
template <int ROWS, int H, bool FIFTH>
inline void q4_k_block(const uint8_t* blk, const float* x, int64_t ldx, Vf (*acc)[H]) {
    const float d = half_to_float(read_half(blk)), dmin = half_to_float(read_half(blk + 2));
    const uint8_t *qh = blk + 16, *q = blk + (FIFTH ? 48 : 16);
    for (int j = 0; j < 8; j += 2, q += 32) {
        int sc0, mn0, sc1, mn1;
        scale_min_k4(j, blk + 4, &sc0, &mn0);
        scale_min_k4(j + 1, blk + 4, &sc1, &mn1);
        const Vf d0 = vbroadcast(d * sc0), m0 = vbroadcast(-dmin * mn0);
        const Vf d1 = vbroadcast(d * sc1), m1 = vbroadcast(-dmin * mn1);
        const __m128i a = load16(q), b = load16(q + 16);
        __m128i la = low_nibbles(a), lb = low_nibbles(b), ha = high_nibbles(a), hb = high_nibbles(b);
        if constexpr (FIFTH) {
            const __m128i ca = load16(qh), cb = load16(qh + 16);
            la = _mm_or_si128(la, high_bits(ca, j, 1)), lb = _mm_or_si128(lb, high_bits(cb, j, 1));
            ha = _mm_or_si128(ha, high_bits(ca, j + 1, 1)), hb = _mm_or_si128(hb, high_bits(cb, j + 1, 1));
        }
        Vf w0[2 * V16], w1[2 * V16];
        weights16<false>(la, d0, m0, w0);
        weights16<false>(lb, d0, m0, w0 + V16);
        weights16<false>(ha, d1, m1, w1);
        weights16<false>(hb, d1, m1, w1 + V16);
        fma_span<ROWS, H, 2 * V16>(w0, x + 32 * j, ldx, 0, acc);
        fma_span<ROWS, H, 2 * V16>(w1, x + 32 * j + 32, ldx, H - 1, acc);
    }
}

// One Q6_K super-block (quant_blocks.h's decode_q6_k): 16 weights a (half, h, part), scale d sc, offset -32.
template <int ROWS, int H>
inline void q6_k_block(const uint8_t* blk, const float* x, int64_t ldx, Vf (*acc)[H]) {
    q6_k_sixteens(blk, [&](int at, __m128i q, float s) {
        Vf w[V16];
        weights16<true>(_mm_sub_epi8(q, _mm_set1_epi8(32)), vbroadcast(s), vzero(), w);  // s (q - 32): one broadcast
        fma_span<ROWS, H, V16>(w, x + at, ldx, (at / 32) & (H - 1), acc);  // quarters alternate sums
    });
}

// sums[c][r] as fused_pass, for the 256-element K formats
template <int TYPE, int ROWS>
void fused_pass_k(const uint8_t* w, int64_t row_bytes, int cols, const float* x, int64_t ldx, int64_t nb,
                  float (*sums)[8]) {
    constexpr int COLS2 = 2, H = ROWS > 4 ? 1 : 2;
    Vf acc[COLS2][ROWS][H];
    for (int c = 0; c < COLS2; ++c)
        for (int r = 0; r < ROWS; ++r)
            for (int h = 0; h < H; ++h) acc[c][r][h] = vzero();
    walk_blocks<COLS2>(w, row_bytes, cols, nb, block_bytes(TYPE), [&](int c, int64_t b, const uint8_t* blk) {
        if constexpr (TYPE == Q6_K) q6_k_block<ROWS, H>(blk, x + 256 * b, ldx, acc[c]);
        else q4_k_block<ROWS, H, TYPE == Q5_K>(blk, x + 256 * b, ldx, acc[c]);
    });
    for (int c = 0; c < cols; ++c)
        for (int r = 0; r < ROWS; ++r) sums[c][r] = fused_hsum(H == 2 ? vadd(acc[c][r][0], acc[c][r][H - 1])
                                                                       : acc[c][r][0]);
}

template <int TYPE, int ROWS>
void fused_pass_of(const uint8_t* w, int64_t row_bytes, int cols, const float* x, int64_t ldx, int64_t nb,
                   float (*sums)[8]) {
    if constexpr (block_elems_of(TYPE) == 256) fused_pass_k<TYPE, ROWS>(w, row_bytes, cols, x, ldx, nb, sums);
    else fused_pass<TYPE, ROWS>(w, row_bytes, cols, x, ldx, nb, sums);
}

// f(std::integral_constant<int, R>{}) with R = rows as a compile-time count (1..MAX; more rows: MAX), for the
// passes whose sums live in registers
template <int MAX, typename F>
inline void with_rows(int rows, F&& f) {
    if constexpr (MAX > 1)
        if (rows < MAX) return with_rows<MAX - 1>(rows, f);
    f(std::integral_constant<int, MAX>{});
}

// The pass for `rows` input rows (at most FUSED_ROWS) of a format known at run time
template <int TYPE>
void fused_rows_of(int rows, const uint8_t* w, int64_t row_bytes, int cols, const float* x, int64_t ldx,
                   int64_t nb, float (*sums)[8]) {
    with_rows<FUSED_ROWS>(rows, [&](auto r) {
        fused_pass_of<TYPE, decltype(r)::value>(w, row_bytes, cols, x, ldx, nb, sums);
    });
}

inline void fused_rows(int type, int rows, const uint8_t* w, int64_t row_bytes, int cols, const float* x, int64_t ldx,
                int64_t nb, float (*sums)[8]) {
    switch (type) {
        case Q4_0: return fused_rows_of<Q4_0>(rows, w, row_bytes, cols, x, ldx, nb, sums);
        case Q4_1: return fused_rows_of<Q4_1>(rows, w, row_bytes, cols, x, ldx, nb, sums);
        case Q5_0: return fused_rows_of<Q5_0>(rows, w, row_bytes, cols, x, ldx, nb, sums);
        case Q5_1: return fused_rows_of<Q5_1>(rows, w, row_bytes, cols, x, ldx, nb, sums);
        case Q4_K: return fused_rows_of<Q4_K>(rows, w, row_bytes, cols, x, ldx, nb, sums);
        case Q5_K: return fused_rows_of<Q5_K>(rows, w, row_bytes, cols, x, ldx, nb, sums);
        case Q6_K: return fused_rows_of<Q6_K>(rows, w, row_bytes, cols, x, ldx, nb, sums);
        case INT8_ROW: return fused_rows_of<INT8_ROW>(rows, w, row_bytes, cols, x, ldx, nb, sums);
        default: return fused_rows_of<Q8_0>(rows, w, row_bytes, cols, x, ldx, nb, sums);
    }
}

}  // namespace mixserve

#endif
