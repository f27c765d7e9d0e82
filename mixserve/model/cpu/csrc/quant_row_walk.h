// The products of up to a few input rows (a single stream's decode step, one verifying its drafts) on a
// quantized weight, in float32: each thread walks its run of weight rows one after another, the whole row
// before the next (one input row: two blocks of 32 at a time into four sums), and asks for the bytes
// `ahead` beyond the row it is on. Against the pair walk (quant_fused.h's fused_pass, two weight rows a block
// at a time) the same decode and multiply-adds ran 1.4-1.6x faster at one row and the default model's
// shapes (docs/decisions/quantized-weights-in-place.md).
#pragma once
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#include <algorithm>

#include "quant_fused.h"

#ifdef MIXSERVE_QUANT_FUSED

namespace mixserve {

// dot(weight row `row`, x) over nb blocks of a 32-element format (Q4_0 .. Q8_0, INT8_ROW unscaled)
template <int TYPE>
inline float one_row_dot32(const uint8_t* row, const float* x, int64_t nb) {
    const int64_t BB = TYPE == INT8_ROW ? 32 : block_bytes(TYPE);
    Vf acc[4] = {vzero(), vzero(), vzero(), vzero()};
    const auto block = [&](const uint8_t* b, const float* xb, Vf& lo_sum, Vf& hi_sum) {
        Vf lo[V16], hi[V16];
        block_weights<TYPE>(b, lo, hi);
        for (int v = 0; v < V16; ++v) {
            lo_sum = vfmadd(lo[v], vload(xb + LANES * v), lo_sum);
            hi_sum = vfmadd(hi[v], vload(xb + 16 + LANES * v), hi_sum);
        }
    };
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {  // two blocks: four chains of sums in flight
        block(row + b * BB, x + 32 * b, acc[0], acc[1]);
        block(row + (b + 1) * BB, x + 32 * b + 32, acc[2], acc[3]);
    }
    if (b < nb) block(row + b * BB, x + 32 * b, acc[0], acc[1]);
    return fused_hsum(vadd(vadd(acc[0], acc[1]), vadd(acc[2], acc[3])));
}

// dot(weight row `row`, x row r) for r < R (R > 1) over nb blocks of a 32-element format, into sums[r]:
// each block decoded once for the R rows, two chains of sums a row
template <int TYPE, int R>
inline void rows_dot32(const uint8_t* row, const float* x, int64_t ldx, int64_t nb, float* sums) {
    const int64_t BB = TYPE == INT8_ROW ? 32 : block_bytes(TYPE);
    Vf acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = vzero();
    for (int64_t b = 0; b < nb; ++b) {
        Vf lo[V16], hi[V16];
        block_weights<TYPE>(row + b * BB, lo, hi);
        for (int r = 0; r < R; ++r)
            for (int v = 0; v < V16; ++v) {
                acc[r][0] = vfmadd(lo[v], vload(x + r * ldx + 32 * b + LANES * v), acc[r][0]);
                acc[r][1] = vfmadd(hi[v], vload(x + r * ldx + 32 * b + 16 + LANES * v), acc[r][1]);
            }
    }
    for (int r = 0; r < R; ++r) sums[r] = fused_hsum(vadd(acc[r][0], acc[r][1]));
}

// dot(weight row `row`, x row r) for r < R over nb super-blocks of Q4_K / Q5_K / Q6_K, into sums[r]
template <int TYPE, int R>
inline void rows_dot256(const uint8_t* row, const float* x, int64_t ldx, int64_t nb, float* sums) {
    constexpr int H = R > 4 ? 1 : 2;
    Vf acc[R][H];
    for (int r = 0; r < R; ++r)
        for (int h = 0; h < H; ++h) acc[r][h] = vzero();
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = row + b * block_bytes(TYPE);
        if constexpr (TYPE == Q6_K) q6_k_block<R, H>(blk, x + 256 * b, ldx, acc);
        else q4_k_block<R, H, TYPE == Q5_K>(blk, x + 256 * b, ldx, acc);
    }
    for (int r = 0; r < R; ++r) sums[r] = fused_hsum(H == 2 ? vadd(acc[r][0], acc[r][H - 1]) : acc[r][0]);
}

