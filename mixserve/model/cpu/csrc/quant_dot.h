// Few-row products of the 32-element formats, of the K-quants' sub-blocks of 32 (Q6_K's with a scale for each
// 16) and of int8 per channel (its rows in runs of 32, the row's scale applied to the sums by the caller) as
// integer dots, as llama.cpp
// computes them: each input row is quantized once per call to int8 in blocks of 32 (a scale per block), and
// a weight block's 32 quants meet the input block's 32 in one u8 x s8 dot (AVX512-VNNI's vpdpbusd on 256 bits,
// else AVX2's vpmaddubsw + vpmaddwd): 32 products an instruction or two, where float32 needs 4-8 FMAs plus the
// conversions. The float sums then take each block's two scales. The input's rounding to int8 is the cost
// in accuracy: docs/decisions/quantized-weights-in-place.md measures it against the float path.
#pragma once
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "quant_blocks.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define MIXSERVE_QUANT_DOT 1

namespace mixserve {

// An input row in blocks of 32: q (int8), d (its scale: x ~ d q) and s = d * sum(q), which Q4_1's minimum and
// Q4_0's offset of 8 multiply.
struct RowQ8 {
    const int8_t* q;
    const float* d;
    const float* s;
};

// sums, half_sums (optional): the blocks' integer sums of q, and of each 16 (two a block), which the int8
// panels' offsets (Q4_0's 8, Q8_0's 128, Q6_K's 32 a scale of 16) take
inline void quantize_row_q8(const float* x, int64_t k, int8_t* q, float* d, float* s, int32_t* sums = nullptr,
                            int32_t* half_sums = nullptr) {
    for (int64_t b = 0; b < k / 32; ++b, x += 32, q += 32) {
        __m256 v[4], amax = _mm256_setzero_ps();
        const __m256 sign = _mm256_set1_ps(-0.0f);
        for (int i = 0; i < 4; ++i) {
            v[i] = _mm256_loadu_ps(x + 8 * i);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
        }
        __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        m = _mm_max_ss(m, _mm_movehdup_ps(m));
        const float a = _mm_cvtss_f32(m);
        d[b] = a / 127.f;
        const __m256 inv = _mm256_set1_ps(a > 0 ? 127.f / a : 0.f);
        __m256i i32[4];
        for (int i = 0; i < 4; ++i)  // round to nearest (the default rounding mode), |q| <= 127
            i32[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
        // pack 32 int32 -> 32 int8 in order: packs interleave the 128-bit lanes, the permute undoes it
        const __m256i i16a = _mm256_packs_epi32(i32[0], i32[1]), i16b = _mm256_packs_epi32(i32[2], i32[3]);
        const __m256i i8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(i16a, i16b),
                                                        _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), i8);
        const __m256i sum16 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), i8),
                                                _mm256_set1_epi16(1));
        const __m128i lo = _mm256_castsi256_si128(sum16), hi = _mm256_extracti128_si256(sum16, 1);
        __m128i t = _mm_add_epi32(lo, hi);
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
        const int32_t sum = _mm_cvtsi128_si32(t);
        if (half_sums) {  // lanes 0-3 hold the first 16 values' sums, 4-7 the last 16's
            const __m128i pair = _mm_hadd_epi32(_mm_hadd_epi32(lo, hi), _mm_setzero_si128());
            half_sums[2 * b] = _mm_cvtsi128_si32(pair);
            half_sums[2 * b + 1] = _mm_extract_epi32(pair, 1);
        }
        s[b] = d[b] * static_cast<float>(sum);
        if (sums) sums[b] = sum;
    }
}

// The 32 products u (unsigned bytes) x v (signed), summed in fours: 8 int32.
inline __m256i dot_u8s8(__m256i u, __m256i v) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, v);
#else  // no pair exceeds int16: |u| <= 128 (Q8_0's magnitudes), |v| <= 127
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, v), _mm256_set1_epi16(1));
#endif
}

inline __m256i nibbles_u8(const uint8_t* p) {  // 16 bytes -> 32 quants: low nibbles then high nibbles
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i mask = _mm_set1_epi8(0x0f);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), mask), _mm_and_si128(b, mask));
}

