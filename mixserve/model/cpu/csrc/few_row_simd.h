// The vector ISA the float32 panels are built for, in one place: AVX-512 (16 lanes, 32 registers) or AVX2
// with FMA (8 lanes, 16 registers). few_row_linear.cpp writes its microkernel once against these names.
//
// The microkernel keeps MAX_ROWS x VECS float32 sums in registers, VECS weight vectors and one broadcast
// input beside them: AVX-512 6 x 4 (24 + 4 + 1 of 32 registers, a 64-column panel), AVX2 6 x 2 (12 + 2 + 1
// of 16, a 16-column panel: BLIS's Haswell shape). A panel row is then 4 cache lines or 1.
// The two blocks below mirror each other on purpose: the same names (lanes, vzero, vload, vbroadcast,
// vfmadd, vadd, vload_masked, vstore_masked, the transposition's unpacks and store_columns), one intrinsic
// each; folding them into macros would hide which instruction each ISA runs.
#pragma once
#include <immintrin.h>
#include <stdint.h>

#include <algorithm>

#if defined(__AVX512F__)
#define MIXSERVE_FEW_ROW_SIMD 1

namespace {

using Vf = __m512;
using Mask = __mmask16;
constexpr int LANES = 16, VECS = 4, MAX_ROWS = 6, VREGS = 32;
// float32 rows the panels take against oneDNN's GEMM (faster up to 128, a tie at 256); where MKL takes the
// rest (Intel, mkl_linear.py) it caps them at 32, MKL's crossover (docs/decisions/few-row-panels.md)
constexpr int F32_FEW_ROWS = 128;

inline Mask lanes(int64_t valid, int v) {  // the lanes of vector v that hold one of `valid` columns
    const int64_t left = valid - LANES * v;
    return left >= LANES ? static_cast<Mask>(0xffff)
                         : left <= 0 ? static_cast<Mask>(0) : static_cast<Mask>((1u << left) - 1);
}
inline Vf vzero() { return _mm512_setzero_ps(); }
inline Vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vf vbroadcast(float x) { return _mm512_set1_ps(x); }
inline Vf vfmadd(Vf a, Vf b, Vf acc) { return _mm512_fmadd_ps(a, b, acc); }
inline Vf vadd(Vf a, Vf b) { return _mm512_add_ps(a, b); }
inline Vf vload_masked(Mask m, const float* p) { return _mm512_maskz_loadu_ps(m, p); }
inline void vstore_masked(float* p, Mask m, Vf v) { _mm512_mask_storeu_ps(p, m, v); }

// the transposition's in-lane steps (unpack pairs of floats, then pairs of pairs), one intrinsic each
inline Vf vunpacklo(Vf a, Vf b) { return _mm512_unpacklo_ps(a, b); }
inline Vf vunpackhi(Vf a, Vf b) { return _mm512_unpackhi_ps(a, b); }
inline Vf vunpacklo64(Vf a, Vf b) {
    return _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
}
inline Vf vunpackhi64(Vf a, Vf b) {
    return _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
}

// The transposition's last step, across the four 128-bit lanes: r[i + j], lane L holds column 4L + j of
// rows i..i+3, so column 4L + j is lane L of r[j], r[4 + j], r[8 + j], r[12 + j].
inline void store_columns(const Vf* r, float* dst, int64_t ldd) {
    for (int j = 0; j < 4; ++j) {
        const __m512 ab_lo = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x88);
        const __m512 ab_hi = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xdd);
        const __m512 cd_lo = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x88);
        const __m512 cd_hi = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xdd);
        _mm512_storeu_ps(dst + j * ldd, _mm512_shuffle_f32x4(ab_lo, cd_lo, 0x88));
        _mm512_storeu_ps(dst + (4 + j) * ldd, _mm512_shuffle_f32x4(ab_hi, cd_hi, 0x88));
        _mm512_storeu_ps(dst + (8 + j) * ldd, _mm512_shuffle_f32x4(ab_lo, cd_lo, 0xdd));
        _mm512_storeu_ps(dst + (12 + j) * ldd, _mm512_shuffle_f32x4(ab_hi, cd_hi, 0xdd));
    }
}

}  // namespace

