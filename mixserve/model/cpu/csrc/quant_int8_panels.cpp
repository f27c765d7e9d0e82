// Prefill chunks on the 32-element formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) with int8 inputs (`int8_inputs`,
// the opt-in for llama.cpp's rounding): the inputs rounded to int8 once per call in blocks of 32, as the few-row
// integer dots (quant_dot.h) round them, and each thread's column panel of the weight decoded to bytes laid out
// for vpdpbusd: lane c of a 512-bit load holds 4 consecutive quants of output c, so one instruction is 64
// multiply-adds (16 outputs x 4) against one input's 4 bytes broadcast, where float32 does 16 an FMA. The
// integer sums are exact; each block's two scales then meet them in float32, 16 outputs a vector.
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "few_row_simd.h"
#include "quant_blocks.h"
#include "quant_dot.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(MIXSERVE_QUANT_DOT)
#define MIXSERVE_INT8_PANELS 1

namespace {

using mixserve::WeightBlock;

constexpr int GROUPS = 2, WIDTH = 16 * GROUPS;  // outputs a panel: two vectors of 16
constexpr int TILE_ROWS = 4;  // input rows a pass: 4 x 2 vectors each of integer sums, float sums, minimum sums

// What the decoded quant u stands for: d (u - offset) + min. Offsets are subtracted in the integer sums
// (exact); only Q4_1 / Q5_1 have a float minimum.
template <int TYPE>
constexpr int offset_of() {
    return TYPE == mixserve::Q4_0 ? 8 : TYPE == mixserve::Q5_0 ? 16 : TYPE == mixserve::Q8_0 ? 128 : 0;
}
template <int TYPE>
constexpr bool has_min() { return TYPE == mixserve::Q4_1 || TYPE == mixserve::Q5_1; }

// The input rows as int8 blocks: q (rows of k), d (scale), s (d times the block's sum), sum (the integer sum).
struct InputQ8 {
    std::vector<int8_t> q;
    std::vector<float> d, s;
    std::vector<int32_t> sum;
};

// A panel: quants [block][quad][output][4] as unsigned bytes, scales and minimums [block][output].
struct Panel {
    std::vector<uint8_t> strip, q;  // strip: WIDTH rows of k bytes, row-major, before the transposition
    std::vector<float> d, min;
};

template <int TYPE>
void decode_panel(const uint8_t* w, int64_t row_bytes, int64_t k, int64_t j0, int64_t valid, Panel& p) {
    const int64_t nb = k / 32, bb = mixserve::block_bytes(TYPE);
    for (int64_t c = 0; c < WIDTH; ++c) {
        uint8_t* row = p.strip.data() + c * k;
        if (c >= valid) {
            std::fill_n(row, k, uint8_t{0});
            for (int64_t b = 0; b < nb; ++b) p.d[b * WIDTH + c] = p.min[b * WIDTH + c] = 0.f;
            continue;
        }
        const uint8_t* blk = w + (j0 + c) * row_bytes;
        for (int64_t b = 0; b < nb; ++b, blk += bb) {
            const WeightBlock wb = mixserve::weight_block<TYPE>(blk);
            // Q8_0's quants signed: + 128 (xor of the sign bit) makes them the unsigned operand
            const __m256i u = TYPE == mixserve::Q8_0 ? _mm256_xor_si256(wb.sign, _mm256_set1_epi8(-128)) : wb.u;
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + b * 32), u);
            p.d[b * WIDTH + c] = wb.scale;
            p.min[b * WIDTH + c] = has_min<TYPE>() ? wb.min : 0.f;
        }
    }
    // [output][quad] -> [quad][output], a quad of bytes moved as one float: 16 x 16 tiles in registers
    const int64_t quads = k / 4;
    const float* src = reinterpret_cast<const float*>(p.strip.data());
    float* dst = reinterpret_cast<float*>(p.q.data());
    int64_t i = 0;
    for (; i + 16 <= quads; i += 16)
        for (int g = 0; g < GROUPS; ++g)
            transpose_tile(src + g * 16 * quads + i, quads, dst + i * WIDTH + g * 16, WIDTH);
    for (; i < quads; ++i)  // k a multiple of 32 but not of 64: the last 8 quads
        for (int c = 0; c < WIDTH; ++c) dst[i * WIDTH + c] = src[c * quads + i];
}

inline __m512i broadcast4(const int8_t* p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return _mm512_set1_epi32(v);
}

