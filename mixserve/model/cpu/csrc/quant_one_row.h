// The product of ONE input row (a single stream's decode step) on a quantized weight, in float32: each thread
// walks its run of weight rows one after another, the whole row before the next, two blocks of 32 at a time
// into four sums, and asks for the bytes STREAM_AHEAD beyond the row it is on. Against the pair walk
// (quant_fused.h's fused_pass, two rows a block at a time) the same decode and multiply-adds ran 1.4-1.6x
// faster at the default model's shapes (docs/decisions/quantized-weights-in-place.md).
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
    constexpr bool SIGNED = TYPE == Q8_0 || TYPE == INT8_ROW;
    const int64_t BB = TYPE == INT8_ROW ? 32 : block_bytes(TYPE);
    Vf acc[4] = {vzero(), vzero(), vzero(), vzero()};
    const auto block = [&](const uint8_t* b, const float* xb, Vf& lo_sum, Vf& hi_sum) {
        const Block32 q = block32<TYPE>(b);
        const Vf d = vbroadcast(q.d), m = vbroadcast(q.m);
        Vf lo[V16], hi[V16];
        weights16<SIGNED>(q.lo, d, m, lo);
        weights16<SIGNED>(q.hi, d, m, hi);
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

// dot(weight row `row`, x) over nb super-blocks of Q4_K / Q5_K / Q6_K
template <int TYPE>
inline float one_row_dot256(const uint8_t* row, const float* x, int64_t nb) {
    Vf acc[1][2] = {{vzero(), vzero()}};
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = row + b * block_bytes(TYPE);
        if constexpr (TYPE == Q6_K) q6_k_block<1, 2>(blk, x + 256 * b, 0, acc);
        else q4_k_block<1, 2, TYPE == Q5_K>(blk, x + 256 * b, 0, acc);
    }
    return fused_hsum(vadd(acc[0][0], acc[0][1]));
}

// out[j] = dot(w row j, x) (x scales[j] for INT8_ROW) + bias[j] for j < n: threads split the rows in runs.
template <int TYPE>
void one_row_linear_of(const float* x, const uint8_t* w, int64_t row_bytes, int64_t n, int64_t k,
                       const float* scales, const float* bias, float* out, int num_threads, int64_t ahead) {
    const int64_t nb = k / (block_elems_of(TYPE) == 256 ? 256 : 32);
#pragma omp parallel num_threads(num_threads) if (n >= 16 * num_threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t j0 = n * t / nt, j1 = n * (t + 1) / nt, end = j1 * row_bytes;
        for (int64_t j = j0, asked = j0 * row_bytes; j < j1; ++j) {
            for (const int64_t until = std::min(end, (j + 1) * row_bytes + ahead); asked < until; asked += 64)
                _mm_prefetch(reinterpret_cast<const char*>(w + asked), _MM_HINT_T0);
            const uint8_t* row = w + j * row_bytes;
            float s;
            if constexpr (block_elems_of(TYPE) == 256) s = one_row_dot256<TYPE>(row, x, nb);
            else s = one_row_dot32<TYPE>(row, x, nb);
            if constexpr (TYPE == INT8_ROW) s *= scales[j];
            out[j] = s + (bias ? bias[j] : 0.f);
        }
    }
}

// one_row_linear_of for a format known at run time (those fused_rows takes)
inline void one_row_linear(int type, const float* x, const uint8_t* w, int64_t row_bytes, int64_t n, int64_t k,
                           const float* scales, const float* bias, float* out, int num_threads, int64_t ahead) {
    switch (type) {
        case Q4_0: return one_row_linear_of<Q4_0>(x, w, row_bytes, n, k, scales, bias, out, num_threads, ahead);
        case Q4_1: return one_row_linear_of<Q4_1>(x, w, row_bytes, n, k, scales, bias, out, num_threads, ahead);
        case Q5_0: return one_row_linear_of<Q5_0>(x, w, row_bytes, n, k, scales, bias, out, num_threads, ahead);
        case Q5_1: return one_row_linear_of<Q5_1>(x, w, row_bytes, n, k, scales, bias, out, num_threads, ahead);
        case Q4_K: return one_row_linear_of<Q4_K>(x, w, row_bytes, n, k, scales, bias, out, num_threads, ahead);
        case Q5_K: return one_row_linear_of<Q5_K>(x, w, row_bytes, n, k, scales, bias, out, num_threads, ahead);
        case Q6_K: return one_row_linear_of<Q6_K>(x, w, row_bytes, n, k, scales, bias, out, num_threads, ahead);
        case INT8_ROW:
            return one_row_linear_of<INT8_ROW>(x, w, row_bytes, n, k, scales, bias, out, num_threads, ahead);
        default: return one_row_linear_of<Q8_0>(x, w, row_bytes, n, k, scales, bias, out, num_threads, ahead);
    }
}

}  // namespace mixserve

#endif