#elif defined(__AVX2__) && defined(__FMA__)
#define MIXSERVE_FEW_ROW_SIMD 1

namespace {

using Vf = __m256;
using Mask = __m256i;  // all ones in a lane that is loaded or stored
constexpr int LANES = 8, VECS = 2, MAX_ROWS = 6, VREGS = 16;
// float32 rows the panels take: faster than oneDNN up to 96 rows, a tie at 128-256, slower from 384
// (docs/decisions/few-row-panels.md)
constexpr int F32_FEW_ROWS = 128;

inline Mask lanes(int64_t valid, int v) {
    const int64_t left = std::clamp<int64_t>(valid - LANES * v, 0, LANES);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(left)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline Vf vzero() { return _mm256_setzero_ps(); }
inline Vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vf vbroadcast(float x) { return _mm256_set1_ps(x); }
inline Vf vfmadd(Vf a, Vf b, Vf acc) { return _mm256_fmadd_ps(a, b, acc); }
inline Vf vadd(Vf a, Vf b) { return _mm256_add_ps(a, b); }
inline Vf vload_masked(Mask m, const float* p) { return _mm256_maskload_ps(p, m); }
inline void vstore_masked(float* p, Mask m, Vf v) { _mm256_maskstore_ps(p, m, v); }

inline Vf vunpacklo(Vf a, Vf b) { return _mm256_unpacklo_ps(a, b); }
inline Vf vunpackhi(Vf a, Vf b) { return _mm256_unpackhi_ps(a, b); }
inline Vf vunpacklo64(Vf a, Vf b) {
    return _mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(a), _mm256_castps_pd(b)));
}
inline Vf vunpackhi64(Vf a, Vf b) {
    return _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(a), _mm256_castps_pd(b)));
}

// across the two 128-bit halves: r[i + j], half H holds column 4H + j of rows i..i+3
inline void store_columns(const Vf* r, float* dst, int64_t ldd) {
    for (int j = 0; j < 4; ++j) {
        _mm256_storeu_ps(dst + j * ldd, _mm256_permute2f128_ps(r[j], r[4 + j], 0x20));
        _mm256_storeu_ps(dst + (4 + j) * ldd, _mm256_permute2f128_ps(r[j], r[4 + j], 0x31));
    }
}

}  // namespace

#endif

#ifdef MIXSERVE_FEW_ROW_SIMD
namespace {

// dst[j * ldd + i] = src[i * lds + j] for i, j < LANES: a tile transposed in registers (pairs, quads, then
// across 128-bit lanes), 64 shuffles for 256 floats on AVX-512 where element by element costs a load and a
// store each
inline void transpose_tile(const float* src, int64_t lds, float* dst, int64_t ldd) {
    Vf r[LANES], t[LANES];
    for (int i = 0; i < LANES; ++i) r[i] = vload(src + i * lds);
    for (int i = 0; i < LANES; i += 2) {  // per 128-bit lane: a0 b0 a1 b1 | a2 b2 a3 b3
        t[i] = vunpacklo(r[i], r[i + 1]);
        t[i + 1] = vunpackhi(r[i], r[i + 1]);
    }
    for (int i = 0; i < LANES; i += 4) {  // r[i + j], 128-bit lane L: column 4L + j of rows i..i+3
        r[i] = vunpacklo64(t[i], t[i + 2]);
        r[i + 1] = vunpackhi64(t[i], t[i + 2]);
        r[i + 2] = vunpacklo64(t[i + 1], t[i + 3]);
        r[i + 3] = vunpackhi64(t[i + 1], t[i + 3]);
    }
    store_columns(r, dst, ldd);
}

}  // namespace
#endif
