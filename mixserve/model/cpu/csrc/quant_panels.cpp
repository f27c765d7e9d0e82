// The product of more rows than a decode step's (prefill chunks) on a quantized weight: each thread decodes
// one column panel of the weight at a time into its own buffer, the layout mixserve_few_row_linear reads, and
// multiplies every input row by it while the panel is in cache (mixserve/model/cpu/quant_linear.py).
//
// A panel is WIDTH weight rows k-major, so a row's elements land WIDTH floats apart. The rows are decoded a
// strip of K_STRIP elements at a time into a small row-major buffer (in L1) and transposed from there into
// the panel a tile at a time in registers (few_row_simd.h): element by element the transposition cost ~3x the
// decode (docs/decisions/quantized-weights-in-place.md). The products are float32 on the exact decoded
// weights, as the few-row block kernel's; or, where the CPU has AVX512-BF16 and the caller asks, the panel is
// rounded to bf16 pairs and multiplied by bf16 inputs through vdpbf16ps (half the instructions, float32 sums).
#include <omp.h>
#include <stdint.h>

#include <algorithm>
#include <vector>

#include "few_row_simd.h"
#include "quant_blocks.h"

using mixserve::block_bytes;
using mixserve::block_elems;
using mixserve::decode_row;

#ifdef MIXSERVE_FEW_ROW_SIMD
void mixserve_few_row_panel_f32(const float* x, int64_t ldx, int64_t m, const float* panel, int64_t k,
                                const float* bias, float* out, int64_t ldo, int64_t valid, const char* next);
#ifdef __AVX512BF16__
void mixserve_few_row_panel_bf16(const uint16_t* x, int64_t ldx, int64_t m, const uint16_t* panel, int64_t k,
                                 const float* bias, float* out, int64_t ldo, int64_t valid, const char* next);
#endif

namespace {

constexpr int64_t WIDTH = LANES * VECS;
// a strip holds whole blocks of every format (K-quants: 256); its rows padded by a line so the transposition's
// LANES reads of one tile fall in different L1 sets
constexpr int64_t K_STRIP = 256, LD = K_STRIP + 16;
// rows ahead whose strip bytes are prefetched into L1 while a row decodes: the decode waited on its loads
constexpr int64_t AHEAD = 8;

// The strip [k0, k0 + kn) of weight row j decoded into y (float32), row j + AHEAD's strip prefetched when it
// is below `end`.
inline void decode_strip(int type, const uint8_t* w, int64_t row_bytes, const float* scales, int64_t j,
                         int64_t end, int64_t k0, int64_t kn, float* y) {
    const int64_t be = block_elems(type), bb = block_bytes(type), at = k0 / be * bb;
    if (j + AHEAD < end) {
        const char* later = reinterpret_cast<const char*>(w + (j + AHEAD) * row_bytes + at);
        for (int64_t off = 0; off < kn / be * bb + 63; off += 64) _mm_prefetch(later + off, _MM_HINT_T0);
    }
    decode_row(type, w + j * row_bytes + at, kn, scales ? scales[j] : 1.f, y);
}

// Rows [j0, j0 + valid) of w (zeros up to WIDTH) into panel[kk * WIDTH + c] = w[j0 + c, kk].
void decode_panel(int type, const uint8_t* w, int64_t row_bytes, int64_t k, const float* scales, int64_t j0,
                  int64_t valid, float* strip, float* panel) {
    for (int64_t k0 = 0; k0 < k; k0 += K_STRIP) {
        const int64_t kn = std::min<int64_t>(K_STRIP, k - k0);  // whole blocks: k0 and k are multiples of be
        for (int64_t c = 0; c < WIDTH; ++c) {
            float* dst = strip + c * LD;
            if (c < valid) decode_strip(type, w, row_bytes, scales, j0 + c, j0 + valid, k0, kn, dst);
            else std::fill_n(dst, kn, 0.f);
        }
        int64_t kk = 0;
        for (; kk + LANES <= kn; kk += LANES)
            for (int64_t v = 0; v < VECS; ++v)
                transpose_tile(strip + v * LANES * LD + kk, LD, panel + (k0 + kk) * WIDTH + v * LANES, WIDTH);
        for (; kk < kn; ++kk)  // an int8 row's tail, k not a multiple of the vector
            for (int64_t c = 0; c < WIDTH; ++c) panel[(k0 + kk) * WIDTH + c] = strip[c * LD + kk];
    }
}

#ifdef __AVX512BF16__
constexpr int64_t LD_PAIRS = K_STRIP / 2 + 16;  // a strip row of pairs (32 bits each), padded as LD

// decode_panel in bf16 pairs, rounded to nearest even: pairs[(kk * WIDTH + c) * 2 + e] = w[j0 + c, 2 kk + e]
// (k even). A pair is 32 bits, so a strip of rows of pairs transposes as floats do: half the tiles of
// float32, and the decoded floats never leave L1 (a strip row is rounded as it is decoded).
void decode_pairs(int type, const uint8_t* w, int64_t row_bytes, int64_t k, const float* scales, int64_t j0,
                  int64_t valid, float* strip, uint16_t* pairs) {
    alignas(64) float row[K_STRIP];
    for (int64_t k0 = 0; k0 < k; k0 += K_STRIP) {
        const int64_t kn = std::min<int64_t>(K_STRIP, k - k0), kp = kn / 2;
        for (int64_t c = 0; c < WIDTH; ++c) {
            uint16_t* dst = reinterpret_cast<uint16_t*>(strip + c * LD_PAIRS);
            if (c >= valid) {
                std::fill_n(dst, kn, uint16_t{0});
                continue;
            }
            decode_strip(type, w, row_bytes, scales, j0 + c, j0 + valid, k0, kn, row);
            for (int64_t i = 0; i < kn; i += 16) {
                const __mmask16 m = lanes(kn - i, 0);
                const __m256bh h = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, row + i));
                _mm256_mask_storeu_epi16(dst + i, m, (__m256i)h);
            }
        }
        float* panel = reinterpret_cast<float*>(pairs) + k0 / 2 * WIDTH;  // 32-bit pairs, k-pair-major
        int64_t kk = 0;
        for (; kk + LANES <= kp; kk += LANES)
            for (int64_t v = 0; v < VECS; ++v)
                transpose_tile(strip + v * LANES * LD_PAIRS + kk, LD_PAIRS, panel + kk * WIDTH + v * LANES, WIDTH);
        for (; kk < kp; ++kk)  // an int8 row's tail
            for (int64_t c = 0; c < WIDTH; ++c) panel[kk * WIDTH + c] = strip[c * LD_PAIRS + kk];
    }
}
#endif

