// float32 out = x @ w.T + bias for few rows (a decode step's 1..32), on a weight laid out once in column panels.
//
// Few rows make a GEMM neither compute- nor bandwidth-bound: MKL's packed GEMM streams each weight from memory
// and then computes on it, one after the other, and reaches ~10 GB/s and ~150 GFLOP/s at 32 rows where the
// machine has twice each. Here a thread walks its own contiguous run of panels (64 output columns x all of K,
// k-major: the weight is read once, in order) and, while it computes a panel, prefetches the next one into L2,
// spread over the panel's row passes so the memory stream and the FMAs overlap. The microkernel holds 6 rows x
// 64 columns of sums in 24 AVX-512 registers; each k loads 4 weight vectors and broadcasts 6 inputs.
// Built only where the compiler targets AVX-512 (-march=native on such a CPU); elsewhere the entry points
// report a panel width of 0 and the linears stay MKL's.
#include <omp.h>
#include <stdint.h>

#include <algorithm>

#ifdef __AVX512F__
#include <immintrin.h>

namespace {

constexpr int VECS = 4;              // 16-float vectors per panel row
constexpr int PANEL = 16 * VECS;     // output columns per panel
constexpr int MAX_ROWS = 6;          // rows per microkernel pass (24 sums + 4 weights + 1 input: 29 registers)

__mmask16 lanes(int64_t valid, int v) {
    const int64_t left = valid - 16 * v;
    return left >= 16 ? static_cast<__mmask16>(0xffff)
                      : left <= 0 ? static_cast<__mmask16>(0) : static_cast<__mmask16>((1u << left) - 1);
}

// `rows` rows of x against one panel; prefetches k-rows [pf_begin, pf_begin + k / pf_step) of the next panel.
template <int ROWS>
void panel_pass(const float* x, int64_t ldx, const float* panel, int64_t k, const float* bias, float* out,
                int64_t ldo, int64_t valid, const float* next, int64_t pf_begin, int64_t pf_step) {
    __m512 acc[ROWS][VECS];
    for (int v = 0; v < VECS; ++v) {
        const __m512 b = bias ? _mm512_maskz_loadu_ps(lanes(valid, v), bias + 16 * v) : _mm512_setzero_ps();
        for (int r = 0; r < ROWS; ++r) acc[r][v] = b;
    }
    const float* ahead = next + pf_begin * PANEL;
    for (int64_t k0 = 0; k0 < k; k0 += pf_step, ahead += PANEL) {
        for (int c = 0; c < PANEL; c += 16) _mm_prefetch(reinterpret_cast<const char*>(ahead + c), _MM_HINT_T1);
        const int64_t k1 = std::min(k, k0 + pf_step);
        for (int64_t kk = k0; kk < k1; ++kk) {
            __m512 w[VECS];
            for (int v = 0; v < VECS; ++v) w[v] = _mm512_loadu_ps(panel + kk * PANEL + 16 * v);
            for (int r = 0; r < ROWS; ++r) {
                const __m512 xb = _mm512_set1_ps(x[r * ldx + kk]);
                for (int v = 0; v < VECS; ++v) acc[r][v] = _mm512_fmadd_ps(xb, w[v], acc[r][v]);
            }
        }
    }
    for (int r = 0; r < ROWS; ++r)
        for (int v = 0; v < VECS; ++v) _mm512_mask_storeu_ps(out + r * ldo + 16 * v, lanes(valid, v), acc[r][v]);
}

using Pass = void (*)(const float*, int64_t, const float*, int64_t, const float*, float*, int64_t, int64_t,
                      const float*, int64_t, int64_t);
const Pass PASSES[MAX_ROWS + 1] = {nullptr,           panel_pass<1>, panel_pass<2>, panel_pass<3>,
                                   panel_pass<4>,     panel_pass<5>, panel_pass<6>};

}  // namespace
#endif  // __AVX512F__

extern "C" {

#ifdef __AVX512F__

int mixserve_few_row_panel_width() { return PANEL; }

// w (n, k) row-major -> panels[(p * k + kk) * PANEL + c] = w[p * PANEL + c, kk], zero past column n.
int mixserve_few_row_pack(int dtype, const float* w, int64_t n, int64_t k, float* panels) {
    if (dtype != 0) return 1;  // float32 only: bf16 decode GEMMs are oneDNN's
    const int64_t count = (n + PANEL - 1) / PANEL;
    for (int64_t p = 0; p < count; ++p)
        for (int64_t kk = 0; kk < k; ++kk)
            for (int64_t c = 0; c < PANEL; ++c) {
                const int64_t col = p * PANEL + c;
                panels[(p * k + kk) * PANEL + c] = col < n ? w[col * k + kk] : 0.f;
            }
    return 0;
}

int mixserve_few_row_linear(int dtype, const float* x, int64_t ldx, int64_t m, const float* panels, int64_t n,
                            int64_t k, const float* bias, float* out, int64_t ldo, int num_threads) {
    if (dtype != 0) return 1;
    const int64_t count = (n + PANEL - 1) / PANEL;
    const int64_t passes = (m + MAX_ROWS - 1) / MAX_ROWS;
#pragma omp parallel num_threads(num_threads) if (count >= 2 * num_threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t first = count * t / nt, last = count * (t + 1) / nt;  // contiguous: one stream a thread
        for (int64_t p = first; p < last; ++p) {
            const float* panel = panels + p * k * PANEL;
            const float* next = p + 1 < last ? panel + k * PANEL : panel;
            const int64_t valid = std::min<int64_t>(PANEL, n - p * PANEL);
            for (int64_t j = 0, r0 = 0; r0 < m; r0 += MAX_ROWS, ++j) {
                const int rows = static_cast<int>(std::min<int64_t>(MAX_ROWS, m - r0));
                PASSES[rows](x + r0 * ldx, ldx, panel, k, bias ? bias + p * PANEL : nullptr, out + r0 * ldo + p * PANEL,
                             ldo, valid, next, j * k / passes, passes);
            }
        }
    }
    return 0;
}

#else  // no AVX-512: nothing is packed, nothing is called (mixserve/model/cpu/few_row_linear.py)
int mixserve_few_row_panel_width() { return 0; }
int mixserve_few_row_pack(int, const float*, int64_t, int64_t, float*) { return 2; }
int mixserve_few_row_linear(int, const float*, int64_t, int64_t, const float*, int64_t, int64_t, const float*,
                            float*, int64_t, int) {
    return 2;
}
#endif

}  // extern "C"
