// float32 linears as three bf16 products on AMX tiles ("bf16x3", what JAX calls Precision.HIGH): each
// float32 value is split into a bf16 `hi` and the bf16 `lo` of what hi leaves over (16 significant bits
// between them), and out = x @ W.T is accumulated in float32 tiles as xh.Wh + xh.Wl + xl.Wh (xl.Wl, ~2^-16
// of the product, is left out). Relative error ~5e-6 against float64, where MKL's float32 GEMM has ~5e-7
// and one bf16 product ~3e-3 (model/cpu/amx_linear.py gives the measurements and the reasons).
//
// Layout. The weight (n, k) is packed once into 16-column by 32-k tiles in AMX's pair ("VNNI") order,
// hi and lo apart: tile (j, b) holds W[16j + c, 32b + 2r + p] at [r][c][p], 1 KiB each. Rows, columns and
// k are padded with zeros to multiples of 32, so every tile is whole. A call splits x into hi and lo rows
// (zero-padded the same way), then each thread takes 32-column blocks of the output and, for each 32-row
// block, runs the three products through 4 accumulator tiles. Blocks are handed out dynamically: on the
// 2-vCPU VM a static split ran 1x or 3x slower from call to call (one vCPU stalls now and then, and the
// other waited for it at the end); dynamic blocks ran at the fast time every call.
#include <omp.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "common.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define MIXSERVE_AMX 1
#endif

using namespace mixserve;

namespace {

constexpr int64_t TILE_ELEMS = 16 * 32;  // bf16 in one 16 x 64-byte tile

#ifdef MIXSERVE_AMX
struct TileConfig {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

void configure_tiles() {
    TileConfig c;
    memset(&c, 0, sizeof c);
    c.palette_id = 1;
    for (int t = 0; t < 8; ++t) {
        c.rows[t] = 16;
        c.colsb[t] = 64;
    }
    _tile_loadconfig(&c);
}

// x rows -> hi and lo bf16 rows of kp columns; rows m..mp-1 and columns k..kp-1 are zeros.
void split_rows(const float* x, int64_t m, int64_t k, int64_t ldx, int64_t mp, int64_t kp, uint16_t* xh,
                uint16_t* xl, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (mp * kp >= (1 << 15))
    for (int64_t i = 0; i < mp; ++i) {
        uint16_t* h = xh + i * kp;
        uint16_t* l = xl + i * kp;
        int64_t j = 0;
        if (i < m) {
            const float* row = x + i * ldx;
            for (; j + 16 <= k; j += 16) {
                __m512 v = _mm512_loadu_ps(row + j);
                __m256bh vh = _mm512_cvtneps_pbh(v);
                __m512 back = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)vh), 16));
                _mm256_storeu_si256((__m256i*)(h + j), (__m256i)vh);
                _mm256_storeu_si256((__m256i*)(l + j), (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(v, back)));
            }
            for (; j < k; ++j) {
                h[j] = float_to_bf16(row[j]);
                l[j] = float_to_bf16(row[j] - bf16_to_float(h[j]));
            }
        }
        for (; j < kp; ++j) h[j] = l[j] = 0;
    }
}