// 32 bits -> 32 bytes, 16 where the bit is set (the fifth bits of Q5_0 / Q5_1), as llama.cpp expands them.
inline __m256i fifth_bits_u8(const uint8_t* p) {
    uint32_t bits;
    memcpy(&bits, p, sizeof bits);
    const __m256i spread = _mm256_shuffle_epi8(  // byte j <- byte j / 8 of the bits
        _mm256_set1_epi32(static_cast<int>(bits)),
        _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
    const __m256i set = _mm256_cmpeq_epi8(_mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)),
                                          _mm256_set1_epi64x(-1));
    return _mm256_and_si256(set, _mm256_set1_epi8(16));
}

// A weight block as the dot takes it: its quants as unsigned bytes (Q8_0: their magnitudes, `sign` the
// quants whose signs the input takes on), its scale, and the term the input block's s multiplies; Q6_K's
// scale is the first 16 values' and scale_hi the last 16's.
struct WeightBlock {
    __m256i u, sign;
    float scale, min;
    bool signed_q;
    float scale_hi = 0.f;
};

template <int TYPE>
inline WeightBlock weight_block(const uint8_t* w) {
    if constexpr (TYPE == Q4_0) {
        const float d = half_to_float(read_half(w));
        return {nibbles_u8(w + 2), __m256i{}, d, -8.f * d, false};  // d (q - 8): 8 d times the input's sum
    } else if constexpr (TYPE == Q4_1) {
        return {nibbles_u8(w + 4), __m256i{}, half_to_float(read_half(w)), half_to_float(read_half(w + 2)),
                false};
    } else if constexpr (TYPE == Q5_0) {
        const float d = half_to_float(read_half(w));
        return {_mm256_or_si256(nibbles_u8(w + 6), fifth_bits_u8(w + 2)), __m256i{}, d, -16.f * d, false};
    } else if constexpr (TYPE == Q5_1) {
        return {_mm256_or_si256(nibbles_u8(w + 8), fifth_bits_u8(w + 4)), __m256i{}, half_to_float(read_half(w)),
                half_to_float(read_half(w + 2)), false};
    } else if constexpr (TYPE == Q8_0) {  // signed x signed as |w| x (x with w's sign)
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 2));
        return {_mm256_sign_epi8(q, q), q, half_to_float(read_half(w)), 0.f, true};
    } else {  // INT8_ROW: 32 of a row's int8 values, as Q8_0's quants with a scale of 1
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
        return {_mm256_sign_epi8(q, q), q, 1.f, 0.f, true};
    }
}

// Formats whose quants are signed bytes: the dot takes |q| and moves q's signs onto the input.
template <int TYPE>
constexpr bool signed_quants() { return TYPE == Q8_0 || TYPE == INT8_ROW || TYPE == Q6_K; }

// Bytes of one unit of blocks the dots walk: a block of the format, or 32 values of an int8 row.
template <int TYPE>
inline int64_t unit_bytes() { return TYPE == INT8_ROW ? 32 : block_bytes(TYPE); }

// Sub-block j (0..7: half j / 4, quarter j % 4) of a Q6_K super-block: w = d sc (q - 32) (quant_blocks.h's
// q6_k_sixteens), the signed q - 32 as Q8_0's quants, a scale for each 16.
inline WeightBlock q6_k_sub_block(const uint8_t* s, int j) {
    const int half = j / 4, part = j % 4;
    const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 64 * half + 32 * (part & 1)));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 128 + 32 * half));
    const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(ql, 4 * (part >> 1)), _mm256_set1_epi8(0x0f));
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * part), _mm256_set1_epi8(3));
    const __m256i v = _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), _mm256_set1_epi8(32));
    const int8_t* sc = reinterpret_cast<const int8_t*>(s + 192) + 8 * half + 2 * part;
    const float d = half_to_float(read_half(s + 208));
    return {_mm256_abs_epi8(v), v, d * sc[0], 0.f, true, d * sc[1]};
}

