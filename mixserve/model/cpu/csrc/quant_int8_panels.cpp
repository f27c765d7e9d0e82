// Prefill chunks with int8 inputs (`int8_inputs`, the opt-in for llama.cpp's rounding) on the 32-element
// formats, the K-quants (sub-blocks of 32; Q6_K's two scales of 16 take their integer sums apart) and int8 per
// channel (as Q8_0, the row's scale for every block's): the inputs rounded to int8 once per call in blocks of
// 32, as quant_dot.h rounds them, and each thread's column panel decoded to bytes laid out for integer dots:
// lane c of a vector holds 4 consecutive quants of output c, against one input's 4 bytes broadcast.
// AVX512-VNNI: one vpdpbusd is 64 multiply-adds (16 outputs x 4), where float32 does 16 an FMA (AVX-512
// without VNNI: vpmaddubsw + vpmaddwd, signed quants kept signed as on AVX2). AVX2:
// vpmaddubsw's 16-bit pair sums are added in 16 bits over a run of quads where they cannot overflow, then
// widened once (vpmaddwd). The integer sums are exact; the scales and minimums meet them in float32.
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "few_row_simd.h"
#include "quant_blocks.h"
#include "quant_dot.h"
#include "quant_int8_vectors.h"

#if defined(MIXSERVE_QUANT_DOT) && defined(MIXSERVE_FEW_ROW_SIMD) && (!defined(__AVX512F__) || defined(__AVX512BW__))
#define MIXSERVE_INT8_PANELS 1

namespace {

using mixserve::WeightBlock;

constexpr int GROUPS = 2, WIDTH = LANES * GROUPS;  // outputs a panel: two vectors

#ifdef MIXSERVE_INT8_512
// VNNI: Q8_0's (int8 rows') quants + 128, unsigned as vpdpbusd's first operand; without it kept signed, as
// + 128 would overflow the 16-bit pair sums
constexpr bool SIGNED_Q8 = !EXACT_FOR_BYTES;
#else
constexpr bool SIGNED_Q8 = true;  // kept signed: |q| x (x with q's sign), as quant_dot.h's AVX2 path does
#endif

// What the decoded quant u stands for: d (u - offset) + min. Offsets are subtracted in the integer sums
// (exact); only Q4_1 / Q5_1 have a float minimum.
template <int TYPE>
constexpr int offset_of() {
    if constexpr (TYPE == mixserve::Q4_0) return 8;
    if constexpr (TYPE == mixserve::Q5_0) return 16;
    if constexpr (TYPE == mixserve::Q6_K) return SIGNED_Q8 ? 0 : 32;  // q - 32, or q itself: 32 a 16's sum
    return mixserve::signed_quants<TYPE>() && !SIGNED_Q8 ? 128 : 0;
}
template <int TYPE>
constexpr bool has_min() {
    return TYPE == mixserve::Q4_1 || TYPE == mixserve::Q5_1 || TYPE == mixserve::Q4_K || TYPE == mixserve::Q5_K;
}

// The input rows as int8 blocks: q (rows of k), d (scale), s (d times the block's sum), sum (the integer sum),
// half (the integer sums of each 16, two a block).
struct InputQ8 {
    std::vector<int8_t> q;
    std::vector<float> d, s;
    std::vector<int32_t> sum, half;
};

// A panel: quants [block][quad][output][4] as bytes, scales and minimums [block][output]; Q6_K: d the first
// 16 values' scales, d_hi the last 16's.
struct Panel {
    std::vector<uint8_t> strip, q;  // strip: WIDTH rows of k bytes, row-major, before the transposition
    std::vector<float> d, min, d_hi;
};

constexpr bool split_halves(int type) { return type == mixserve::Q6_K; }  // a scale for each 16 values

// scales: int8 per channel's, one a row (else null)
template <int TYPE>
void decode_panel(const uint8_t* w, int64_t row_bytes, int64_t k, const float* scales, int64_t j0, int64_t valid,
                  Panel& p) {
    const int64_t nb = k / 32;
    for (int64_t c = 0; c < WIDTH; ++c) {
        uint8_t* row = p.strip.data() + c * k;
        if (c >= valid) {
            std::fill_n(row, k, uint8_t{0});
            for (int64_t b = 0; b < nb; ++b) p.d[b * WIDTH + c] = p.min[b * WIDTH + c] = p.d_hi[b * WIDTH + c] = 0.f;
            continue;
        }
        for (int64_t b = 0; b < nb; ++b) {
            const WeightBlock wb = mixserve::block_at<TYPE>(w + (j0 + c) * row_bytes, b);
            // signed quants: as they are (SIGNED_Q8), or + 128 (the sign bit flipped; Q6_K's + 32) for vpdpbusd
            const __m256i u = !mixserve::signed_quants<TYPE>() ? wb.u
                              : SIGNED_Q8 ? wb.sign
                              : TYPE == mixserve::Q6_K ? _mm256_add_epi8(wb.sign, _mm256_set1_epi8(32))
                                                       : _mm256_xor_si256(wb.sign, _mm256_set1_epi8(-128));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + b * 32), u);
            p.d[b * WIDTH + c] = TYPE == mixserve::INT8_ROW ? scales[j0 + c] : wb.scale;
            p.min[b * WIDTH + c] = has_min<TYPE>() ? wb.min : 0.f;
            p.d_hi[b * WIDTH + c] = wb.scale_hi;
        }
    }
    // [output][quad] -> [quad][output], a quad of bytes moved as one float: 16 x 16 tiles in registers
    const int64_t quads = k / 4;
    const float* src = reinterpret_cast<const float*>(p.strip.data());
    float* dst = reinterpret_cast<float*>(p.q.data());
    int64_t i = 0;
    for (; i + LANES <= quads; i += LANES)
        for (int g = 0; g < GROUPS; ++g)
            transpose_tile(src + g * LANES * quads + i, quads, dst + i * WIDTH + g * LANES, WIDTH);
    for (; i < quads; ++i)  // k not a multiple of 4 LANES: the last quads
        for (int c = 0; c < WIDTH; ++c) dst[i * WIDTH + c] = src[c * quads + i];
}

