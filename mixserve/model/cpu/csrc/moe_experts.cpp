// A mixture-of-experts layer's experts in one call, for the experts whose rows the few-row kernels take.
//
// The rows arrive sorted by expert (moe.SparseMlp.grouped); each expert runs gate/up, the gated activation
// and down on its run of them, with the same kernels the Python loop calls (few_row_linear.cpp's panels or
// quant_linear.cpp's blocks), so the output is bit-identical. What goes is the loop's ~5 Python calls an
// expert, which on a decode step of a many-expert model cost about what the experts' weights take to read.

#include <cstdint>

#include "quant_spec.h"

extern "C" {
int mixserve_few_row_linear(int dtype, const void* x, int64_t ldx, int64_t m, const void* panels, int64_t n,
                            int64_t k, const void* bias, void* out, int64_t ldo, int num_threads);
int mixserve_silu_and_mul(int dtype, const void* gate_up, void* out, int64_t rows, int64_t inter, int num_threads);
int mixserve_gelu_tanh_and_mul(int dtype, const void* gate_up, void* out, int64_t rows, int64_t inter,
                               int num_threads);
}

namespace {

// One expert's linear: float panels (few_row_linear.PanelWeight) or quantized blocks (QuantWeight).
struct ExpertLinear {
    int64_t quantized;  // 0: panels, 1: quant
    int64_t n, k;
    int64_t max_rows;  // the most rows its kernel takes
    const void* panels;
    mixserve::QuantLinearSpec quant;
};

int expert_linear(const ExpertLinear& w, int dtype, const void* x, int64_t m, void* out, int threads) {
    if (w.quantized)
        return mixserve::quant_linear(w.quant, static_cast<const float*>(x), m, static_cast<float*>(out), 0,
                                      threads);
    return mixserve_few_row_linear(dtype, x, w.k, m, w.panels, w.n, w.k, nullptr, out, w.n, threads);
}

}  // namespace

extern "C" {

// rows (bounds[E], hidden) in `dtype` (0 float32, 1 bf16; quantized experts: float32), expert e's run of
// them [bounds[e], bounds[e + 1]); out, gate_up_buf (rows, 2 inter) and act_buf (rows, inter) alike. Each
// expert whose run both its linears take is computed into out and marked done[e] = 1; the others are left
// to the caller (done[e] = 0). 0, or the failing kernel's code.
int mixserve_moe_experts(const ExpertLinear* gate_up, const ExpertLinear* down, int64_t num_experts,
                         const int64_t* bounds, int dtype, const void* rows, void* gate_up_buf, void* act_buf,
                         void* out, int64_t hidden, int64_t inter, int gelu, uint8_t* done, int threads) {
    const int64_t elem = dtype == 0 ? 4 : 2;
    const char* x = static_cast<const char*>(rows);
    char* gu = static_cast<char*>(gate_up_buf);
    char* act = static_cast<char*>(act_buf);
    char* y = static_cast<char*>(out);
    for (int64_t e = 0; e < num_experts; ++e) {
        const int64_t a = bounds[e], m = bounds[e + 1] - a;
        done[e] = 0;
        if (m == 0) {
            done[e] = 1;
            continue;
        }
        if (m > gate_up[e].max_rows || m > down[e].max_rows) continue;
        int rc = expert_linear(gate_up[e], dtype, x + a * hidden * elem, m, gu + a * 2 * inter * elem, threads);
        if (rc == 0)
            rc = gelu ? mixserve_gelu_tanh_and_mul(dtype, gu + a * 2 * inter * elem, act + a * inter * elem, m,
                                                   inter, threads)
                      : mixserve_silu_and_mul(dtype, gu + a * 2 * inter * elem, act + a * inter * elem, m, inter,
                                              threads);
        if (rc == 0) rc = expert_linear(down[e], dtype, act + a * inter * elem, m, y + a * hidden * elem, threads);
        if (rc != 0) return rc;
        done[e] = 1;
    }
    return 0;
}

}  // extern "C"
