// A mixture-of-experts layer's experts in one call, for the experts whose rows the few-row kernels take.
//
// The rows arrive sorted by expert (moe.SparseMlp.grouped); each expert runs gate/up, the gated activation
// and down on its run of them, with the same kernels the Python loop calls (few_row_linear.cpp's panels or
// quant_linear.cpp's blocks), so the output is bit-identical. What goes is the loop's ~5 Python calls an
// expert, which on a decode step of a many-expert model cost about what the experts' weights take to read.

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common.h"
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

// One expert's gate/up, activation and down on its run of rows [a, a + m), on `threads` threads.
int run_expert(const ExpertLinear& gate_up, const ExpertLinear& down, int dtype, int64_t a, int64_t m,
               const char* x, char* gu, char* act, char* y, int64_t hidden, int64_t inter, int gelu, int threads) {
    const int64_t elem = dtype == 0 ? 4 : 2;
    char* g = gu + a * 2 * inter * elem;
    char* h = act + a * inter * elem;
    int rc = expert_linear(gate_up, dtype, x + a * hidden * elem, m, g, threads);
    if (rc == 0)
        rc = gelu ? mixserve_gelu_tanh_and_mul(dtype, g, h, m, inter, threads)
                  : mixserve_silu_and_mul(dtype, g, h, m, inter, threads);
    if (rc == 0) rc = expert_linear(down, dtype, h, m, y + a * hidden * elem, threads);
    return rc;
}

// Experts with fewer rows than this run one to a thread, side by side, each kernel on one thread: a few
// rows' products are bound by reading the weights, and two streams with no barrier between experts read
// them faster than every thread on one expert after another. Larger runs take every thread each.
constexpr int64_t SHARED_ROWS = 32;

}  // namespace

extern "C" {

// rows (bounds[E], hidden) in `dtype` (0 float32, 1 bf16; quantized experts: float32), expert e's run of
// them [bounds[e], bounds[e + 1]); out, gate_up_buf (rows, 2 inter) and act_buf (rows, inter) alike. Each
// expert whose run both its linears take is computed into out and marked done[e] = 1; the others are left
// to the caller (done[e] = 0). 0, or the failing kernel's code.
int mixserve_moe_experts(const ExpertLinear* gate_up, const ExpertLinear* down, int64_t num_experts,
                         const int64_t* bounds, int dtype, const void* rows, void* gate_up_buf, void* act_buf,
                         void* out, int64_t hidden, int64_t inter, int gelu, uint8_t* done, int threads) {
    const char* x = static_cast<const char*>(rows);
    char *gu = static_cast<char*>(gate_up_buf), *act = static_cast<char*>(act_buf), *y = static_cast<char*>(out);
    std::vector<int64_t> shared;  // the experts run one to a thread
    int rc = 0;
    for (int64_t e = 0; e < num_experts && rc == 0; ++e) {
        const int64_t a = bounds[e], m = bounds[e + 1] - a;
        done[e] = m == 0;
        if (m == 0 || m > gate_up[e].max_rows || m > down[e].max_rows) continue;
        if (m < SHARED_ROWS && threads > 1) {
            shared.push_back(e);
            continue;
        }
        rc = run_expert(gate_up[e], down[e], dtype, a, m, x, gu, act, y, hidden, inter, gelu, threads);
        done[e] = rc == 0;
    }
    // contiguous runs of the shared experts, split by their cost: the weights' read, plus a little a row
    std::vector<int64_t> cost(shared.size() + 1, 0);
    for (size_t i = 0; i < shared.size(); ++i) {
        const int64_t e = shared[i];
        cost[i + 1] = cost[i] + 8 + bounds[e + 1] - bounds[e];
    }
    int shared_rc = 0;
#pragma omp parallel num_threads(threads) if (shared.size() > 1) reduction(| : shared_rc)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t from = cost.back() * t / nt, to = cost.back() * (t + 1) / nt;
        for (size_t i = 0; i < shared.size(); ++i) {
            if (cost[i] < from || cost[i] >= to) continue;  // each expert to the thread its start falls in
            const int64_t e = shared[i], a = bounds[e];
            const int r = run_expert(gate_up[e], down[e], dtype, a, bounds[e + 1] - a, x, gu, act, y, hidden,
                                     inter, gelu, 1);
            done[e] = r == 0;
            shared_rc |= r;
        }
    }
    return rc != 0 ? rc : shared_rc;
}

