// Linears on quantized weights read in place (GGUF blocks, int8 per channel): out = x @ w.T + bias for few
// rows, and rows of w decoded to float32 (the embedding lookup; prefill chunks' tiles are decoded into the
// few-row kernel's panels instead: quant_panels.cpp).
//
// A decode step is bound by the bytes it reads, so the weight stays in its blocks: a thread walks its own run
// of output columns (rows of w, contiguous in the file), prefetching the rows ahead: up to ROW_WALK_ROWS input
// rows a weight row at a time (quant_row_walk.h), more two weight rows a block at a time. The GGUF formats
// decode each block in registers and multiply it there (quant_fused.h), int8 per channel too where k is a
// multiple of 32; other int8 rows decode COLS rows into float32 in L1 and dot them with every input row from there.
// Either way the products are float32 on the decoded weights, so the result equals dequantize-then-matmul up to
// float32 rounding. The integer dots on int8-rounded inputs (quant_dot.h, llama.cpp's way) are the opt-in
// `int8_activations` (docs/decisions/int8-activations.md).
#include <omp.h>
#include <stdint.h>

#include <algorithm>
#include <vector>

#include "few_row_simd.h"
#include "quant_blocks.h"
#include "quant_dot.h"
#include "quant_fused.h"
#include "quant_row_walk.h"

using mixserve::block_bytes;
using mixserve::block_elems;
using mixserve::decode_row;

extern "C" int mixserve_quant_panel_linear(int type, const float* x, int64_t ldx, int64_t m, const void* data,
                                           int64_t row_bytes, int64_t n, int64_t k, const float* scales,
                                           const float* bias, float* out, int64_t ldo, int num_threads);

extern "C" int mixserve_quant_int8_panel_linear(int type, const float* x, int64_t ldx, int64_t m, const void* data,
                                                int64_t row_bytes, int64_t n, int64_t k, const float* scales,
                                                const float* bias, float* out, int64_t ldo, int num_threads);