inline int32_t quad(const int8_t* p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

// dots[r][g] = the integer sums of block b over its quads T0..T1 (all 8: the block; Q6_K a half, 16 values a
// scale): quants (u - offset for Q4_0 / Q5_0 / Q8_0 + 128) x input row r.
template <int TYPE, int ROWS, int T0 = 0, int T1 = 8>
inline void block_dots(const uint8_t* q, const int8_t* const* xq, int64_t b, Vi (*dots)[GROUPS]) {
#ifdef MIXSERVE_INT8_512
    for (int r = 0; r < ROWS; ++r)
        for (int g = 0; g < GROUPS; ++g) dots[r][g] = vi_zero();
    for (int t = T0; t < T1; ++t) {
        Vi wv[GROUPS];
        __mmask64 negative[GROUPS];  // signed quants (SIGNED_Q8): |q| x (x with q's sign), the sign by a mask
        constexpr bool sign_trick = SIGNED_Q8 && mixserve::signed_quants<TYPE>();
        for (int g = 0; g < GROUPS; ++g) {
            wv[g] = vi_load(q + (t * WIDTH + g * LANES) * 4);
            if constexpr (sign_trick) {
                negative[g] = _mm512_movepi8_mask(wv[g]);
                wv[g] = _mm512_abs_epi8(wv[g]);
            }
        }
        for (int r = 0; r < ROWS; ++r) {
            const Vi a = vi_set1(quad(xq[r] + b * 32 + 4 * t));
            for (int g = 0; g < GROUPS; ++g)
                dots[r][g] = dpbusd(dots[r][g], wv[g],
                                    sign_trick ? _mm512_mask_sub_epi8(a, negative[g], vi_zero(), a) : a);
        }
    }
#else
    // quads whose 16-bit pair sums add without overflow: 2 x 15 x 127 x 8, 2 x 31 x 127 x 4 (Q6_K's |q - 32|
    // <= 32 too), 2 x 128 x 127
    constexpr int RUN = TYPE == mixserve::Q4_0 || TYPE == mixserve::Q4_1 || TYPE == mixserve::Q4_K ? 8
                        : TYPE == mixserve::Q8_0 || TYPE == mixserve::INT8_ROW ? 1 : 4;
    const Vi ones = _mm256_set1_epi16(1);
    Vi pairs[ROWS][GROUPS];
    for (int t = T0; t < T1; ++t) {
        Vi wv[GROUPS], uv[GROUPS];
        for (int g = 0; g < GROUPS; ++g) {
            wv[g] = vi_load(q + (t * WIDTH + g * LANES) * 4);
            uv[g] = mixserve::signed_quants<TYPE>() ? _mm256_sign_epi8(wv[g], wv[g]) : wv[g];
        }
        for (int r = 0; r < ROWS; ++r) {
            const Vi a = vi_set1(quad(xq[r] + b * 32 + 4 * t));
            for (int g = 0; g < GROUPS; ++g) {
                const Vi p = _mm256_maddubs_epi16(uv[g], mixserve::signed_quants<TYPE>() ? _mm256_sign_epi8(a, wv[g])
                                                                                         : a);
                pairs[r][g] = (t - T0) % RUN == 0 ? p : _mm256_add_epi16(pairs[r][g], p);
                if ((t - T0) % RUN == RUN - 1) {
                    const Vi wide = _mm256_madd_epi16(pairs[r][g], ones);
                    dots[r][g] = t - T0 < RUN ? wide : _mm256_add_epi32(dots[r][g], wide);
                }
            }
        }
    }
#endif
}

// out rows r0.. (ROWS of them) x the panel's `valid` outputs.
template <int TYPE, int ROWS>
void panel_rows(const Panel& p, const InputQ8& x, int64_t r0, int64_t k, const float* bias, float* out,
                int64_t ldo, int64_t valid) {
    const int64_t nb = k / 32;
    const int8_t* xq[ROWS];
    Vf acc[ROWS][GROUPS];
    for (int r = 0; r < ROWS; ++r) {
        xq[r] = x.q.data() + (r0 + r) * k;
        for (int g = 0; g < GROUPS; ++g) acc[r][g] = vzero();
    }
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* qb = p.q.data() + b * 8 * WIDTH * 4;
        const int64_t xb = r0 * nb + b;
        Vi dots[ROWS][GROUPS];
        if constexpr (split_halves(TYPE)) {  // each half's sums meet its own scales before the next half's
            const auto fold = [&](int h, const float* d) {
                for (int g = 0; g < GROUPS; ++g)
                    for (int r = 0; r < ROWS; ++r) {
                        const Vi off = vi_set1(offset_of<TYPE>() * x.half[2 * (xb + r * nb) + h]);
                        acc[r][g] = vfmadd(vi_float(vi_sub(dots[r][g], off)),
                                           vload(d + b * WIDTH + g * LANES) * vbroadcast(x.d[xb + r * nb]), acc[r][g]);
                    }
            };
            block_dots<TYPE, ROWS, 0, 4>(qb, xq, b, dots);
            fold(0, p.d.data());
            block_dots<TYPE, ROWS, 4, 8>(qb, xq, b, dots);
            fold(1, p.d_hi.data());
            continue;
        }
        block_dots<TYPE, ROWS>(qb, xq, b, dots);
        for (int g = 0; g < GROUPS; ++g) {
            const Vf dv = vload(p.d.data() + b * WIDTH + g * LANES);
            for (int r = 0; r < ROWS; ++r) {
                Vi dot = dots[r][g];
                if constexpr (offset_of<TYPE>() != 0)
                    dot = vi_sub(dot, vi_set1(offset_of<TYPE>() * x.sum[xb + r * nb]));
                acc[r][g] = vfmadd(vi_float(dot), dv * vbroadcast(x.d[xb + r * nb]), acc[r][g]);
                if constexpr (has_min<TYPE>())
                    acc[r][g] = vfmadd(vload(p.min.data() + b * WIDTH + g * LANES), vbroadcast(x.s[xb + r * nb]),
                                       acc[r][g]);
            }
        }
    }
    for (int g = 0; g < GROUPS; ++g) {
        const Mask m = lanes(valid, g);
        const Vf bv = bias ? vload_masked(m, bias + LANES * g) : vzero();
        for (int r = 0; r < ROWS; ++r) vstore_masked(out + r * ldo + LANES * g, m, vadd(acc[r][g], bv));
    }
}