void gemm(const uint16_t* xh, const uint16_t* xl, const uint16_t* wh, const uint16_t* wl, int64_t mp, int64_t np,
          int64_t kp, float* out, int64_t ldo, int num_threads) {
    const int64_t col_blocks = np / 32, row_blocks = mp / 32, kb = kp / 32;
#pragma omp parallel num_threads(num_threads)
    {
        configure_tiles();
#pragma omp for schedule(dynamic, 2)
        for (int64_t j = 0; j < col_blocks; ++j) {
            const uint16_t* h0 = wh + (2 * j) * kb * TILE_ELEMS;
            const uint16_t* h1 = h0 + kb * TILE_ELEMS;
            const uint16_t* l0 = wl + (2 * j) * kb * TILE_ELEMS;
            const uint16_t* l1 = l0 + kb * TILE_ELEMS;
            for (int64_t i = 0; i < row_blocks; ++i) {
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int part = 0; part < 3; ++part) {  // xh.Wh, xh.Wl, xl.Wh
                    const uint16_t* a = (part == 2 ? xl : xh) + i * 32 * kp;
                    const uint16_t* b0 = part == 1 ? l0 : h0;
                    const uint16_t* b1 = part == 1 ? l1 : h1;
                    for (int64_t b = 0; b < kb; ++b) {
                        _tile_loadd(4, a + b * 32, kp * 2);
                        _tile_loadd(5, a + 16 * kp + b * 32, kp * 2);
                        _tile_loadd(6, b0 + b * TILE_ELEMS, 64);
                        _tile_loadd(7, b1 + b * TILE_ELEMS, 64);
                        _tile_dpbf16ps(0, 4, 6);
                        _tile_dpbf16ps(1, 4, 7);
                        _tile_dpbf16ps(2, 5, 6);
                        _tile_dpbf16ps(3, 5, 7);
                    }
                }
                float* o = out + i * 32 * ldo + j * 32;
                _tile_stored(0, o, ldo * 4);
                _tile_stored(1, o + 16, ldo * 4);
                _tile_stored(2, o + 16 * ldo, ldo * 4);
                _tile_stored(3, o + 16 * ldo + 16, ldo * 4);
            }
        }
        _tile_release();  // a thread holding no tile state is cheaper to switch out
    }
}
#endif

}  // namespace

extern "C" {

// 0 when this library has the AMX kernels and the kernel lets this process use the tiles; 2: built without
// AMX (the CPU lacks it), 3: the kernel refused the tile state (an old kernel or a VM that hides it).
int mixserve_amx_init(int dtype) {
    if (dtype != 0) return 1;
#ifdef MIXSERVE_AMX
    const long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 0 : 3;
#else
    return 2;
#endif
}

// w (n, k) float32, row-major -> hi and lo, each (np / 16) * (kp / 32) tiles of TILE_ELEMS bf16.
int mixserve_amx_pack(int dtype, const float* w, int64_t n, int64_t k, int64_t np, int64_t kp, uint16_t* hi,
                      uint16_t* lo) {
    if (dtype != 0 || np % 32 || kp % 32 || np < n || kp < k) return 1;
    const int64_t kb = kp / 32;
    for (int64_t j = 0; j < np / 16; ++j)
        for (int64_t b = 0; b < kb; ++b) {
            uint16_t* th = hi + (j * kb + b) * TILE_ELEMS;
            uint16_t* tl = lo + (j * kb + b) * TILE_ELEMS;
            for (int r = 0; r < 16; ++r)
                for (int c = 0; c < 16; ++c)
                    for (int p = 0; p < 2; ++p) {
                        const int64_t row = j * 16 + c, col = b * 32 + 2 * r + p;
                        const float f = (row < n && col < k) ? w[row * k + col] : 0.f;
                        const uint16_t h = float_to_bf16(f);
                        th[(r * 16 + c) * 2 + p] = h;
                        tl[(r * 16 + c) * 2 + p] = float_to_bf16(f - bf16_to_float(h));
                    }
        }
    return 0;
}

// out (mp, np) float32, row stride ldo = x (m, k; row stride ldx) @ W.T, through the scratch rows xh, xl
// (mp * kp bf16 each). mp, np, kp multiples of 32; rows m..mp-1 of out come out zero.
int mixserve_amx_linear(int dtype, const float* x, int64_t m, int64_t k, int64_t ldx, const uint16_t* wh,
                        const uint16_t* wl, int64_t np, int64_t kp, uint16_t* xh, uint16_t* xl, int64_t mp,
                        float* out, int64_t ldo, int num_threads) {
    if (dtype != 0 || mp % 32 || np % 32 || kp % 32 || mp < m || kp < k || ldo < np) return 1;
#ifdef MIXSERVE_AMX
    split_rows(x, m, k, ldx, mp, kp, xh, xl, num_threads);
    gemm(xh, xl, wh, wl, mp, np, kp, out, ldo, num_threads);
    return 0;
#else
    (void)x, (void)ldx, (void)wh, (void)wl, (void)xh, (void)xl, (void)out, (void)num_threads;
    return 2;
#endif
}

}  // extern "C"
