// The GGUF block formats the quantized linears read in place, each as one function that decodes a row's
// blocks into float32: w = scale * q (+ min), as ggml defines them (ggml-common.h, ggml-quants.c). The loops
// are plain on purpose: the compiler vectorises them, and each reads like the format's definition.
//
// Type codes are ggml's own type ids; INT8_ROW (not a ggml type) is our int8 per output channel, a row of k
// int8 values with its float32 scale beside the tensor.
#pragma once
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

namespace mixserve {

enum QuantType : int {
    Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, INT8_ROW = 100
};

inline float half_to_float(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h);
#else  // IEEE binary16 by hand (subnormals included), where the CPU has no F16C
    const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t bits;
    if (exp == 0x1f) bits = sign | 0x7f800000u | (man << 13);
    else if (exp != 0) bits = sign | ((exp + 112) << 23) | (man << 13);
    else if (man == 0) bits = sign;
    else {
        int e = 113;
        uint32_t m = man;
        while (!(m & 0x400)) m <<= 1, --e;
        bits = sign | (static_cast<uint32_t>(e) << 23) | ((m & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

inline uint16_t read_half(const uint8_t* p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return h;
}

// Elements per block and bytes per block of each format (ggml's GGML_QUANT_SIZES); 0 for an unknown type.
inline int block_elems(int type) {
    switch (type) {
        case Q4_0: case Q4_1: case Q5_0: case Q5_1: case Q8_0: return 32;
        case Q4_K: case Q5_K: case Q6_K: return 256;
        case INT8_ROW: return 1;
        default: return 0;
    }
}
inline int block_bytes(int type) {
    switch (type) {
        case Q4_0: return 18;
        case Q4_1: return 20;
        case Q5_0: return 22;
        case Q5_1: return 24;
        case Q8_0: return 34;
        case Q4_K: return 144;
        case Q5_K: return 176;
        case Q6_K: return 210;
        case INT8_ROW: return 1;
        default: return 0;
    }
}

// 16 values q (bytes, unsigned or signed) -> y[0..16) = d q + m: the one place a block's bytes become floats.
#if defined(__AVX512F__)
inline void affine16(__m128i q, float d, float m, float* y) {
    _mm512_storeu_ps(y, _mm512_fmadd_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q)),
                                        _mm512_set1_ps(m)));
}
inline void affine16_signed(__m128i q, float d, float* y) {
    _mm512_storeu_ps(y, _mm512_mul_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q))));
}
#elif defined(__AVX2__) && defined(__FMA__)
inline void affine16(__m128i q, float d, float m, float* y) {
    const __m256 dv = _mm256_set1_ps(d), mv = _mm256_set1_ps(m);
    _mm256_storeu_ps(y, _mm256_fmadd_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)), mv));
    _mm256_storeu_ps(y + 8, _mm256_fmadd_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(q, 8))),
                                            mv));
}
inline void affine16_signed(__m128i q, float d, float* y) {
    const __m256 dv = _mm256_set1_ps(d);
    _mm256_storeu_ps(y, _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q))));
    _mm256_storeu_ps(y + 8, _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8)))));
}
#else
inline void affine16(__m128i q, float d, float m, float* y) {
    uint8_t b[16];
    _mm_storeu_si128(reinterpret_cast<__m128i*>(b), q);
    for (int j = 0; j < 16; ++j) y[j] = d * b[j] + m;
}
inline void affine16_signed(__m128i q, float d, float* y) {
    int8_t b[16];
    _mm_storeu_si128(reinterpret_cast<__m128i*>(b), q);
    for (int j = 0; j < 16; ++j) y[j] = d * b[j];
}
#endif

inline __m128i load16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline __m128i low_nibbles(__m128i b) { return _mm_and_si128(b, _mm_set1_epi8(0x0f)); }
inline __m128i high_nibbles(__m128i b) { return _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0f)); }
// bits `shift`.. of each byte, `width` of them (2 bits: 3, 1 bit: 1), moved up to bit 4: a 5th or 5th-6th bit
inline __m128i high_bits(__m128i b, int shift, int mask) {
    const __m128i bits = _mm_and_si128(_mm_srl_epi16(b, _mm_cvtsi32_si128(shift)), _mm_set1_epi8(mask));
    return _mm_slli_epi16(bits, 4);  // each byte's value <= 3 << 4: nothing crosses into the next byte
}