template <int TYPE>
void panel_all_rows(const Panel& p, const InputQ8& x, int64_t r0, int64_t r1, int64_t k, const float* bias,
                    float* out, int64_t ldo, int64_t valid) {
    int64_t r = r0;
    for (; r + TILE_ROWS <= r1; r += TILE_ROWS)
        panel_rows<TYPE, TILE_ROWS>(p, x, r, k, bias, out + (r - r0) * ldo, ldo, valid);
    switch (r1 - r) {
        case 3: return panel_rows<TYPE, 3>(p, x, r, k, bias, out + (r - r0) * ldo, ldo, valid);
        case 2: return panel_rows<TYPE, 2>(p, x, r, k, bias, out + (r - r0) * ldo, ldo, valid);
        case 1: return panel_rows<TYPE, 1>(p, x, r, k, bias, out + (r - r0) * ldo, ldo, valid);
        default: return;
    }
}

template <int TYPE>
void int8_panel_linear(const float* x, int64_t ldx, int64_t m, const uint8_t* w, int64_t row_bytes, int64_t n,
                       int64_t k, const float* scales, const float* bias, float* out, int64_t ldo, int num_threads) {
    const int64_t nb = k / 32, count = (n + WIDTH - 1) / WIDTH;
    InputQ8 xq{std::vector<int8_t>(m * k), std::vector<float>(m * nb), std::vector<float>(m * nb),
               std::vector<int32_t>(m * nb), std::vector<int32_t>(split_halves(TYPE) ? 2 * m * nb : 0)};
#pragma omp parallel num_threads(num_threads) if (count >= 2 * num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; ++r)
            mixserve::quantize_row_q8(x + r * ldx, k, xq.q.data() + r * k, xq.d.data() + r * nb,
                                      xq.s.data() + r * nb, xq.sum.data() + r * nb,
                                      split_halves(TYPE) ? xq.half.data() + 2 * r * nb : nullptr);
        Panel p{std::vector<uint8_t>(WIDTH * k), std::vector<uint8_t>(WIDTH * k), std::vector<float>(WIDTH * nb),
                std::vector<float>(WIDTH * nb), std::vector<float>(WIDTH * nb)};
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        // panels split in fractions as quant_panels.cpp splits them: a boundary panel decoded by both threads
        const int64_t begin = count * t, end = count * (t + 1);
        for (int64_t pi = begin / nt; pi * nt < end; ++pi) {
            const int64_t r0 = m * (std::max(begin, pi * nt) - pi * nt) / nt;
            const int64_t r1 = m * (std::min(end, (pi + 1) * nt) - pi * nt) / nt;
            if (r1 <= r0) continue;
            const int64_t j0 = pi * WIDTH, valid = std::min<int64_t>(WIDTH, n - j0);
            decode_panel<TYPE>(w, row_bytes, k, scales, j0, valid, p);
            panel_all_rows<TYPE>(p, xq, r0, r1, k, bias ? bias + j0 : nullptr, out + r0 * ldo + j0, ldo, valid);
        }
    }
}

}  // namespace
#endif

