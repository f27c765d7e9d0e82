// out = x @ w.T + bias for few rows (a decode step's 1..32), on a weight laid out once in column panels;
// float32, and bfloat16 where the CPU has AVX512-BF16 (products in bf16 pairs, sums in float32, as oneDNN).
//
// Few rows make a GEMM neither compute- nor bandwidth-bound: MKL's packed GEMM (and oneDNN's in bf16) streams
// each weight from memory and then computes on it, one after the other, and reaches ~10 GB/s and ~150
// GFLOP/s at 32 rows where the machine has twice each. Here a thread walks its own contiguous run of panels
// (64 output columns x all of K, k-major: the weight is read once, in order) and, while it computes a panel,
// prefetches the next one into L2, spread over the panel's row passes so the memory stream and the FMAs
// overlap. The microkernel holds 6 rows x 64 columns of float32 sums in 24 AVX-512 registers (AVX2: 6 x 16
// in 12, few_row_simd.h); each k step loads the panel row's weight vectors and broadcasts 6 inputs (bf16:
// each step is a pair of k, one vdpbf16ps per vector). bf16 on a CPU with AMX takes tiles instead, on the
// same panels (few_row_amx.h), at up to 64 rows.
//
// Built where the compiler targets AVX-512 or AVX2 with FMA (-march=native), bf16 only with AVX512-BF16;
// elsewhere the entry points report a panel width of 0 and the linears stay MKL's / oneDNN's.
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>

#include "few_row_simd.h"

#ifdef MIXSERVE_FEW_ROW_SIMD

namespace {

constexpr int PANEL = LANES * VECS;  // output columns per panel
// A panel row (one k in float32, one pair of k in bf16) is PANEL x 4 bytes either way: 4 lines (AVX2: 1).
constexpr int ROW_BYTES = PANEL * 4;

// Where a pass prefetches: k-rows [begin, begin + steps) of the next panel, one every `every` k-rows.
struct Ahead {
    const char* next;
    int64_t begin, every;
};

inline void prefetch_row(const char* row) {
    for (int b = 0; b < ROW_BYTES; b += 64) _mm_prefetch(row + b, _MM_HINT_T1);
}

// What a pass does per dtype: the bias as float32 sums, one k step's weight vectors and input broadcast, the
// multiply-add into float32 sums, and the store of a row's sums; T the inputs' and panel's type, O the output's.
struct F32 {
    using T = float;
    using O = float;
    using W = Vf;
    static Vf bias(Mask m, const float* p) { return vload_masked(m, p); }
    static W weight(const float* panel, int64_t kk, int v) { return vload(panel + kk * PANEL + LANES * v); }
    static W input(const float* x, int64_t kk) { return vbroadcast(x[kk]); }
    static Vf madd(Vf acc, W x, W w) { return vfmadd(x, w, acc); }
    static void store(float* p, Mask m, Vf acc) { vstore_masked(p, m, acc); }
};

#ifdef __AVX512BF16__
// One k step is a pair of k: panel[(kk * PANEL + c) * 2 + e] = w[col c, 2 kk + e]; vdpbf16ps multiplies the
// pairs (exactly, in float32) and adds both to the sums.
struct BF16 {
    using T = uint16_t;
    using O = uint16_t;
    using W = __m512bh;
    static __m512 bias(__mmask16 m, const uint16_t* p) {  // 16 bf16 -> float32 (exact)
        const __m512i h = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
        return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
    }
    static W weight(const uint16_t* panel, int64_t kk, int v) {
        return (__m512bh)_mm512_loadu_si512(panel + (kk * PANEL + 16 * v) * 2);
    }
    static W input(const uint16_t* x, int64_t kk) {  // x[2kk] and x[2kk + 1], to every lane
        int32_t pair;
        memcpy(&pair, x + 2 * kk, sizeof pair);
        return (__m512bh)_mm512_set1_epi32(pair);
    }
    static __m512 madd(__m512 acc, W x, W w) { return _mm512_dpbf16_ps(acc, x, w); }
    static void store(uint16_t* p, __mmask16 m, __m512 acc) {  // round to nearest even, as torch rounds
        _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(acc));
    }
};
// bf16 inputs and panel, float32 bias and output: a quantized weight's panels decoded to bf16 (quant_panels.cpp)
struct BF16Sums : BF16 {
    using O = float;
    static __m512 bias(__mmask16 m, const float* p) { return vload_masked(m, p); }
    static void store(float* p, __mmask16 m, __m512 acc) { vstore_masked(p, m, acc); }
};
#include "few_row_amx.h"
#endif  // __AVX512BF16__