// Q4_0: d (f16), 16 bytes of nibbles: element j low nibble of byte j, element j + 16 its high one; w = d(q - 8)
inline void decode_q4_0(const uint8_t* b, float* y) {
    const float d = half_to_float(read_half(b));
    const __m128i q = load16(b + 2);
    affine16(low_nibbles(q), d, -8 * d, y);
    affine16(high_nibbles(q), d, -8 * d, y + 16);
}

// Q4_1: d and m (f16), nibbles as Q4_0; w = d q + m
inline void decode_q4_1(const uint8_t* b, float* y) {
    const float d = half_to_float(read_half(b)), m = half_to_float(read_half(b + 2));
    const __m128i q = load16(b + 4);
    affine16(low_nibbles(q), d, m, y);
    affine16(high_nibbles(q), d, m, y + 16);
}

// The fifth bits of a Q5_0 / Q5_1 block (32 bits, bit j for element j) as bytes of 0 or 16.
inline void fifth_bits(const uint8_t* p, uint8_t* out) {
    uint32_t bits;
    memcpy(&bits, p, sizeof bits);
    for (int j = 0; j < 32; ++j) out[j] = ((bits >> j) & 1) << 4;
}

// Q5_0: d (f16), 32 fifth bits, nibbles as Q4_0; w = d(q - 16), q 5 bits
inline void decode_q5_0(const uint8_t* b, float* y) {
    const float d = half_to_float(read_half(b));
    alignas(16) uint8_t hi[32];
    fifth_bits(b + 2, hi);
    const __m128i q = load16(b + 6);
    affine16(_mm_or_si128(low_nibbles(q), load16(hi)), d, -16 * d, y);
    affine16(_mm_or_si128(high_nibbles(q), load16(hi + 16)), d, -16 * d, y + 16);
}

// Q5_1: d and m (f16), 32 fifth bits, nibbles; w = d q + m
inline void decode_q5_1(const uint8_t* b, float* y) {
    const float d = half_to_float(read_half(b)), m = half_to_float(read_half(b + 2));
    alignas(16) uint8_t hi[32];
    fifth_bits(b + 4, hi);
    const __m128i q = load16(b + 8);
    affine16(_mm_or_si128(low_nibbles(q), load16(hi)), d, m, y);
    affine16(_mm_or_si128(high_nibbles(q), load16(hi + 16)), d, m, y + 16);
}

// Q8_0: d (f16), 32 int8; w = d q
inline void decode_q8_0(const uint8_t* b, float* y) {
    const float d = half_to_float(read_half(b));
    affine16_signed(load16(b + 2), d, y);
    affine16_signed(load16(b + 18), d, y + 16);
}