namespace {

constexpr int COLS = 4;  // weight rows decoded and dotted together: 4 chains of sums even for one input row
// From this many rows a product takes the decoded panels (quant_panels.cpp) instead: the block kernel decodes
// its blocks again for every pass of a few rows. Where the two crossed on 30 layers of Q4_1 and Q8_0
// (bench/quant_rows.py): AVX-512 (8-row passes) at 28 rows, AVX2 (2-row passes in 16 registers) at 6.
#if defined(__AVX512F__)
constexpr int64_t PANEL_ROWS = 28;
#else
constexpr int64_t PANEL_ROWS = 6;
#endif
// From this many rows int8 inputs take the VNNI panels (quant_int8_panels.cpp), where the kernels have them:
// where they crossed the block kernel on 30 layers of Q4_1 (docs/decisions/int8-activations.md)
constexpr int64_t INT8_PANEL_ROWS = 6;
constexpr int PREFETCH_GROUPS = 2;  // how many groups of COLS rows ahead the float path prefetches
// Up to this many input rows (a decode step verifying up to 4 drafts) the block kernels walk a weight row at a
// time (quant_row_walk.h), asking for STREAM_AHEAD bytes beyond it; from 6 rows (AVX2 too) the pair walk's
// shared input loads win (docs/decisions/quantized-weights-in-place.md)
constexpr int64_t ROW_WALK_ROWS = 5, STREAM_AHEAD = 2048;

#ifdef MIXSERVE_FEW_ROW_SIMD
#if defined(__AVX512F__)
inline float vsum(Vf v) { return _mm512_reduce_add_ps(v); }
#else
inline float vsum(Vf v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}
#endif
// Input rows a pass keeps sums for: COLS x ROWS vectors, COLS weight loads and one input load beside them
constexpr int MAX_PASS_ROWS = VREGS >= 32 ? 4 : 2;
#else
constexpr int MAX_PASS_ROWS = 4;
#endif

// sums[c][r] = dot(w[c], x[r]) over k, for `cols` decoded weight rows (stride k) and ROWS input rows.
template <int ROWS>
void dot_pass(const float* w, int cols, const float* x, int64_t ldx, int64_t k, float (*sums)[MAX_PASS_ROWS]) {
    int64_t i = 0;
#ifdef MIXSERVE_FEW_ROW_SIMD
    Vf acc[COLS][ROWS];
    for (int c = 0; c < COLS; ++c)
        for (int r = 0; r < ROWS; ++r) acc[c][r] = vzero();
    for (; i + LANES <= k; i += LANES) {
        Vf xv[ROWS];
        for (int r = 0; r < ROWS; ++r) xv[r] = vload(x + r * ldx + i);
        for (int c = 0; c < COLS; ++c) {
            const Vf wv = vload(w + c * k + i);  // rows past `cols` are zeros: decoded so by the caller
            for (int r = 0; r < ROWS; ++r) acc[c][r] = vfmadd(wv, xv[r], acc[c][r]);
        }
    }
    for (int c = 0; c < cols; ++c)
        for (int r = 0; r < ROWS; ++r) sums[c][r] = vsum(acc[c][r]);
#else
    for (int c = 0; c < cols; ++c)
        for (int r = 0; r < ROWS; ++r) sums[c][r] = 0.f;
#endif
    for (; i < k; ++i)  // the tail of an int8 row whose k is not a multiple of the vector
        for (int c = 0; c < cols; ++c)
            for (int r = 0; r < ROWS; ++r) sums[c][r] += w[c * k + i] * x[r * ldx + i];
}

void dot_rows(int rows, const float* w, int cols, const float* x, int64_t ldx, int64_t k,
              float (*sums)[MAX_PASS_ROWS]) {
    switch (rows) {
        case 1: return dot_pass<1>(w, cols, x, ldx, k, sums);
#if MAX_PASS_ROWS > 2
        case 2: return dot_pass<2>(w, cols, x, ldx, k, sums);
        case 3: return dot_pass<3>(w, cols, x, ldx, k, sums);
#endif
        default: return dot_pass<MAX_PASS_ROWS>(w, cols, x, ldx, k, sums);
    }
}

// The few-row products' thread split: output columns in pairs, contiguous runs a thread (one stream each),
// rows in passes of R; pass(rows, j0, cols, r0, sums) fills sums[c][r] for columns j0.. and rows r0...
template <int R, typename Pass>
void column_pairs(int64_t m, int64_t n, const float* bias, float* out, int64_t ldo, int num_threads, Pass&& pass) {
    constexpr int PAIR = 2;
    const int64_t groups = (n + PAIR - 1) / PAIR;
#pragma omp parallel num_threads(num_threads) if (groups >= 8 * num_threads)
    {
        float sums[PAIR][8];
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        for (int64_t g = groups * t / nt; g < groups * (t + 1) / nt; ++g) {
            const int64_t j0 = g * PAIR;
            const int cols = static_cast<int>(std::min<int64_t>(PAIR, n - j0));
            for (int64_t r0 = 0; r0 < m; r0 += R) {
                const int rn = static_cast<int>(std::min<int64_t>(R, m - r0));
                pass(rn, j0, cols, r0, sums);
                for (int c = 0; c < cols; ++c)
                    for (int r = 0; r < rn; ++r)
                        out[(r0 + r) * ldo + j0 + c] = sums[c][r] + (bias ? bias[j0 + c] : 0.f);
            }
        }
    }
}

#ifdef MIXSERVE_QUANT_DOT
bool int8_dot_type(int type) {
    return type == mixserve::Q4_0 || type == mixserve::Q4_1 || type == mixserve::Q5_0 || type == mixserve::Q5_1 ||
           type == mixserve::Q8_0 || type == mixserve::Q4_K || type == mixserve::Q5_K || type == mixserve::Q6_K;
}
// With int8 inputs: those formats, and int8 per channel in runs of 32
bool int8_dot_takes(int type, int64_t k) {
    return int8_dot_type(type) || (type == mixserve::INT8_ROW && k % 32 == 0);
}

// The integer-dot product (quant_dot.h): the input rows quantized once, then columns in pairs, rows in fours;
// int8 per channel's row scales applied to the sums.
void linear_int8_dot(int type, const float* x, int64_t ldx, int64_t m, const uint8_t* w, int64_t row_bytes,
                     int64_t n, int64_t k, const float* scales, const float* bias, float* out, int64_t ldo,
                     int num_threads) {
    constexpr int PAIR = 2;
    const int64_t nb = k / 32;
    std::vector<int8_t> xq(m * k);
    std::vector<float> xd(m * nb), xs(m * nb);
    std::vector<mixserve::RowQ8> rows(m);
    for (int64_t r = 0; r < m; ++r) {
        mixserve::quantize_row_q8(x + r * ldx, k, xq.data() + r * k, xd.data() + r * nb, xs.data() + r * nb);
        rows[r] = {xq.data() + r * k, xd.data() + r * nb, xs.data() + r * nb};
    }
    if (m == 1) {  // one weight row after another, a run of rows a thread, as the float one-row product
#pragma omp parallel for num_threads(num_threads) schedule(static) if (n >= 16 * num_threads)
        for (int64_t j = 0; j < n; ++j) {
            float sums[1][8];
            mixserve::q8_rows<1>(1, type, w + j * row_bytes, row_bytes, 1, rows.data(), nb, sums);
            out[j] = sums[0][0] * (type == mixserve::INT8_ROW ? scales[j] : 1.f) + (bias ? bias[j] : 0.f);
        }
        return;
    }
    column_pairs<4>(m, n, bias, out, ldo, num_threads, [&](int rn, int64_t j0, int cols, int64_t r0, auto sums) {
        mixserve::q8_rows<PAIR>(rn, type, w + j0 * row_bytes, row_bytes, cols, rows.data() + r0, nb, sums);
        if (type == mixserve::INT8_ROW)
            for (int c = 0; c < cols; ++c)
                for (int r = 0; r < rn; ++r) sums[c][r] *= scales[j0 + c];
    });
}
#endif

#ifdef MIXSERVE_QUANT_FUSED
// The float32 product with each block decoded in registers (quant_fused.h): columns in pairs.
// int8 per channel in runs of 32 (k a multiple of 32), its row scales applied to the sums.
bool fused_type(int type, int64_t k) {
    return int8_dot_type(type) || (type == mixserve::INT8_ROW && k % 32 == 0);
}

void linear_fused(int type, const float* x, int64_t ldx, int64_t m, const uint8_t* w, int64_t row_bytes,
                  int64_t n, int64_t k, const float* scales, const float* bias, float* out, int64_t ldo,
                  int num_threads) {
    const int64_t nb = k / (type == mixserve::INT8_ROW ? 32 : mixserve::block_elems(type));
    column_pairs<mixserve::FUSED_ROWS>(m, n, bias, out, ldo, num_threads,
                                       [&](int rn, int64_t j0, int cols, int64_t r0, auto sums) {
        mixserve::fused_rows(type, rn, w + j0 * row_bytes, row_bytes, cols, x + r0 * ldx, ldx, nb, sums);
        if (type == mixserve::INT8_ROW)
            for (int c = 0; c < cols; ++c)
                for (int r = 0; r < rn; ++r) sums[c][r] *= scales[j0 + c];
    });
}
#endif

// Where a type's rows can be read: k a whole number of blocks (INT8_ROW: scales present).
bool valid(int type, int64_t k, const float* scales) {
    const int be = block_elems(type);
    if (be == 0 || k <= 0 || k % be != 0) return false;
    return type != mixserve::INT8_ROW || scales != nullptr;
}

}  // namespace