// out rows r0.. (ROWS of them) x the panel's `valid` outputs.
template <int TYPE, int ROWS>
void panel_rows(const Panel& p, const InputQ8& x, int64_t r0, int64_t k, const float* bias, float* out,
                int64_t ldo, int64_t valid) {
    const int64_t nb = k / 32;
    __m512 acc[ROWS][GROUPS], mins[ROWS][GROUPS];
    for (int r = 0; r < ROWS; ++r)
        for (int g = 0; g < GROUPS; ++g) acc[r][g] = mins[r][g] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        __m512i dots[ROWS][GROUPS];
        for (int r = 0; r < ROWS; ++r)
            for (int g = 0; g < GROUPS; ++g) dots[r][g] = _mm512_setzero_si512();
        const uint8_t* q = p.q.data() + b * 8 * WIDTH * 4;
        for (int t = 0; t < 8; ++t) {
            __m512i wv[GROUPS];
            for (int g = 0; g < GROUPS; ++g) wv[g] = _mm512_loadu_si512(q + (t * WIDTH + g * 16) * 4);
            for (int r = 0; r < ROWS; ++r) {
                const __m512i a = broadcast4(x.q.data() + (r0 + r) * k + b * 32 + 4 * t);
                for (int g = 0; g < GROUPS; ++g) dots[r][g] = _mm512_dpbusd_epi32(dots[r][g], wv[g], a);
            }
        }
        const int64_t xb = r0 * nb + b;
        for (int g = 0; g < GROUPS; ++g) {
            const __m512 dv = _mm512_loadu_ps(p.d.data() + b * WIDTH + g * 16);
            const __m512 mv = _mm512_loadu_ps(p.min.data() + b * WIDTH + g * 16);
            for (int r = 0; r < ROWS; ++r) {
                __m512i dot = dots[r][g];
                if constexpr (offset_of<TYPE>() != 0)
                    dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(offset_of<TYPE>() * x.sum[xb + r * nb]));
                const __m512 scale = _mm512_mul_ps(dv, _mm512_set1_ps(x.d[xb + r * nb]));
                acc[r][g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[r][g]);
                if constexpr (has_min<TYPE>())
                    mins[r][g] = _mm512_fmadd_ps(mv, _mm512_set1_ps(x.s[xb + r * nb]), mins[r][g]);
            }
        }
    }
    for (int g = 0; g < GROUPS; ++g) {
        const int64_t left = valid - 16 * g;
        if (left <= 0) break;
        const __mmask16 m = left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1);
        const __m512 bv = bias ? _mm512_maskz_loadu_ps(m, bias + 16 * g) : _mm512_setzero_ps();
        for (int r = 0; r < ROWS; ++r)
            _mm512_mask_storeu_ps(out + r * ldo + 16 * g, m,
                                  _mm512_add_ps(_mm512_add_ps(acc[r][g], mins[r][g]), bv));
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
                       int64_t k, const float* bias, float* out, int64_t ldo, int num_threads) {
    const int64_t nb = k / 32, count = (n + WIDTH - 1) / WIDTH;
    InputQ8 xq{std::vector<int8_t>(m * k), std::vector<float>(m * nb), std::vector<float>(m * nb),
               std::vector<int32_t>(m * nb)};
#pragma omp parallel num_threads(num_threads) if (count >= 2 * num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; ++r)
            mixserve::quantize_row_q8(x + r * ldx, k, xq.q.data() + r * k, xq.d.data() + r * nb,
                                      xq.s.data() + r * nb, xq.sum.data() + r * nb);
        Panel p{std::vector<uint8_t>(WIDTH * k), std::vector<uint8_t>(WIDTH * k), std::vector<float>(WIDTH * nb),
                std::vector<float>(WIDTH * nb)};
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        // panels split in fractions as quant_panels.cpp splits them: a boundary panel decoded by both threads
        const int64_t begin = count * t, end = count * (t + 1);
        for (int64_t pi = begin / nt; pi * nt < end; ++pi) {
            const int64_t r0 = m * (std::max(begin, pi * nt) - pi * nt) / nt;
            const int64_t r1 = m * (std::min(end, (pi + 1) * nt) - pi * nt) / nt;
            if (r1 <= r0) continue;
            const int64_t j0 = pi * WIDTH, valid = std::min<int64_t>(WIDTH, n - j0);
            decode_panel<TYPE>(w, row_bytes, k, j0, valid, p);
            panel_all_rows<TYPE>(p, xq, r0, r1, k, bias ? bias + j0 : nullptr, out + r0 * ldo + j0, ldo, valid);
        }
    }
}

}  // namespace
#endif

extern "C" {

// out (m, n) = x (m, k) @ w.T (+ bias) on int8-rounded inputs, for the 32-element formats; 0, or 1 for a type
// or k it cannot take, 2 where the kernels lack AVX512-VNNI.
int mixserve_quant_int8_panel_linear(int type, const float* x, int64_t ldx, int64_t m, const void* data,
                                     int64_t row_bytes, int64_t n, int64_t k, const float* bias, float* out,
                                     int64_t ldo, int num_threads) {
#ifdef MIXSERVE_INT8_PANELS
    if (k <= 0 || k % 32 != 0) return 1;
    const uint8_t* w = static_cast<const uint8_t*>(data);
    switch (type) {
        case mixserve::Q4_0: int8_panel_linear<mixserve::Q4_0>(x, ldx, m, w, row_bytes, n, k, bias, out, ldo,
                                                               num_threads); return 0;
        case mixserve::Q4_1: int8_panel_linear<mixserve::Q4_1>(x, ldx, m, w, row_bytes, n, k, bias, out, ldo,
                                                               num_threads); return 0;
        case mixserve::Q5_0: int8_panel_linear<mixserve::Q5_0>(x, ldx, m, w, row_bytes, n, k, bias, out, ldo,
                                                               num_threads); return 0;
        case mixserve::Q5_1: int8_panel_linear<mixserve::Q5_1>(x, ldx, m, w, row_bytes, n, k, bias, out, ldo,
                                                               num_threads); return 0;
        case mixserve::Q8_0: int8_panel_linear<mixserve::Q8_0>(x, ldx, m, w, row_bytes, n, k, bias, out, ldo,
                                                               num_threads); return 0;
        default: return 1;
    }
#else
    return 2;
#endif
}

}  // extern "C"
