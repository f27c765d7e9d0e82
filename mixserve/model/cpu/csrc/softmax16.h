// The online-softmax step of one query row over one tile of 16 keys, as vector code: the scores are one
// vf16, so the tile's max, its 16 exponentials and their sum are a handful of vector instructions, where
// the scalar loops (a max over `visible` keys, 16 calls of fast_exp) cost more than the row's 128 FMAs.
#pragma once
#include <stdint.h>

#include "common.h"
#include "vec16.h"

namespace mixserve {

// max and sum of 16 lanes: four halving shuffles each.
inline float hmax16(vf16 v) {
    const vi16 s8 = {8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7};
    const vi16 s4 = {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11};
    const vi16 s2 = {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13};
    const vi16 s1 = {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14};
    vf16 w = __builtin_shuffle(v, s8);
    v = v > w ? v : w;
    w = __builtin_shuffle(v, s4);
    v = v > w ? v : w;
    w = __builtin_shuffle(v, s2);
    v = v > w ? v : w;
    w = __builtin_shuffle(v, s1);
    v = v > w ? v : w;
    return v[0];
}

inline float hsum16(vf16 v) {
    const vi16 s8 = {8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7};
    const vi16 s4 = {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11};
    const vi16 s2 = {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13};
    const vi16 s1 = {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14};
    v += __builtin_shuffle(v, s8);
    v += __builtin_shuffle(v, s4);
    v += __builtin_shuffle(v, s2);
    v += __builtin_shuffle(v, s1);
    return v[0];
}

// 2^t on 16 lanes (t >= -125.5 after the clamp): n = floor(t + 0.5) as a truncating conversion of a value made
// positive first, 2^(t - n) by exp2_poly, 2^n through the exponent bits.
inline vf16 exp2_16(vf16 t) {
    const vf16 lo = vf16{} - 125.5f, hi = vf16{} + 126.9f;
    t = t < lo ? lo : t;
    t = t > hi ? hi : t;
    const vi16 n = __builtin_convertvector(t + 128.5f, vi16) - 128;
    const vf16 p = exp2_poly(t - __builtin_convertvector(n, vf16));
    const vi16 bits = (n + 127) << 23;
    return p * (vf16)bits;  // a cast between vector types of one size reinterprets the bits
}

// fast_exp (common.h) on a vector of lanes (16: vf16, 8: vec16.h's vf8), the same polynomial and clamp:
// floor(t + 0.5) as a truncating conversion of a value made positive first (t >= -126 after the clamp).
template <typename VF, typename VI>
inline VF exp_lanes(VF x) {
    const VF lo = VF{} - 87.0f, hi = VF{} + 88.0f;
    x = x < lo ? lo : x;
    x = x > hi ? hi : x;
    const VF t = x * 1.44269504088896341f;
    const VI n = __builtin_convertvector(t + 128.5f, VI) - 128;
    const VF p = exp2_poly(t - __builtin_convertvector(n, VF));
    const VI bits = (n + 127) << 23;
    return p * (VF)bits;  // a cast between vector types of one size reinterprets the bits
}

inline vf16 exp16(vf16 x) { return exp_lanes<vf16, vi16>(x); }

// tanh on a vector of lanes: an odd Taylor polynomial to x^15 below |x| = 0.5 (truncated after ~1e-8 there, where
// 1 - 2 / (e^2x + 1) would lose digits to cancellation), (1 - e) / (1 + e) with e = exp(-2|x|) above it.
template <typename VF, typename VI>
inline VF tanh_lanes(VF x) {
    const VF zero = {}, ax = x < zero ? -x : x, x2 = x * x;
    VF p = x2 * -1.4558343870513183e-3f + 3.5921280365724810e-3f;
    p = p * x2 - 8.8632355299021966e-3f;
    p = p * x2 + 2.1869488536155203e-2f;
    p = p * x2 - 5.3968253968253968e-2f;
    p = p * x2 + 1.3333333333333333e-1f;
    p = p * x2 - 3.3333333333333333e-1f;
    p = p * x2 + 1.f;
    const VF e = exp_lanes<VF, VI>(ax * -2.f);
    const VF t = ax < zero + 0.5f ? p * ax : (1.f - e) / (1.f + e);
    return x < zero ? -t : t;
}

// Gemma 2's logit softcap in place on n scores (n a multiple of 16): s = cap * tanh(s / cap). On AVX2 in halves
// of 8 (vec16.h's vf8), where GCC's vf16 code spills.
inline void softcap_scores(float* s, int64_t n, float cap) {
    const float inv = 1.f / cap;
    for (int64_t i = 0; i < n; i += 16) {
        if constexpr (VF16_REGS < 32) {
            store8(s + i, tanh_lanes<vf8, vi8>(load8(s + i) * inv) * cap);
            store8(s + i + 8, tanh_lanes<vf8, vi8>(load8(s + i + 8) * inv) * cap);
        } else {
            store16(s + i, tanh_lanes<vf16, vi16>(load16(s + i) * inv) * cap);
        }
    }
}

// Scores s (16 lanes; only lanes first..visible-1 are keys this row sees) become the tile's softmax numerators
// exp(s - m_new) (0 elsewhere), with the row's running max m and sum l updated; returns the factor the row's
// accumulator must be scaled by (0 on the row's first tile). Needs first < visible.
inline float softmax_tile_row(float* s, int64_t first, int64_t visible, float& m, float& l) {
    const vi16 iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const vi16 keep = (iota >= static_cast<int32_t>(first)) & (iota < static_cast<int32_t>(visible));
    const vf16 zero = {}, neg = zero + NEG_BIG;
    vf16 v = load16(s);
    v = keep ? v : neg;
    const float m_new = std::max(m, hmax16(v));
    const float alpha = fast_exp(m - m_new);
    vf16 e = exp16(v - m_new);
    e = keep ? e : zero;
    store16(s, e);
    l = l * alpha + hsum16(e);
    m = m_new;
    return alpha;
}

}  // namespace mixserve