extern "C" {

// out (m, n) = x (m, k) @ w.T (+ bias) on int8-rounded inputs, for the 32-element formats, the K-quants and
// int8 per channel (scales: its row scales); 0, or 1 for a type or k it cannot take, 2 where there are no
// such panels (AVX-512 without VNNI, or no AVX2).
int mixserve_quant_int8_panel_linear(int type, const float* x, int64_t ldx, int64_t m, const void* data,
                                     int64_t row_bytes, int64_t n, int64_t k, const float* scales, const float* bias,
                                     float* out, int64_t ldo, int num_threads) {
#ifdef MIXSERVE_INT8_PANELS
    const int64_t be = mixserve::block_elems(type);
    if (be == 0 || k <= 0 || k % be != 0 || k % 32 != 0 || (type == mixserve::INT8_ROW && !scales)) return 1;
    const uint8_t* w = static_cast<const uint8_t*>(data);
#define MIXSERVE_INT8_CASE(T) \
    case mixserve::T: \
        int8_panel_linear<mixserve::T>(x, ldx, m, w, row_bytes, n, k, scales, bias, out, ldo, num_threads); \
        return 0;
    switch (type) {
        MIXSERVE_INT8_CASE(Q4_0) MIXSERVE_INT8_CASE(Q4_1) MIXSERVE_INT8_CASE(Q5_0) MIXSERVE_INT8_CASE(Q5_1)
        MIXSERVE_INT8_CASE(Q8_0) MIXSERVE_INT8_CASE(Q4_K) MIXSERVE_INT8_CASE(Q5_K) MIXSERVE_INT8_CASE(Q6_K)
        MIXSERVE_INT8_CASE(INT8_ROW)
#undef MIXSERVE_INT8_CASE
        default: return 1;
    }
#else
    return 2;
#endif
}

}  // extern "C"
