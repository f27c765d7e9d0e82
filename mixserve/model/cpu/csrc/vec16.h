// 16 floats as one value, and what the attention kernel builds from it: scores of a few query rows
// (decodes) against a tile of 16 keys read row by row from the cache.
#pragma once
#include <stdint.h>

namespace mixserve {

// GCC's vector extension: one AVX-512 register here, two AVX2 registers on an AVX2-only CPU. Written out
// where GCC would not vectorise the plain loops (a 16-wide score row across the D loop, an accumulator
// row kept in registers across keys).
typedef float vf16 __attribute__((vector_size(64)));
typedef float vf16u __attribute__((vector_size(64), aligned(4)));  // for loads at any float address
typedef int32_t vi16 __attribute__((vector_size(64)));

// How many vf16 values the vector registers hold: loops that keep many sums in registers size their blocks by
// it (on AVX2 a block sized for AVX-512 spills every sum to the stack: chunk attention ran 5x slower).
#ifdef __AVX512F__
constexpr int VF16_REGS = 32;
#else
constexpr int VF16_REGS = 8;
#endif

inline vf16 load16(const float* p) { return *reinterpret_cast<const vf16u*>(p); }
inline void store16(float* p, vf16 v) { *reinterpret_cast<vf16u*>(p) = v; }

// Eight floats: one AVX2 register. A vf16 is two of them there, and GCC lowers `scalar * vf16` (and a vf16
// built from halves) by writing the scalar 16 times to the stack and reading it back, so AVX2's hot loops
// (P.V, the chunk's scores) are written on halves: a 256-token chunk's attention built for AVX2 ran 22x
// slower than the AVX-512 build on the same core, where half the width should cost 2x.
typedef float vf8 __attribute__((vector_size(32)));
typedef float vf8u __attribute__((vector_size(32), aligned(4)));
inline vf8 load8(const float* p) { return *reinterpret_cast<const vf8u*>(p); }
inline void store8(float* p, vf8 v) { *reinterpret_cast<vf8u*>(p) = v; }
typedef int32_t vi8 __attribute__((vector_size(32)));

// One level of summing 16 vectors into one vector of 16 sums: a and b each hold keys' partial sums in
// blocks of 2H lanes; the result holds a's keys then b's in blocks of H lanes, each block the sum of
// the two halves of its old block. Constant masks: each shuffle is one vpermt2ps.
inline vf16 fold8(vf16 a, vf16 b) {
    const vi16 lo = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const vi16 hi = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    return __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, hi);
}
inline vf16 fold4(vf16 a, vf16 b) {
    const vi16 lo = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
    const vi16 hi = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
    return __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, hi);
}
inline vf16 fold2(vf16 a, vf16 b) {
    const vi16 lo = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
    const vi16 hi = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
    return __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, hi);
}
inline vf16 fold1(vf16 a, vf16 b) {
    const vi16 lo = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    const vi16 hi = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
    return __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, hi);
}

// Scores of `rows` query rows (few: decodes) against up to 16 key rows: sc[r][j] = q_r . k_j. Each key
// row is read as DC/16 vectors and its products with a query row summed into one vector; the 16 keys'
// vectors then fold into one vector of 16 scores (15 shuffle pairs a row, where a horizontal sum per
// (row, key) cost ~20 instructions and a long dependency chain). Keys nk..15 score 0.
template <int DC, int LD>
inline void few_row_scores(const float (*qs)[LD], const float* const* krow, int64_t rows, int64_t nk,
                           float (*sc)[16]) {
    static_assert(DC % 16 == 0 && DC <= LD, "head dim a multiple of 16");
    constexpr int C = DC / 16;
    for (int64_t r = 0; r < rows; ++r) {
        vf16 qv[C];
        for (int c = 0; c < C; ++c) qv[c] = load16(qs[r] + 16 * c);
        vf16 p[16];
        for (int64_t j = 0; j < 16; ++j) {
            if (j < nk) {
                vf16 a = qv[0] * load16(krow[j]);
                for (int c = 1; c < C; ++c) a += qv[c] * load16(krow[j] + 16 * c);
                p[j] = a;
            } else {
                p[j] = vf16{};
            }
        }
        vf16 a8[8], a4[4], a2[2];
        for (int i = 0; i < 8; ++i) a8[i] = fold8(p[2 * i], p[2 * i + 1]);
        for (int i = 0; i < 4; ++i) a4[i] = fold4(a8[2 * i], a8[2 * i + 1]);
        for (int i = 0; i < 2; ++i) a2[i] = fold2(a4[2 * i], a4[2 * i + 1]);
        store16(sc[r], fold1(a2[0], a2[1]));
    }
}

// acc[r] = acc[r] * alpha[r] + sum_j p(r, j) * v_j over keys j < nv (p(r, j) = p[r * p_row + j * p_key]: the
// tile's softmax numerators, 0 past each row's visible keys, row-major or key-major), for DC/16-vector rows. Key-outer over a block of rows held in registers:
// each V row is read once per block, and each FMA needs one broadcast, where row by row every FMA also
// reloaded its V vector.
template <int DC, int LD>
inline void scale_accumulate(float (*acc)[LD], const float* alpha, const float* p, int64_t p_row, int64_t p_key,
                             const float* const* vrow, int64_t nv, int64_t rows) {
    static_assert(DC % 16 == 0 && DC <= LD, "head dim a multiple of 16");
    if constexpr (VF16_REGS < 32) {  // AVX2: a row at a time on halves (vf8), V read as FMA operands
        constexpr int H = DC / 8;
        for (int64_t r = 0; r < rows; ++r) {
            vf8 av[H];
            for (int h = 0; h < H; ++h) av[h] = load8(acc[r] + 8 * h) * alpha[r];
            for (int64_t j = 0; j < nv; ++j) {
                const vf8 s = vf8{} + p[r * p_row + j * p_key];
                for (int h = 0; h < H; ++h) av[h] += s * load8(vrow[j] + 8 * h);
            }
            for (int h = 0; h < H; ++h) store8(acc[r] + 8 * h, av[h]);
        }
        return;
    }
    // RB * C accumulators + C V vectors in the registers
    constexpr int C = DC / 16, RB = C <= 4 ? 4 : 2;
    int64_t r = 0;
    for (; r + RB <= rows; r += RB) {
        vf16 av[RB][C];
        for (int i = 0; i < RB; ++i)
            for (int c = 0; c < C; ++c) av[i][c] = load16(acc[r + i] + 16 * c) * alpha[r + i];
        for (int64_t j = 0; j < nv; ++j) {
            vf16 v[C];
            for (int c = 0; c < C; ++c) v[c] = load16(vrow[j] + 16 * c);
            for (int i = 0; i < RB; ++i) {
                const float s = p[(r + i) * p_row + j * p_key];
                for (int c = 0; c < C; ++c) av[i][c] += s * v[c];
            }
        }
        for (int i = 0; i < RB; ++i)
            for (int c = 0; c < C; ++c) store16(acc[r + i] + 16 * c, av[i][c]);
    }
    for (; r < rows; ++r) {
        vf16 av[C];
        for (int c = 0; c < C; ++c) av[c] = load16(acc[r] + 16 * c) * alpha[r];
        for (int64_t j = 0; j < nv; ++j)
            for (int c = 0; c < C; ++c) av[c] += p[r * p_row + j * p_key] * load16(vrow[j] + 16 * c);
        for (int c = 0; c < C; ++c) store16(acc[r] + 16 * c, av[c]);
    }
}

}  // namespace mixserve