// The 6-bit scale and min of sub-block j (0..7) of a Q4_K / Q5_K super-block, packed in 12 bytes.
inline void scale_min_k4(int j, const uint8_t* s, int* sc, int* mn) {
    if (j < 4) {
        *sc = s[j] & 63, *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xf) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

// Q4_K: d, dmin (f16), 12 bytes of scales, 128 bytes of nibbles; 8 sub-blocks of 32: w = d sc q - dmin mn.
// Each 32 bytes hold two sub-blocks: the low nibbles one, the high nibbles the next.
inline void decode_q4_k(const uint8_t* b, float* y) {
    const float d = half_to_float(read_half(b)), dmin = half_to_float(read_half(b + 2));
    const uint8_t *scales = b + 4, *q = b + 16;
    for (int j = 0; j < 8; j += 2, q += 32, y += 64) {
        int sc0, mn0, sc1, mn1;
        scale_min_k4(j, scales, &sc0, &mn0);
        scale_min_k4(j + 1, scales, &sc1, &mn1);
        for (int h = 0; h < 32; h += 16) {
            const __m128i v = load16(q + h);
            affine16(low_nibbles(v), d * sc0, -dmin * mn0, y + h);
            affine16(high_nibbles(v), d * sc1, -dmin * mn1, y + 32 + h);
        }
    }
}

// Q5_K: Q4_K's layout plus 32 bytes of fifth bits (qh) between the scales and the nibbles: bit j of qh[l]
// tops element l of sub-block j.
inline void decode_q5_k(const uint8_t* b, float* y) {
    const float d = half_to_float(read_half(b)), dmin = half_to_float(read_half(b + 2));
    const uint8_t *scales = b + 4, *qh = b + 16, *q = b + 48;
    for (int j = 0; j < 8; j += 2, q += 32, y += 64) {
        int sc0, mn0, sc1, mn1;
        scale_min_k4(j, scales, &sc0, &mn0);
        scale_min_k4(j + 1, scales, &sc1, &mn1);
        for (int h = 0; h < 32; h += 16) {
            const __m128i v = load16(q + h), hi = load16(qh + h);
            affine16(_mm_or_si128(low_nibbles(v), high_bits(hi, j, 1)), d * sc0, -dmin * mn0, y + h);
            affine16(_mm_or_si128(high_nibbles(v), high_bits(hi, j + 1, 1)), d * sc1, -dmin * mn1, y + 32 + h);
        }
    }
}

// Q6_K: 128 bytes of low nibbles (ql), 64 of high 2-bit pairs (qh), 16 int8 scales, d (f16) last;
// 16 sub-blocks of 16: w = d sc (q - 32), q 6 bits. Each half (128 elements) reads 64 ql, 32 qh, 8 scales:
// element l (< 32) of its quarters 0..3 is ql[l] low, ql[l + 32] low, ql[l] high, ql[l + 32] high nibble,
// topped by bits 0-1, 2-3, 4-5, 6-7 of qh[l].
template <typename Visit>
inline void q6_k_sixteens(const uint8_t* b, Visit&& visit) {  // visit(element offset, 16 quants, scale)
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = half_to_float(read_half(b + 208));
    for (int half = 0; half < 2; ++half, ql += 64, qh += 32, sc += 8) {
        for (int h = 0; h < 32; h += 16) {  // l in [h, h + 16): sub-block scale index h / 16 (+ 2 a quarter)
            const __m128i a = load16(ql + h), c = load16(ql + 32 + h), hi = load16(qh + h);
            const __m128i q[4] = {_mm_or_si128(low_nibbles(a), high_bits(hi, 0, 3)),
                                  _mm_or_si128(low_nibbles(c), high_bits(hi, 2, 3)),
                                  _mm_or_si128(high_nibbles(a), high_bits(hi, 4, 3)),
                                  _mm_or_si128(high_nibbles(c), high_bits(hi, 6, 3))};
            for (int part = 0; part < 4; ++part) visit(128 * half + 32 * part + h, q[part], d * sc[h / 16 + 2 * part]);
        }
    }
}

inline void decode_q6_k(const uint8_t* b, float* y) {
    q6_k_sixteens(b, [&](int at, __m128i q, float s) { affine16(q, s, -32 * s, y + at); });
}

// One row of k elements (a whole number of blocks; INT8_ROW: any k, times `scale`) into y.
inline void decode_row(int type, const uint8_t* row, int64_t k, float scale, float* y) {
    const int64_t be = block_elems(type), bb = block_bytes(type);
    switch (type) {
        case Q4_0: for (int64_t i = 0; i < k / be; ++i) decode_q4_0(row + i * bb, y + i * be); break;
        case Q4_1: for (int64_t i = 0; i < k / be; ++i) decode_q4_1(row + i * bb, y + i * be); break;
        case Q5_0: for (int64_t i = 0; i < k / be; ++i) decode_q5_0(row + i * bb, y + i * be); break;
        case Q5_1: for (int64_t i = 0; i < k / be; ++i) decode_q5_1(row + i * bb, y + i * be); break;
        case Q8_0: for (int64_t i = 0; i < k / be; ++i) decode_q8_0(row + i * bb, y + i * be); break;
        case Q4_K: for (int64_t i = 0; i < k / be; ++i) decode_q4_k(row + i * bb, y + i * be); break;
        case Q5_K: for (int64_t i = 0; i < k / be; ++i) decode_q5_k(row + i * bb, y + i * be); break;
        case Q6_K: for (int64_t i = 0; i < k / be; ++i) decode_q6_k(row + i * bb, y + i * be); break;
        case INT8_ROW: {
            const int8_t* q = reinterpret_cast<const int8_t*>(row);
            for (int64_t i = 0; i < k; ++i) y[i] = scale * q[i];
            break;
        }
        default: break;
    }
}

}  // namespace mixserve