// Sub-block j (0..7, 32 elements) of a Q4_K / Q5_K super-block as the dot takes it: w = d sc q - dmin mn
// (quant_blocks.h's decode_q4_k / decode_q5_k), a scale and a minimum as a Q4_1 block has; Q6_K's above.
template <int TYPE>
inline WeightBlock k_sub_block(const uint8_t* s, int j) {
    if constexpr (TYPE == Q6_K) return q6_k_sub_block(s, j);
    int sc, mn;
    scale_min_k4(j, s + 4, &sc, &mn);
    const uint8_t* q = s + (TYPE == Q4_K ? 16 : 48) + 32 * (j / 2);  // 32 bytes hold sub-blocks 2i, 2i + 1
    __m256i u = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)),
                                                   4 * (j & 1)), _mm256_set1_epi8(0x0f));
    if constexpr (TYPE == Q5_K) {  // bit j of qh[l] tops element l with 16
        const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 16));
        const __m256i bit = _mm256_and_si256(_mm256_srli_epi16(qh, j), _mm256_set1_epi8(1));
        u = _mm256_or_si256(u, _mm256_slli_epi16(bit, 4));
    }
    const float d = half_to_float(read_half(s)), dmin = half_to_float(read_half(s + 2));
    return {u, __m256i{}, d * sc, -dmin * mn, false};
}

template <int TYPE>
constexpr bool k_quant() { return TYPE == Q4_K || TYPE == Q5_K || TYPE == Q6_K; }

// Block b (32 elements) of a weight row: a 32-element format's block, or a K-quant's sub-block.
template <int TYPE>
inline WeightBlock block_at(const uint8_t* row, int64_t b) {
    if constexpr (k_quant<TYPE>()) return k_sub_block<TYPE>(row + b / 8 * block_bytes(TYPE), static_cast<int>(b % 8));
    else return weight_block<TYPE>(row + b * unit_bytes<TYPE>());
}

template <int TYPE>
inline __m256i block_dot(const WeightBlock& wb, const int8_t* xq) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
    if constexpr (signed_quants<TYPE>()) return dot_u8s8(wb.u, _mm256_sign_epi8(x, wb.sign));
    return dot_u8s8(wb.u, x);
}

inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// sums[c][r] for COLS weight rows (w + c * row_bytes) and ROWS quantized input rows, over nb blocks.
#ifndef PREFETCH_ROWS_OVERRIDE
constexpr int PREFETCH_ROWS = 8;
#else
constexpr int PREFETCH_ROWS = PREFETCH_ROWS_OVERRIDE;
#endif

// visit(c, b, block) for every block b of the first `cols` (<= COLS) weight rows from w, b outermost, with
// the rows PREFETCH_ROWS ahead asked for: one stream a thread does not keep the memory busy on its own. Every
// line of a block is asked for: a K-quant block spans 3-4 (one prefetch a block left Q6_K waiting on memory).
template <int COLS, typename Visit>
inline void walk_blocks(const uint8_t* w, int64_t row_bytes, int cols, int64_t nb, int64_t bb, Visit&& visit) {
    for (int64_t b = 0; b < nb; ++b)
        for (int c = 0; c < COLS && c < cols; ++c) {
            const uint8_t* blk = w + c * row_bytes + b * bb;
            for (int64_t off = 0; off < bb; off += 64)
                _mm_prefetch(reinterpret_cast<const char*>(blk + PREFETCH_ROWS * row_bytes + off), _MM_HINT_T0);
            visit(c, b, blk);
        }
}

