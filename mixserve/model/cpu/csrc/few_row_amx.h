// bfloat16 linears of 1..64 rows on AMX tiles (Sapphire Rapids and later), on the same column panels as the
// vdpbf16ps pass (few_row_linear.cpp): a panel's bf16 pairs of k are what TDPBF16PS reads as its B tile
// (16 pairs of k x 16 columns, 256 bytes from one pair-row to the next), x's rows are its A tile as they lie.
//
// Why: vdpbf16ps does 32 products a cycle, no more than float32's two FMA ports, so at 16-32 rows the bf16
// panels were compute-bound at float32's rate; oneDNN's AMX GEMM has the arithmetic to spare but reads the
// weight and then computes. A tile product is 8192 products in ~16 cycles: here the arithmetic is a small
// fraction of the time to stream the weight, and the next panel is prefetched in doses during this one.
//
// Included by few_row_linear.cpp (inside its namespace, after PANEL and the BF16 traits).
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>

#define MIXSERVE_AMX 1

constexpr int AMX_BLOCK = 32;     // rows a pass holds: two row tiles of 16
constexpr int AMX_MAX_ROWS = 64;  // two passes over each half panel (the second from L1/L2)

struct alignas(64) TileConfig {
    uint8_t palette = 1, start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

// Linux grants a process AMX's tile state only when asked (once; oneDNN asks too, for its own kernels).
bool amx_permitted() {
    static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return ok;
}

// Tiles: 0-1 sums of rows 0-15 (columns h*32 + 0-15, 16-31), 2-3 of rows 16-31, 4-5 x's two row tiles,
// 6-7 the weight's two column tiles.
TileConfig tile_config(int64_t m) {
    TileConfig c;
    const uint8_t r0 = static_cast<uint8_t>(std::min<int64_t>(16, m)), r1 = static_cast<uint8_t>(m > 16 ? m - 16 : 0);
    const uint8_t rows[8] = {r0, r0, r1, r1, r0, r1, 16, 16};
    for (int t = 0; t < 8; ++t) {
        c.rows[t] = rows[t];
        c.colsb[t] = rows[t] ? 64 : 0;
    }
    return c;
}

// One half panel (32 columns) of `m` (1..AMX_BLOCK) rows over every k, sums into acc (32 x 32 floats);
// prefetches `dose` bytes of the next panel from `pf` before each step of 32 k.
void amx_half(const uint16_t* x, int64_t ldx, int64_t m, const uint16_t* panel, int64_t pairs, int half,
              float (*acc)[32], const char* pf, int64_t dose) {
    _tile_zero(0);
    _tile_zero(1);
    if (m > 16) {
        _tile_zero(2);
        _tile_zero(3);
    }
    for (int64_t kk = 0; kk < pairs; kk += 16, pf += dose) {
        for (int64_t b = 0; b < dose; b += 64) _mm_prefetch(pf + b, _MM_HINT_T1);
        const uint16_t* w = panel + (kk * PANEL + 32 * half) * 2;
        _tile_loadd(6, w, PANEL * 4);
        _tile_loadd(7, w + 32, PANEL * 4);
        _tile_loadd(4, x + 2 * kk, ldx * 2);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (m > 16) {
            _tile_loadd(5, x + 16 * ldx + 2 * kk, ldx * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, acc[0], 128);
    _tile_stored(1, acc[0] + 16, 128);
    if (m > 16) {
        _tile_stored(2, acc[16], 128);
        _tile_stored(3, acc[16] + 16, 128);
    }
}

// out (m x n, row stride ldo) = x @ w.T + bias in bf16, for m <= AMX_MAX_ROWS and k a multiple of 32 (pairs =
// k / 2), each thread on its own contiguous run of panels (as run_panels); rows in blocks of AMX_BLOCK, the
// first block's pass prefetching the next panel.
void run_amx(const uint16_t* x, int64_t ldx, int64_t m, const uint16_t* panels, int64_t n, int64_t pairs,
             const uint16_t* bias, uint16_t* out, int64_t ldo, int num_threads) {
    const int64_t count = (n + PANEL - 1) / PANEL, stride = pairs * PANEL * 2;
    const int64_t dose = pairs * ROW_BYTES / (2 * (pairs / 16));  // the next panel over both halves' steps
    const int64_t blocks = (m + AMX_BLOCK - 1) / AMX_BLOCK, tail = m - (blocks - 1) * AMX_BLOCK;
    const TileConfig full = tile_config(std::min<int64_t>(m, AMX_BLOCK)), last = tile_config(tail);
    const bool switching = blocks > 1 && tail != AMX_BLOCK;  // two configs, loaded in turn
#pragma omp parallel num_threads(num_threads) if (count >= 2 * num_threads)
    {
        _tile_loadconfig(&full);
        alignas(64) float acc[AMX_BLOCK][32];
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t first = count * t / nt, end = count * (t + 1) / nt;
        for (int64_t p = first; p < end; ++p) {
            const uint16_t* panel = panels + p * stride;
            const char* next = reinterpret_cast<const char*>(p + 1 < end ? panel + stride : panel);
            for (int half = 0; half < 2; ++half) {
                const int64_t c0 = p * PANEL + 32 * half, valid = std::min<int64_t>(32, n - c0);
                if (valid <= 0) break;
                for (int64_t rb = 0; rb < blocks; ++rb) {
                    const int64_t r0 = rb * AMX_BLOCK, mb = std::min<int64_t>(AMX_BLOCK, m - r0);
                    if (switching && (rb == 0 || rb == blocks - 1)) _tile_loadconfig(rb == 0 ? &full : &last);
                    amx_half(x + r0 * ldx, ldx, mb, panel, pairs, half, acc, next + half * (pairs / 16) * dose,
                             rb == 0 ? dose : 0);
                    for (int v = 0; v < 2; ++v) {
                        const __mmask16 mask = lanes(valid, v);
                        const __m512 b = bias ? BF16::bias(mask, bias + c0 + 16 * v) : _mm512_setzero_ps();
                        for (int64_t r = 0; r < mb; ++r)
                            BF16::store(out + (r0 + r) * ldo + c0 + 16 * v, mask,
                                        _mm512_add_ps(_mm512_load_ps(acc[r] + 16 * v), b));
                    }
                }
            }
        }
        _tile_release();
    }
}

#endif  // __AMX_TILE__ && __AMX_BF16__