template <int TYPE, int R>
inline void row_sums(const uint8_t* row, const float* x, int64_t ldx, int64_t nb, float* sums) {
    if constexpr (block_elems_of(TYPE) == 256) rows_dot256<TYPE, R>(row, x, ldx, nb, sums);
    else if constexpr (R == 1) sums[0] = one_row_dot32<TYPE>(row, x, nb);
    else rows_dot32<TYPE, R>(row, x, ldx, nb, sums);
}

// sums[r] = dot(weight row, x row r) for `rows` (<= FUSED_ROWS) input rows
template <int TYPE>
inline void row_sums_of(int rows, const uint8_t* row, const float* x, int64_t ldx, int64_t nb, float* sums) {
    with_rows<FUSED_ROWS>(rows, [&](auto r) { row_sums<TYPE, decltype(r)::value>(row, x, ldx, nb, sums); });
}

// out[r, j] = dot(w row j, x row r) (x scales[j] for INT8_ROW) + bias[j] for r < m, j < n: threads split
// the weight rows in runs; the input rows in passes of FUSED_ROWS, a weight row's bytes from L1 after the first.
template <int TYPE>
void row_walk_linear_of(const float* x, int64_t ldx, int64_t m, const uint8_t* w, int64_t row_bytes, int64_t n,
                        int64_t k, const float* scales, const float* bias, float* out, int64_t ldo,
                        int num_threads, int64_t ahead) {
    const int64_t nb = k / (block_elems_of(TYPE) == 256 ? 256 : 32);
#pragma omp parallel num_threads(num_threads) if (n >= 16 * num_threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t j0 = n * t / nt, j1 = n * (t + 1) / nt, end = j1 * row_bytes;
        float sums[FUSED_ROWS];
        for (int64_t j = j0, asked = j0 * row_bytes; j < j1; ++j) {
            for (const int64_t until = std::min(end, (j + 1) * row_bytes + ahead); asked < until; asked += 64)
                _mm_prefetch(reinterpret_cast<const char*>(w + asked), _MM_HINT_T0);
            const float scale = TYPE == INT8_ROW ? scales[j] : 1.f, add = bias ? bias[j] : 0.f;
            for (int64_t r0 = 0; r0 < m; r0 += FUSED_ROWS) {
                const int rows = static_cast<int>(std::min<int64_t>(FUSED_ROWS, m - r0));
                row_sums_of<TYPE>(rows, w + j * row_bytes, x + r0 * ldx, ldx, nb, sums);
                for (int r = 0; r < rows; ++r) out[(r0 + r) * ldo + j] = sums[r] * scale + add;
            }
        }
    }
}

// row_walk_linear_of for a format known at run time (those fused_rows takes)
inline void row_walk_linear(int type, const float* x, int64_t ldx, int64_t m, const uint8_t* w, int64_t row_bytes,
                            int64_t n, int64_t k, const float* scales, const float* bias, float* out, int64_t ldo,
                            int num_threads, int64_t ahead) {
#define MIXSERVE_ROW_WALK(T) \
    row_walk_linear_of<T>(x, ldx, m, w, row_bytes, n, k, scales, bias, out, ldo, num_threads, ahead)
    switch (type) {
        case Q4_0: return MIXSERVE_ROW_WALK(Q4_0);
        case Q4_1: return MIXSERVE_ROW_WALK(Q4_1);
        case Q5_0: return MIXSERVE_ROW_WALK(Q5_0);
        case Q5_1: return MIXSERVE_ROW_WALK(Q5_1);
        case Q4_K: return MIXSERVE_ROW_WALK(Q4_K);
        case Q5_K: return MIXSERVE_ROW_WALK(Q5_K);
        case Q6_K: return MIXSERVE_ROW_WALK(Q6_K);
        case INT8_ROW: return MIXSERVE_ROW_WALK(INT8_ROW);
        default: return MIXSERVE_ROW_WALK(Q8_0);
    }
#undef MIXSERVE_ROW_WALK
}

}  // namespace mixserve

#endif
