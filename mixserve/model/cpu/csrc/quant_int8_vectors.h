// The integer vectors of the int8 panels (quant_int8_panels.cpp), as wide as few_row_simd.h's float ones:
// 512 bits on AVX-512 (vpdpbusd where the CPU has VNNI, else AVX512BW's two-step form), else 256 (AVX2).
#pragma once
#include <immintrin.h>
#include <stdint.h>

#include "few_row_simd.h"

#if defined(MIXSERVE_FEW_ROW_SIMD) && (!defined(__AVX512F__) || defined(__AVX512BW__))
namespace {

#if defined(__AVX512F__)
#define MIXSERVE_INT8_512 1
using Vi = __m512i;
inline Vi vi_zero() { return _mm512_setzero_si512(); }
inline Vi vi_load(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline Vi vi_set1(int32_t v) { return _mm512_set1_epi32(v); }
inline Vi vi_sub(Vi a, Vi b) { return _mm512_sub_epi32(a, b); }
inline Vf vi_float(Vi a) { return _mm512_cvtepi32_ps(a); }
constexpr int TILE_ROWS = 4;  // input rows a pass: 4 x 2 vectors of integer sums and of float sums
#ifdef __AVX512VNNI__
constexpr bool EXACT_FOR_BYTES = true;  // any unsigned byte times a signed one
inline Vi dpbusd(Vi acc, Vi u, Vi s) { return _mm512_dpbusd_epi32(acc, u, s); }
#else  // the pairs summed in 16 bits first, exact while u x s pairs stay under 2^15: u <= 128
constexpr bool EXACT_FOR_BYTES = false;
inline Vi dpbusd(Vi acc, Vi u, Vi s) {
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
}
#endif
#else
using Vi = __m256i;
inline Vi vi_zero() { return _mm256_setzero_si256(); }
inline Vi vi_load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline Vi vi_set1(int32_t v) { return _mm256_set1_epi32(v); }
inline Vi vi_sub(Vi a, Vi b) { return _mm256_sub_epi32(a, b); }
inline Vf vi_float(Vi a) { return _mm256_cvtepi32_ps(a); }
constexpr int TILE_ROWS = 2;  // 16 registers: 2 x 2 vectors each of 16-bit sums and float sums
constexpr bool EXACT_FOR_BYTES = true;  // the AVX2 path keeps Q8_0's quants signed
#endif

}  // namespace
#endif
