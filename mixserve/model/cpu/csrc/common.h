// What the CPU kernels share: bf16 <-> float, loads and stores in either dtype, a vectorisable exp.
#pragma once
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <cmath>

namespace mixserve {

inline float bf16_to_float(uint16_t x) {
    uint32_t bits = static_cast<uint32_t>(x) << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even, as torch does (no NaNs reach here)
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    bits += 0x7fff + ((bits >> 16) & 1);
    return static_cast<uint16_t>(bits >> 16);
}

inline float load(const float* p) { return *p; }
inline float load(const uint16_t* p) { return bf16_to_float(*p); }
inline void store(float* p, float v) { *p = v; }
inline void store(uint16_t* p, float v) { *p = float_to_bf16(v); }
// A value rounded to the storage dtype and back: where HF rounds an intermediate to bf16, we do too.
inline float round_to(const float*, float v) { return v; }
inline float round_to(const uint16_t*, float v) { return bf16_to_float(float_to_bf16(v)); }

// exp(x) as a polynomial the compiler vectorises (glibc's expf stays scalar here): 2^f on [-0.5, 0.5]
// with Cephes' exp2f coefficients (relative error ~2e-7), scaled by 2^n through the exponent bits.
// Inputs are clamped to [-87, 88], where float's exp neither underflows to a denormal nor overflows.
// 2^f for f in [-0.5, 0.5], on a float or on a vector of floats (softmax16.h: exp16).
template <typename V>
inline V exp2_poly(V f) {
    V p = f * 0.0f + 1.535336188319500e-4f;
    p = p * f + 1.339887440266574e-3f;
    p = p * f + 9.618437357674640e-3f;
    p = p * f + 5.550332471162809e-2f;
    p = p * f + 2.402264791363012e-1f;
    p = p * f + 6.931472028550421e-1f;
    return p * f + 1.0f;
}

inline float fast_exp(float x) {
    const float t = std::min(std::max(x, -87.0f), 88.0f) * 1.44269504088896341f;
    const float n = std::floor(t + 0.5f);
    const float p = exp2_poly(t - n);
    const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

}  // namespace mixserve