extern "C" {

// out[r, j] = sum_i x[r, i] w[j, i] (+ bias[j]) for r < m, j < n; w's row j is `row_bytes` bytes of blocks
// from data + j * row_bytes. x, out float32 with row strides ldx, ldo. 0, or 1 for a type/k it cannot read.
// int8_inputs: where int8_dot_takes, integer dots on the inputs rounded to int8 (from INT8_PANEL_ROWS rows
// the int8 panels); else float32 products on the decoded weights (from PANEL_ROWS rows the panels').
int mixserve_quant_linear(int type, const float* x, int64_t ldx, int64_t m, const void* data, int64_t row_bytes,
                          int64_t n, int64_t k, const float* scales, const float* bias, float* out, int64_t ldo,
                          int int8_inputs, int num_threads) {
    if (!valid(type, k, scales)) return 1;
    const uint8_t* w = static_cast<const uint8_t*>(data);
#ifdef MIXSERVE_QUANT_DOT
    if (int8_inputs && int8_dot_takes(type, k)) {
        if (m >= INT8_PANEL_ROWS && mixserve_quant_int8_panel_linear(type, x, ldx, m, data, row_bytes, n, k, scales,
                                                                     bias, out, ldo, num_threads) == 0)
            return 0;
        linear_int8_dot(type, x, ldx, m, w, row_bytes, n, k, scales, bias, out, ldo, num_threads);
        return 0;
    }
#endif
#ifdef MIXSERVE_FEW_ROW_SIMD
    if (m >= PANEL_ROWS)
        return mixserve_quant_panel_linear(type, x, ldx, m, data, row_bytes, n, k, scales, bias, out, ldo,
                                           num_threads);
#endif
#ifdef MIXSERVE_QUANT_FUSED
    if (fused_type(type, k) && m <= ROW_WALK_ROWS) {
        mixserve::row_walk_linear(type, x, ldx, m, w, row_bytes, n, k, scales, bias, out, ldo, num_threads,
                                  STREAM_AHEAD);
        return 0;
    }
    if (fused_type(type, k)) {
        linear_fused(type, x, ldx, m, w, row_bytes, n, k, scales, bias, out, ldo, num_threads);
        return 0;
    }
#endif
    const int64_t groups = (n + COLS - 1) / COLS;
#pragma omp parallel num_threads(num_threads) if (groups >= 4 * num_threads)
    {
        std::vector<float> decoded(COLS * k);
        float sums[COLS][MAX_PASS_ROWS];
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        for (int64_t g = groups * t / nt; g < groups * (t + 1) / nt; ++g) {  // contiguous: one stream a thread
            const int64_t j0 = g * COLS;
            const int cols = static_cast<int>(std::min<int64_t>(COLS, n - j0));
            // the next groups' rows into L1 while this one computes: one stream a thread does not keep the
            // memory busy on its own
            const int64_t ahead = std::min<int64_t>(n, j0 + (PREFETCH_GROUPS + 1) * COLS);
            for (int64_t j = j0 + PREFETCH_GROUPS * COLS; j < ahead; ++j)
                for (int64_t off = 0; off < row_bytes; off += 64)
                    _mm_prefetch(reinterpret_cast<const char*>(w + j * row_bytes + off), _MM_HINT_T0);
            for (int c = 0; c < COLS; ++c) {
                if (c < cols)
                    decode_row(type, w + (j0 + c) * row_bytes, k, scales ? scales[j0 + c] : 1.f,
                               decoded.data() + c * k);
                else
                    std::fill_n(decoded.data() + c * k, k, 0.f);
            }
            for (int64_t r0 = 0; r0 < m; r0 += MAX_PASS_ROWS) {
                const int rows = static_cast<int>(std::min<int64_t>(MAX_PASS_ROWS, m - r0));
                dot_rows(rows, decoded.data(), cols, x + r0 * ldx, ldx, k, sums);
                for (int c = 0; c < cols; ++c)
                    for (int r = 0; r < rows; ++r)
                        out[(r0 + r) * ldo + j0 + c] = sums[c][r] + (bias ? bias[j0 + c] : 0.f);
            }
        }
    }
    return 0;
}

// out[i, :] = w's row ids[i] (ids null: row first + i) decoded to float32, for i < count; out's row stride ldo.
int mixserve_quant_decode_rows(int type, const void* data, int64_t row_bytes, int64_t k, const float* scales,
                               const int64_t* ids, int64_t first, int64_t count, float* out, int64_t ldo,
                               int num_threads) {
    if (!valid(type, k, scales)) return 1;
    const uint8_t* w = static_cast<const uint8_t*>(data);
#pragma omp parallel for num_threads(num_threads) if (count * k >= (1 << 16)) schedule(static)
    for (int64_t i = 0; i < count; ++i) {
        const int64_t j = ids ? ids[i] : first + i;
        decode_row(type, w + j * row_bytes, k, scales ? scales[j] : 1.f, out + i * ldo);
    }
    return 0;
}

}  // extern "C"
