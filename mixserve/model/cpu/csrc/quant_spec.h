// A quantized linear as the C++ callers of quant_linear.cpp hold it (quant_linear.QuantWeight: segments of
// one format each), and its product: the layer stack (decode_layers.cpp) and the experts (moe_experts.cpp).
#pragma once
#include <cstdint>

extern "C" int mixserve_quant_linear(int type, const float* x, int64_t ldx, int64_t m, const void* data,
                                     int64_t row_bytes, int64_t n, int64_t k, const float* scales,
                                     const float* bias, float* out, int64_t ldo, int int8_inputs,
                                     int num_threads);

namespace mixserve {

constexpr int MAX_SEGMENTS = 4;  // a fused q/k/v of three formats is the most a weight has

// A quantized weight (quant_linear.QuantWeight): n output rows in segments of one format each.
struct QuantLinearSpec {
    int64_t n, k;
    int64_t segments;
    int64_t types[MAX_SEGMENTS];
    const void* data[MAX_SEGMENTS];
    int64_t row_bytes[MAX_SEGMENTS];
    int64_t rows[MAX_SEGMENTS];
    const float* scales[MAX_SEGMENTS];  // int8 per channel only
    const float* bias;                  // null: none
};

// out (m, n) = x (m, k) @ w.T (+ bias), segment by segment; 0 or the kernel's code
inline int quant_linear(const QuantLinearSpec& w, const float* x, int64_t m, float* out, int int8, int threads) {
    int64_t col = 0;
    for (int64_t s = 0; s < w.segments; ++s) {
        const int rc = mixserve_quant_linear(static_cast<int>(w.types[s]), x, w.k, m, w.data[s], w.row_bytes[s],
                                             w.rows[s], w.k, w.scales[s], w.bias ? w.bias + col : nullptr,
                                             out + col, w.n, int8, threads);
        if (rc != 0) return rc;
        col += w.rows[s];
    }
    return 0;
}

}  // namespace mixserve