template <int TYPE, int COLS, int ROWS>
void dot_q8_pass(const uint8_t* w, int64_t row_bytes, int cols, const RowQ8* x, int64_t nb, float (*sums)[8]) {
    __m256 acc[COLS][ROWS];
    float mins[COLS][ROWS] = {};
    for (int c = 0; c < COLS; ++c)
        for (int r = 0; r < ROWS; ++r) acc[c][r] = _mm256_setzero_ps();
    constexpr int SUBS = k_quant<TYPE>() ? 8 : 1;  // blocks of 32 a block of the format holds
    walk_blocks<COLS>(w, row_bytes, cols, nb / SUBS, unit_bytes<TYPE>(), [&](int c, int64_t b, const uint8_t* blk) {
        __m256 q6_scales[2];  // Q6_K: d times the 16 scales, a half's 8 a vector, once a block
        if constexpr (TYPE == Q6_K)
            for (int h = 0; h < 2; ++h)
                q6_scales[h] = _mm256_mul_ps(_mm256_set1_ps(half_to_float(read_half(blk + 208))), _mm256_cvtepi32_ps(
                    _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 192 + 8 * h)))));
        for (int j = 0; j < SUBS; ++j) {
            WeightBlock wb;
            if constexpr (k_quant<TYPE>()) wb = k_sub_block<TYPE>(blk, j);
            else wb = weight_block<TYPE>(blk);
            const int64_t xb = b * SUBS + j;
            __m256 lane_scales;  // Q6_K: the dot's lanes 0-3 sum the first 16 values (scale 2j), 4-7 the last 16
            if constexpr (TYPE == Q6_K)
                lane_scales = _mm256_permutevar8x32_ps(q6_scales[j / 4], _mm256_add_epi32(
                    _mm256_set1_epi32(2 * (j % 4)), _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1)));
            for (int r = 0; r < ROWS; ++r) {
                const __m256 dot = _mm256_cvtepi32_ps(block_dot<TYPE>(wb, x[r].q + 32 * xb));
                const __m256 sv = TYPE == Q6_K ? _mm256_mul_ps(lane_scales, _mm256_set1_ps(x[r].d[xb]))
                                               : _mm256_set1_ps(wb.scale * x[r].d[xb]);
                acc[c][r] = _mm256_fmadd_ps(dot, sv, acc[c][r]);
                mins[c][r] += wb.min * x[r].s[xb];
            }
        }
    });
    for (int c = 0; c < cols; ++c)
        for (int r = 0; r < ROWS; ++r) sums[c][r] = hsum8(acc[c][r]) + mins[c][r];
}

// The pass for `rows` quantized input rows (at most 4) of a format known at run time
template <int TYPE, int COLS2>
void q8_rows_of(int rows, const uint8_t* w, int64_t row_bytes, int cols, const RowQ8* x, int64_t nb,
                float (*sums)[8]) {
    switch (rows) {
        case 1: return dot_q8_pass<TYPE, COLS2, 1>(w, row_bytes, cols, x, nb, sums);
        case 2: return dot_q8_pass<TYPE, COLS2, 2>(w, row_bytes, cols, x, nb, sums);
        case 3: return dot_q8_pass<TYPE, COLS2, 3>(w, row_bytes, cols, x, nb, sums);
        default: return dot_q8_pass<TYPE, COLS2, 4>(w, row_bytes, cols, x, nb, sums);
    }
}

template <int COLS2>
void q8_rows(int rows, int type, const uint8_t* w, int64_t row_bytes, int cols, const RowQ8* x,
             int64_t nb, float (*sums)[8]) {
    switch (type) {
        case Q4_0: return q8_rows_of<Q4_0, COLS2>(rows, w, row_bytes, cols, x, nb, sums);
        case Q4_1: return q8_rows_of<Q4_1, COLS2>(rows, w, row_bytes, cols, x, nb, sums);
        case Q5_0: return q8_rows_of<Q5_0, COLS2>(rows, w, row_bytes, cols, x, nb, sums);
        case Q5_1: return q8_rows_of<Q5_1, COLS2>(rows, w, row_bytes, cols, x, nb, sums);
        case Q4_K: return q8_rows_of<Q4_K, COLS2>(rows, w, row_bytes, cols, x, nb, sums);
        case Q5_K: return q8_rows_of<Q5_K, COLS2>(rows, w, row_bytes, cols, x, nb, sums);
        case Q6_K: return q8_rows_of<Q6_K, COLS2>(rows, w, row_bytes, cols, x, nb, sums);
        case INT8_ROW: return q8_rows_of<INT8_ROW, COLS2>(rows, w, row_bytes, cols, x, nb, sums);
        default: return q8_rows_of<Q8_0, COLS2>(rows, w, row_bytes, cols, x, nb, sums);
    }
}

}  // namespace mixserve

#endif  // AVX2 + FMA + F16C