// bf16 rows the vdpbf16ps pass takes; above it oneDNN. With AMX, oneDNN's AMX GEMM beats it from 16 rows, so 8
// (k not a multiple of 32: no tiles here); without AMX oneDNN runs the same vdpbf16ps and the panels stream the
// weight better up to 256 rows (docs/decisions/few-row-panels.md).
#ifdef MIXSERVE_AMX
constexpr int BF16_FEW_ROWS = 8;
#else
constexpr int BF16_FEW_ROWS = 256;
#endif

// Sets of sums a pass of ROWS rows keeps, each over every S-th k step, added up at the end: an FMA waits ~4
// cycles for its sum, so fewer than 8 chains of sums leave the FMA ports idle and the memory stream with them
// (1 row on AVX2 has 2 chains: 4 sets make 8). Capped by the registers (sums, the weight vectors, 1 input).
template <int ROWS>
constexpr int sum_sets() {
    int sets = (8 + ROWS * VECS - 1) / (ROWS * VECS);
    while (sets > 1 && sets * ROWS * VECS + VECS + 1 > VREGS) --sets;
    return sets;
}

// `ROWS` rows of x against one panel of `depth` k steps, sums in float32; prefetches the next panel's k
// steps as `ahead` says.
template <typename E, int ROWS>
void panel_pass(const typename E::T* x, int64_t ldx, const typename E::T* panel, int64_t depth,
                const typename E::O* bias, typename E::O* out, int64_t ldo, int64_t valid, Ahead ahead) {
    constexpr int S = sum_sets<ROWS>();
    Vf acc[S][ROWS][VECS];
    for (int v = 0; v < VECS; ++v) {
        const Vf b = bias ? E::bias(lanes(valid, v), bias + LANES * v) : vzero();
        for (int r = 0; r < ROWS; ++r) {
            acc[0][r][v] = b;
            for (int s = 1; s < S; ++s) acc[s][r][v] = vzero();
        }
    }
    const char* pf = ahead.next + ahead.begin * ROW_BYTES;
    int64_t until_prefetch = 0;  // k steps to the next prefetch: one panel row every `ahead.every` steps
    auto step = [&](Vf (&sums)[ROWS][VECS], int64_t kk) {
        if (until_prefetch-- == 0) {
            prefetch_row(pf);
            pf += ROW_BYTES, until_prefetch = ahead.every - 1;
        }
        typename E::W w[VECS];
        for (int v = 0; v < VECS; ++v) w[v] = E::weight(panel, kk, v);
        for (int r = 0; r < ROWS; ++r) {
            const typename E::W xb = E::input(x + r * ldx, kk);
            for (int v = 0; v < VECS; ++v) sums[r][v] = E::madd(sums[r][v], xb, w[v]);
        }
    };
    int64_t kk = 0;
    for (; kk + S <= depth; kk += S)
        for (int s = 0; s < S; ++s) step(acc[s], kk + s);
    for (; kk < depth; ++kk) step(acc[0], kk);
    for (int s = 1; s < S; ++s)
        for (int r = 0; r < ROWS; ++r)
            for (int v = 0; v < VECS; ++v) acc[0][r][v] = vadd(acc[0][r][v], acc[s][r][v]);
    for (int r = 0; r < ROWS; ++r)
        for (int v = 0; v < VECS; ++v) E::store(out + r * ldo + LANES * v, lanes(valid, v), acc[0][r][v]);
}