// The step's (token, choice) pairs sorted by expert, stably (torch.sort(stable=True)'s order: a counting
// sort), and their rows gathered: experts (tokens, top_k) -> bounds[E + 1] (expert e's run of sorted
// positions), order[pos] = the pair at pos, rows[pos] = x[order[pos] / top_k]; each row `row_bytes` long.
// 0, or 1 for an expert id out of range.
int mixserve_moe_dispatch(const int64_t* experts, int64_t tokens, int64_t top_k, int64_t num_experts,
                          const void* x, int64_t row_bytes, int64_t* bounds, int64_t* order, void* rows,
                          int threads) {
    const int64_t pairs = tokens * top_k;
    std::fill(bounds, bounds + num_experts + 1, 0);
    for (int64_t p = 0; p < pairs; ++p) {
        if (experts[p] < 0 || experts[p] >= num_experts) return 1;
        ++bounds[experts[p] + 1];
    }
    for (int64_t e = 0; e < num_experts; ++e) bounds[e + 1] += bounds[e];
    std::vector<int64_t> next(bounds, bounds + num_experts);
    for (int64_t p = 0; p < pairs; ++p) order[next[experts[p]]++] = p;
    const char* src = static_cast<const char*>(x);
    char* dst = static_cast<char*>(rows);
#pragma omp parallel for num_threads(threads) if (pairs * row_bytes >= (1 << 16))
    for (int64_t pos = 0; pos < pairs; ++pos)
        memcpy(dst + pos * row_bytes, src + order[pos] / top_k * row_bytes, row_bytes);
    return 0;
}

}  // extern "C"

namespace {

// y[t] = the sum over token t's pairs, in ascending sorted position (index_add_'s order on a CPU), of
// out[pos] * weight[pair], the product rounded to T, the sum kept in float32 and rounded once, as torch's
// `zeros.index_add_(0, order // k, (out * w[order]).to(T))` computes it. Neither contracted nor
// reassociated, so it equals that bit for bit.
// A chunk of each output row at a time, its sums in registers over the token's rows: summing a whole row in
// memory instead runs ~4x slower, its stores 4 KiB apart from the rows' loads (hidden 1024 in float32).
constexpr int64_t CHUNK = 64;

template <typename T>
__attribute__((optimize("fp-contract=off"))) void combine(const T* out, const float* weights, const int64_t* slot,
                                                          int64_t tokens, int64_t top_k, int64_t hidden, T* y,
                                                          int threads) {
#pragma omp parallel for num_threads(threads) if (tokens * top_k * hidden >= (1 << 15))
    for (int64_t t = 0; t < tokens; ++t) {
        const T* rows[64];  // this token's rows by sorted position (top_k <= 64: checked by the caller)
        float w[64];
        for (int64_t j = 0; j < top_k; ++j) {
            const int64_t pos = slot[t * top_k + j];
            int64_t i = j;
            for (; i > 0 && rows[i - 1] > out + pos * hidden; --i) rows[i] = rows[i - 1], w[i] = w[i - 1];
            rows[i] = out + pos * hidden, w[i] = weights[t * top_k + j];
        }
        for (int64_t c = 0; c < hidden; c += CHUNK) {
            const int64_t n = std::min(CHUNK, hidden - c);
            float sum[CHUNK] = {};
            for (int64_t j = 0; j < top_k; ++j)
                for (int64_t i = 0; i < n; ++i)
                    sum[i] += mixserve::round_to(rows[j], mixserve::load(rows[j] + c + i) * w[j]);
            for (int64_t i = 0; i < n; ++i) mixserve::store(y + t * hidden + c + i, sum[i]);
        }
    }
}

}  // namespace

extern "C" {

// out (pairs, hidden) in `dtype`, by sorted position; weights (tokens, top_k) float32 (a bf16 weight
// converts exactly); order as mixserve_moe_dispatch wrote it -> y (tokens, hidden) in `dtype`. 0, 1 for a
// dtype it lacks, 2 for top_k over 64.
int mixserve_moe_combine(int dtype, const void* out, const float* weights, const int64_t* order, int64_t tokens,
                         int64_t top_k, int64_t hidden, void* y, int threads) {
    if (top_k > 64) return 2;
    std::vector<int64_t> slot(tokens * top_k);  // pair -> its sorted position
    for (int64_t pos = 0; pos < tokens * top_k; ++pos) slot[order[pos]] = pos;
    if (dtype == 0)
        combine(static_cast<const float*>(out), weights, slot.data(), tokens, top_k, hidden, static_cast<float*>(y),
                threads);
    else if (dtype == 1)
        combine(static_cast<const uint16_t*>(out), weights, slot.data(), tokens, top_k, hidden,
                static_cast<uint16_t*>(y), threads);
    else
        return 1;
    return 0;
}

}  // extern "C"