// out[r, j] = sum_i x[r, i] w[j, i] (+ bias[j]) for r < m, j < n, w's rows `row_bytes` bytes of blocks of
// `type` (quant_linear.cpp's layout); x float32, or bf16 where `bf16` (k even), out float32, row strides ldx,
// ldo. 0, or 1 for a type/k it cannot read.
int panel_linear(int type, const void* x, int64_t ldx, int64_t m, const void* data, int64_t row_bytes, int64_t n,
                 int64_t k, const float* scales, const float* bias, float* out, int64_t ldo, int num_threads,
                 bool bf16) {
    const int64_t be = block_elems(type);
    if (be == 0 || k <= 0 || k % be != 0 || (type == mixserve::INT8_ROW && scales == nullptr)) return 1;
    if (bf16 && k % 2 != 0) return 1;
    const uint8_t* w = static_cast<const uint8_t*>(data);
    const int64_t count = (n + WIDTH - 1) / WIDTH;
#pragma omp parallel num_threads(num_threads) if (count >= 2 * num_threads)
    {
        std::vector<float> strip(WIDTH * LD), panel(bf16 ? 0 : WIDTH * k);
        std::vector<uint16_t> pairs(bf16 ? WIDTH * k : 0);
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        // Thread t takes panels [count t / nt, count (t + 1) / nt) in fractions: a panel on the boundary is
        // decoded by both threads, each multiplying its share of the rows (9 panels on 2: 4.5 each, not 5 and 4).
        const int64_t begin = count * t, end = count * (t + 1);  // in 1/nt of a panel
        for (int64_t p = begin / nt; p * nt < end; ++p) {
            const int64_t r0 = m * (std::max(begin, p * nt) - p * nt) / nt;
            const int64_t r1 = m * (std::min(end, (p + 1) * nt) - p * nt) / nt;
            if (r1 <= r0) continue;
            const int64_t j0 = p * WIDTH, valid = std::min<int64_t>(WIDTH, n - j0);
            if ((p + 1) * nt < end) {  // the next panel's blocks (contiguous rows) into L2 while this one computes
                const char* next = reinterpret_cast<const char*>(w + (j0 + WIDTH) * row_bytes);
                const int64_t bytes = std::min<int64_t>(WIDTH, n - j0 - WIDTH) * row_bytes;
                for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(next + off, _MM_HINT_T1);
            }
            const float* b = bias ? bias + j0 : nullptr;
            float* o = out + r0 * ldo + j0;
#ifdef __AVX512BF16__
            if (bf16) {
                decode_pairs(type, w, row_bytes, k, scales, j0, valid, strip.data(), pairs.data());
                mixserve_few_row_panel_bf16(static_cast<const uint16_t*>(x) + r0 * ldx, ldx, r1 - r0, pairs.data(),
                                            k, b, o, ldo, valid, reinterpret_cast<const char*>(pairs.data()));
                continue;
            }
#endif
            decode_panel(type, w, row_bytes, k, scales, j0, valid, strip.data(), panel.data());
            mixserve_few_row_panel_f32(static_cast<const float*>(x) + r0 * ldx, ldx, r1 - r0, panel.data(), k, b,
                                       o, ldo, valid, reinterpret_cast<const char*>(panel.data()));
        }
    }
    return 0;
}

}  // namespace
#endif

extern "C" {

// panel_linear on float32 x. 2 where there are no panels (neither AVX-512 nor AVX2 with FMA).
int mixserve_quant_panel_linear(int type, const float* x, int64_t ldx, int64_t m, const void* data,
                                int64_t row_bytes, int64_t n, int64_t k, const float* scales, const float* bias,
                                float* out, int64_t ldo, int num_threads) {
#ifdef MIXSERVE_FEW_ROW_SIMD
    return panel_linear(type, x, ldx, m, data, row_bytes, n, k, scales, bias, out, ldo, num_threads, false);
#else
    return 2;
#endif
}

// panel_linear on bf16 x (torch's bfloat16 bits), the decoded panels rounded to bf16. 2 without AVX512-BF16.
int mixserve_quant_panel_linear_bf16(int type, const uint16_t* x, int64_t ldx, int64_t m, const void* data,
                                     int64_t row_bytes, int64_t n, int64_t k, const float* scales,
                                     const float* bias, float* out, int64_t ldo, int num_threads) {
#ifdef __AVX512BF16__
    return panel_linear(type, x, ldx, m, data, row_bytes, n, k, scales, bias, out, ldo, num_threads, true);
#else
    return 2;
#endif
}

}  // extern "C"