template <typename E>
void pass_rows(int rows, const typename E::T* x, int64_t ldx, const typename E::T* panel, int64_t depth,
               const typename E::O* bias, typename E::O* out, int64_t ldo, int64_t valid, Ahead ahead) {
    switch (rows) {
        case 1: return panel_pass<E, 1>(x, ldx, panel, depth, bias, out, ldo, valid, ahead);
        case 2: return panel_pass<E, 2>(x, ldx, panel, depth, bias, out, ldo, valid, ahead);
        case 3: return panel_pass<E, 3>(x, ldx, panel, depth, bias, out, ldo, valid, ahead);
        case 4: return panel_pass<E, 4>(x, ldx, panel, depth, bias, out, ldo, valid, ahead);
        case 5: return panel_pass<E, 5>(x, ldx, panel, depth, bias, out, ldo, valid, ahead);
        default: return panel_pass<E, MAX_ROWS>(x, ldx, panel, depth, bias, out, ldo, valid, ahead);
    }
}

// All m rows of x against one panel (`valid` of its columns real), in passes that share the rows evenly
// (32: 6 6 5 5 5 5, not 6 6 6 6 6 2: a pass of few rows is slow), prefetching `next` (the next panel).
template <typename E>
void panel_rows(const typename E::T* x, int64_t ldx, int64_t m, const typename E::T* panel, int64_t depth,
                const typename E::O* bias, typename E::O* out, int64_t ldo, int64_t valid, const char* next) {
    const int64_t passes = (m + MAX_ROWS - 1) / MAX_ROWS;
    for (int64_t j = 0, r0 = 0; r0 < m; r0 += m / passes + (j < m % passes), ++j) {
        const int rows = static_cast<int>(m / passes + (j < m % passes));
        pass_rows<E>(rows, x + r0 * ldx, ldx, panel, depth, bias, out + r0 * ldo, ldo, valid,
                     Ahead{next, j * depth / passes, passes});
    }
}

// Every panel of the weight, split in contiguous runs across threads; `depth` k steps per panel (k in
// float32, k / 2 in bf16).
template <typename E>
void run_panels(const void* xv, int64_t ldx, int64_t m, const void* panels_v, int64_t n, int64_t depth,
                const void* bias_v, void* out_v, int64_t ldo, int num_threads) {
    using T = typename E::T;
    using O = typename E::O;
    const T *x = static_cast<const T*>(xv), *panels = static_cast<const T*>(panels_v);
    const O* bias = static_cast<const O*>(bias_v);
    O* out = static_cast<O*>(out_v);
    const int64_t count = (n + PANEL - 1) / PANEL, stride = depth * ROW_BYTES / sizeof(T);
#pragma omp parallel num_threads(num_threads) if (count >= 2 * num_threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t first = count * t / nt, last = count * (t + 1) / nt;  // contiguous: one stream a thread
        for (int64_t p = first; p < last; ++p) {
            const T* panel = panels + p * stride;
            const char* next = reinterpret_cast<const char*>(p + 1 < last ? panel + stride : panel);
            panel_rows<E>(x, ldx, m, panel, depth, bias ? bias + p * PANEL : nullptr, out + p * PANEL, ldo,
                          std::min<int64_t>(PANEL, n - p * PANEL), next);
        }
    }
}

}  // namespace

// One float32 panel against all m rows on the calling thread (quant_panels.cpp decodes a quantized weight's
// panel and multiplies it here, in cache); `next`: what to prefetch meanwhile. bf16: x, panel in pairs, k even.
void mixserve_few_row_panel_f32(const float* x, int64_t ldx, int64_t m, const float* panel, int64_t k,
                                const float* bias, float* out, int64_t ldo, int64_t valid, const char* next) {
    panel_rows<F32>(x, ldx, m, panel, k, bias, out, ldo, valid, next);
}

#ifdef __AVX512BF16__
void mixserve_few_row_panel_bf16(const uint16_t* x, int64_t ldx, int64_t m, const uint16_t* panel, int64_t k,
                                 const float* bias, float* out, int64_t ldo, int64_t valid, const char* next) {
    panel_rows<BF16Sums>(x, ldx, m, panel, k / 2, bias, out, ldo, valid, next);
}
#endif

#endif  // MIXSERVE_FEW_ROW_SIMD

