// The small per-layer ops of the CPU path, each one call where eager PyTorch takes several: RMSNorm with
// the residual add fused in, RoPE in place on q and k, SiLU(gate) * up. float32 and bfloat16 (math in
// float32, rounded where HF's bf16 forward rounds). Rows split across threads only when there are enough
// of them to pay for waking the pool.
#include <omp.h>

#include "common.h"

using namespace mixserve;

namespace {

constexpr int64_t PARALLEL_ELEMENTS = 1 << 16;

// out[t] = norm(x[t] (+ residual[t])) * w; with residual, residual[t] becomes the sum (the stream goes on).
template <typename T>
void rms_norm(const T* x, int64_t x_stride, T* residual, const T* w, T* out, int64_t rows, int64_t hidden,
              float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * hidden >= PARALLEL_ELEMENTS)
    for (int64_t t = 0; t < rows; ++t) {
        const T* xt = x + t * x_stride;
        T* rt = residual ? residual + t * hidden : nullptr;
        T* ot = out + t * hidden;
        float sq = 0.f;
        for (int64_t i = 0; i < hidden; ++i) {
            float v = load(xt + i);
            if (rt) {
                v = round_to(rt, v + load(rt + i));  // HF adds in the model's dtype
                store(rt + i, v);
            }
            sq += v * v;
        }
        const float r = 1.f / std::sqrt(sq / static_cast<float>(hidden) + eps);
        const T* src = rt ? rt : xt;
        // HF: weight * (x * rsqrt(mean(x^2) + eps)).to(dtype), the product in the weight's dtype
        for (int64_t i = 0; i < hidden; ++i) store(ot + i, load(w + i) * round_to(ot, load(src + i) * r));
    }
}

// Rotate-half RoPE in place on the first `heads` heads of each token (q's then k's), at each token's
// position; cos/sin tables hold (max_position, head_dim / 2) in the model's dtype.
template <typename T>
void rotary(T* qk, int64_t stride_t, int64_t stride_h, int64_t rows, int64_t heads, int64_t head_dim,
            const T* cos, const T* sin, const int64_t* positions, int num_threads) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for num_threads(num_threads) if (rows * heads * head_dim >= PARALLEL_ELEMENTS)
    for (int64_t t = 0; t < rows; ++t) {
        const T* c = cos + positions[t] * half;
        const T* s = sin + positions[t] * half;
        for (int64_t h = 0; h < heads; ++h) {
            T* x = qk + t * stride_t + h * stride_h;
            for (int64_t i = 0; i < half; ++i) {
                const float x1 = load(x + i), x2 = load(x + half + i), ci = load(c + i), si = load(s + i);
                store(x + i, x1 * ci - x2 * si);
                store(x + half + i, x2 * ci + x1 * si);
            }
        }
    }
}

// out (rows, inter) = act(gate) * up, where gate_up (rows, 2 * inter) holds gate then up; act is SiLU, or
// with GELU GeGLU's tanh-approximated GELU, written x * sigmoid(2u) = x * (1 + tanh(u)) / 2.
template <typename T, bool GELU = false>
void act_and_mul(const T* gate_up, T* out, int64_t rows, int64_t inter, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * inter >= PARALLEL_ELEMENTS)
    for (int64_t t = 0; t < rows; ++t) {
        const T* g = gate_up + t * 2 * inter;
        const T* u = g + inter;
        T* o = out + t * inter;
        for (int64_t i = 0; i < inter; ++i) {
            const float x = load(g + i);
            // u = sqrt(2 / pi) * (x + 0.044715 x^3): GELU's tanh argument
            const float z = GELU ? 1.5957691216057308f * (x + 0.044715f * x * x * x) : x;
            // HF: act(gate) rounded to the dtype, then the product
            store(o + i, round_to(o, x / (1.f + fast_exp(-z))) * load(u + i));
        }
    }
}

// act_and_mul by dtype code (0 float32, 1 bfloat16); 3 for any other.
template <bool GELU>
int act_and_mul_of(int dtype, const void* gate_up, void* out, int64_t rows, int64_t inter, int num_threads) {
    if (dtype == 0)
        act_and_mul<float, GELU>(static_cast<const float*>(gate_up), static_cast<float*>(out), rows, inter,
                                 num_threads);
    else if (dtype == 1)
        act_and_mul<uint16_t, GELU>(static_cast<const uint16_t*>(gate_up), static_cast<uint16_t*>(out), rows,
                                    inter, num_threads);
    else
        return 3;
    return 0;
}

}  // namespace

extern "C" {

// The vector ISA this library was compiled for (-march), as bits: 1 AVX2 with FMA, 2 AVX-512F, 4 AVX512-BF16,
// 8 AMX-BF16. The code a CPU runs is the build's, not the CPU's flags ($MIXSERVE_KERNEL_MARCH=haswell builds
// the AVX2 code on an AVX-512 machine), so what is fast or exact here is asked of the build.
int mixserve_kernel_isa() {
    int bits = 0;
#if defined(__AVX2__) && defined(__FMA__)
    bits |= 1;
#endif
#ifdef __AVX512F__
    bits |= 2;
#endif
#ifdef __AVX512BF16__
    bits |= 4;
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    bits |= 8;
#endif
    return bits;
}

// dtype: 0 = float32, 1 = bfloat16 (as for the attention kernel). residual may be null (plain RMSNorm).
int mixserve_rms_norm(int dtype, const void* x, int64_t x_stride, void* residual, const void* w, void* out,
                      int64_t rows, int64_t hidden, float eps, int num_threads) {
    if (dtype == 0)
        rms_norm(static_cast<const float*>(x), x_stride, static_cast<float*>(residual),
                 static_cast<const float*>(w), static_cast<float*>(out), rows, hidden, eps, num_threads);
    else if (dtype == 1)
        rms_norm(static_cast<const uint16_t*>(x), x_stride, static_cast<uint16_t*>(residual),
                 static_cast<const uint16_t*>(w), static_cast<uint16_t*>(out), rows, hidden, eps, num_threads);
    else
        return 3;
    return 0;
}

int mixserve_rotary(int dtype, void* qk, int64_t stride_t, int64_t stride_h, int64_t rows, int64_t heads,
                    int64_t head_dim, const void* cos, const void* sin, const int64_t* positions,
                    int num_threads) {
    if (head_dim % 2 != 0) return 1;
    if (dtype == 0)
        rotary(static_cast<float*>(qk), stride_t, stride_h, rows, heads, head_dim, static_cast<const float*>(cos),
               static_cast<const float*>(sin), positions, num_threads);
    else if (dtype == 1)
        rotary(static_cast<uint16_t*>(qk), stride_t, stride_h, rows, heads, head_dim,
               static_cast<const uint16_t*>(cos), static_cast<const uint16_t*>(sin), positions, num_threads);
    else
        return 3;
    return 0;
}

int mixserve_silu_and_mul(int dtype, const void* gate_up, void* out, int64_t rows, int64_t inter,
                          int num_threads) {
    return act_and_mul_of<false>(dtype, gate_up, out, rows, inter, num_threads);
}

int mixserve_gelu_tanh_and_mul(int dtype, const void* gate_up, void* out, int64_t rows, int64_t inter,
                               int num_threads) {
    return act_and_mul_of<true>(dtype, gate_up, out, rows, inter, num_threads);
}

}  // extern "C"