extern "C" {

#ifdef MIXSERVE_FEW_ROW_SIMD

int mixserve_few_row_panel_width() { return PANEL; }

// The most rows mixserve_few_row_linear takes for this dtype and k (0: none, the weight is not packed).
int mixserve_few_row_max_rows(int dtype, int64_t k) {
    if (dtype == 0) return F32_FEW_ROWS;
#ifdef __AVX512BF16__
    if (dtype == 1 && k % 2 == 0) {
#ifdef MIXSERVE_AMX
        if (k % 32 == 0 && amx_permitted()) return AMX_MAX_ROWS;
#endif
        return BF16_FEW_ROWS;
    }
#endif
    return 0;
}

// w (n, k) row-major -> float32 panels[(p * k + kk) * PANEL + c] = w[p * PANEL + c, kk]; bf16 (k even)
// panels[((p * k/2 + kk) * PANEL + c) * 2 + e] = w[p * PANEL + c, 2 kk + e]; zero past column n.
int mixserve_few_row_pack(int dtype, const void* w, int64_t n, int64_t k, void* panels) {
    const int64_t count = (n + PANEL - 1) / PANEL;
    if (dtype == 0) {
        const float* src = static_cast<const float*>(w);
        float* dst = static_cast<float*>(panels);
        for (int64_t p = 0; p < count; ++p)
            for (int64_t kk = 0; kk < k; ++kk)
                for (int64_t c = 0; c < PANEL; ++c) {
                    const int64_t col = p * PANEL + c;
                    dst[(p * k + kk) * PANEL + c] = col < n ? src[col * k + kk] : 0.f;
                }
        return 0;
    }
#ifdef __AVX512BF16__
    if (dtype == 1 && k % 2 == 0) {
        const uint16_t* src = static_cast<const uint16_t*>(w);
        uint16_t* dst = static_cast<uint16_t*>(panels);
        const int64_t kp = k / 2;
        for (int64_t p = 0; p < count; ++p)
            for (int64_t kk = 0; kk < kp; ++kk)
                for (int64_t c = 0; c < PANEL; ++c)
                    for (int64_t e = 0; e < 2; ++e) {
                        const int64_t col = p * PANEL + c;
                        dst[((p * kp + kk) * PANEL + c) * 2 + e] = col < n ? src[col * k + 2 * kk + e] : 0;
                    }
        return 0;
    }
#endif
    return 1;  // bf16 without AVX512-BF16, or an odd k: the caller keeps oneDNN's linear
}

int mixserve_few_row_linear(int dtype, const void* x, int64_t ldx, int64_t m, const void* panels, int64_t n,
                            int64_t k, const void* bias, void* out, int64_t ldo, int num_threads) {
    if (dtype == 0) {
        run_panels<F32>(x, ldx, m, panels, n, k, bias, out, ldo, num_threads);
        return 0;
    }
#ifdef __AVX512BF16__
    if (dtype == 1 && k % 2 == 0) {
#ifdef MIXSERVE_AMX
        if (m <= AMX_MAX_ROWS && k % 32 == 0 && amx_permitted()) {  // faster than vdpbf16ps at every m
            run_amx(static_cast<const uint16_t*>(x), ldx, m, static_cast<const uint16_t*>(panels), n, k / 2,
                    static_cast<const uint16_t*>(bias), static_cast<uint16_t*>(out), ldo, num_threads);
            return 0;
        }
#endif
        run_panels<BF16>(x, ldx, m, panels, n, k / 2, bias, out, ldo, num_threads);
        return 0;
    }
#endif
    return 1;
}

#else  // neither AVX-512 nor AVX2 with FMA: nothing is packed or called (mixserve/model/cpu/few_row_linear.py)
int mixserve_few_row_panel_width() { return 0; }
int mixserve_few_row_max_rows(int, int64_t) { return 0; }
int mixserve_few_row_pack(int, const void*, int64_t, int64_t, void*) { return 2; }
int mixserve_few_row_linear(int, const void*, int64_t, int64_t, const void*, int64_t, int64_t, const void*,
                            void*, int64_t, int) {
    return 2;
}
#endif

}  // extern "C"
