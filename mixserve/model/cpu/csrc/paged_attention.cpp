// Causal attention of a whole mixed batch (decodes and prefill chunks) over the paged KV cache, read in
// place through each sequence's block table: no gathered copy of any context, one call per layer.
//
// Plain C ABI (called through ctypes), no torch headers: g++ alone builds it (five head dims x two dtypes of
// item kernels, paged_items.h), no ninja. OpenMP shares torch's libgomp (same soname, already
// loaded), so the step thread's bound worker pool runs it.
//
// Work item = (sequence, KV head, tile of up to TILE_TOKENS query tokens): the tile's query rows are every
// query head of that KV head's GQA group, so each K/V element read from the cache serves G heads. Keys go
// in tiles of KEY_TILE (16 = one AVX-512 register of fp32 scores per row); online softmax per row. A
// decode is one item over all its KV heads instead (paged_decode.h), reading each block once; a tile of 8+
// rows at a head dim paged_items.h lists (a prefill chunk) takes the key-major kernel (paged_chunk.h).
// Per layer: a sliding window starts each row's keys at first_key (the cache keeps the keys below it: no block
// is freed, the loops skip them) and a softcap maps the scaled scores through tanh before the softmax.
#include <omp.h>

#include <type_traits>
#include <vector>

#include "common.h"
#include "paged_decode.h"
#include "paged_items.h"
#include "paged_tiles.h"
#include "softmax16.h"
#include "vec16.h"

using namespace mixserve;

namespace {

// Queries of up to this many tokens (a decode and its drafts) take the decode item, which streams the K/V once
// for every head and token, rather than an item per KV head (docs/decisions/short-queries-as-decodes.md).
constexpr int64_t DECODE_RUN_TOKENS = 8;

static_assert(KEY_TILE == 16, "a row's scores for one key tile are one vf16");

// Scores of `rows` query rows against one transposed key tile: sc[r][j] = q_r . k_j. Four rows at a
// time, each over two halves of d: eight independent FMA chains hide the FMA latency, and each kt[d]
// load serves four rows.
template <int LD>
inline void tile_scores(const float (*qs)[LD], const vf16* kt, int64_t rows, int64_t D,
                        float (*sc)[KEY_TILE]) {
    int64_t r = 0;
    for (; r + 4 <= rows && D % 2 == 0; r += 4) {
        vf16 a0 = {}, a1 = {}, a2 = {}, a3 = {}, b0 = {}, b1 = {}, b2 = {}, b3 = {};
        for (int64_t d = 0; d < D; d += 2) {
            a0 += qs[r][d] * kt[d];
            a1 += qs[r + 1][d] * kt[d];
            a2 += qs[r + 2][d] * kt[d];
            a3 += qs[r + 3][d] * kt[d];
            b0 += qs[r][d + 1] * kt[d + 1];
            b1 += qs[r + 1][d + 1] * kt[d + 1];
            b2 += qs[r + 2][d + 1] * kt[d + 1];
            b3 += qs[r + 3][d + 1] * kt[d + 1];
        }
        store16(sc[r], a0 + b0);
        store16(sc[r + 1], a1 + b1);
        store16(sc[r + 2], a2 + b2);
        store16(sc[r + 3], a3 + b3);
    }
    for (; r < rows; ++r) {
        vf16 a = {};
        for (int64_t d = 0; d < D; ++d) a += qs[r][d] * kt[d];
        store16(sc[r], a);
    }
}

template <typename T, int DC>
void attend_tile(const Item& it, const T* q, const T* k_cache, const T* v_cache, T* out,
                 const int64_t* query_start, const int64_t* seq_lens, const int64_t* block_tables,
                 const Shape& sh) {
    const int64_t D = DC ? DC : sh.head_dim, G = sh.num_heads / sh.num_kv_heads;
    const int64_t n_tok = it.q_end - it.q_begin, rows = n_tok * G;
    const int64_t qlen = query_start[it.seq + 1] - query_start[it.seq];
    const int64_t ctx = seq_lens[it.seq];
    // absolute position of packed token t = ctx - qlen + (t - query_start[seq])
    const int64_t pos0 = ctx - qlen + (it.q_begin - query_start[it.seq]);
    const int64_t* table = block_tables + it.seq * sh.max_blocks;
    const int64_t head_off = it.kv_head * D;
    // Few rows (decodes): straight from the cache rows (vec16.h: few_row_scores). Many rows (chunks):
    // K transposed once per tile, so each row's 16 scores are D broadcast-FMAs into one vector.
    const bool transpose = rows >= 8;
    // Rows as long as the head (a compile-time DC): at MAX_HEAD_DIM floats apart, qs and acc rows fell into a
    // quarter of L1's sets and evicted each other.
    constexpr int LD = DC > 0 ? DC : MAX_HEAD_DIM;

    alignas(64) float qs[MAX_ROWS][LD];
    alignas(64) float acc[MAX_ROWS][LD];
    vf16 kt[MAX_HEAD_DIM];  // kt[d][j] = K[key j][d]
    alignas(64) float kbuf[KEY_TILE][MAX_HEAD_DIM];
    alignas(64) float vbuf[KEY_TILE][MAX_HEAD_DIM];
    alignas(64) float sc[MAX_ROWS][KEY_TILE];  // the tile's scores, row by row
    const float* krow[KEY_TILE];
    const float* vrow[KEY_TILE];
    float m[MAX_ROWS], l[MAX_ROWS], alpha_r[MAX_ROWS];

    for (int64_t r = 0; r < rows; ++r) {
        const int64_t t = r / G, h = it.kv_head * G + r % G;
        const T* src = q + (it.q_begin + t) * sh.q_stride_t + h * sh.q_stride_h;
        for (int64_t d = 0; d < D; ++d) qs[r][d] = load(src + d) * sh.scale;
        for (int64_t d = 0; d < D; ++d) acc[r][d] = 0.f;
        m[r] = NEG_BIG;
        l[r] = 0.f;
    }
    const int64_t num_keys = pos0 + n_tok;  // the last query of the tile sees keys up to pos0 + n_tok - 1
    const int64_t k_first = first_key(pos0, sh);  // the first query's window starts earliest
    for (int64_t k0 = k_first; k0 < num_keys; k0 += KEY_TILE) {
        const int64_t nk = std::min<int64_t>(KEY_TILE, num_keys - k0);
        prefetch_ahead(k_cache, v_cache, table, k0, k_first, num_keys, head_off, D, sh);
        tile_rows<T, DC>(k_cache, table, k0, nk, head_off, sh, kbuf, krow);
        tile_rows<T, DC>(v_cache, table, k0, nk, head_off, sh, vbuf, vrow);
        if (transpose) {
            // (head dims 64 and 128 take attend_chunk for these rows: this is the generic head dims' path)
            for (int64_t j = 0; j < KEY_TILE; ++j)
                for (int64_t d = 0; d < D; ++d) kt[d][j] = j < nk ? krow[j][d] : 0.f;
            tile_scores(qs, kt, rows, D, sc);
        } else if constexpr (DC > 0 && DC % 16 == 0) {
            few_row_scores<DC, LD>(qs, krow, rows, nk, sc);
        } else {
            for (int64_t r = 0; r < rows; ++r)
                for (int64_t j = 0; j < nk; ++j) {
                    float dot = 0.f;
                    for (int64_t d = 0; d < D; ++d) dot += qs[r][d] * krow[j][d];
                    sc[r][j] = dot;
                }
        }
        if (sh.softcap > 0.f)
            for (int64_t r = 0; r < rows; ++r) softcap_scores(sc[r], KEY_TILE, sh.softcap);
        int64_t nv = 0;  // the most keys of this tile any row sees
        for (int64_t r = 0; r < rows; ++r) {
            const int64_t p = pos0 + r / G;
            const int64_t visible = std::min<int64_t>(nk, p - k0 + 1);  // causal, tile end
            const int64_t first = std::max<int64_t>(0, first_key(p, sh) - k0);  // the window's start
            float* s = sc[r];
            if (visible <= first) {  // no key of this tile (before the row, or below its window): left as it is
                alpha_r[r] = 1.f;
                for (int j = 0; j < KEY_TILE; ++j) s[j] = 0.f;
                continue;
            }
            if constexpr (DC > 0 && DC % 16 == 0) {
                alpha_r[r] = softmax_tile_row(s, first, visible, m[r], l[r]);
                nv = std::max(nv, visible);
                continue;
            }
            float tile_max = NEG_BIG;
            for (int64_t j = first; j < visible; ++j) tile_max = std::max(tile_max, s[j]);
            const float m_new = std::max(m[r], tile_max);
            const float alpha = fast_exp(m[r] - m_new);  // 0 on the first tile
            float sum = 0.f;
            for (int j = 0; j < KEY_TILE; ++j) {
                s[j] = j >= first && j < visible ? fast_exp(s[j] - m_new) : 0.f;
                sum += s[j];
            }
            l[r] = l[r] * alpha + sum;
            m[r] = m_new;
            alpha_r[r] = alpha;
            nv = std::max(nv, visible);
            float* a = acc[r];
            for (int64_t d = 0; d < D; ++d) a[d] *= alpha;
            for (int64_t j = first; j < visible; ++j)
                for (int64_t d = 0; d < D; ++d) a[d] += s[j] * vrow[j][d];
        }
        if constexpr (DC > 0 && DC % 16 == 0) scale_accumulate<DC, LD>(acc, alpha_r, sc[0], KEY_TILE, 1, vrow, nv, rows);
    }
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t t = r / G, h = it.kv_head * G + r % G;
        T* dst = out + (it.q_begin + t) * sh.o_stride_t + h * sh.o_stride_h;
        const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
        for (int64_t d = 0; d < D; ++d) store(dst + d, acc[r][d] * inv);
    }
}

template <typename T>
void run(const T* q, const T* k_cache, const T* v_cache, T* out, const int64_t* query_start,
         const int64_t* seq_lens, const int64_t* block_tables, int64_t num_seqs, const Shape& sh,
         int num_threads) {
    const int64_t G = sh.num_heads / sh.num_kv_heads;
    const int64_t tokens = std::max<int64_t>(1, std::min<int64_t>(TILE_TOKENS, MAX_ROWS / G));
    std::vector<Item> items;
    items.reserve(num_seqs * sh.num_kv_heads);
    // Longest contexts first: with dynamic scheduling, the big prefill tiles start early and the cheap
    // decodes fill in behind them on whichever thread is free.
    // A decode, or a short query (a decode verifying drafts), is one item over all KV heads (kv_head -1:
    // attend_decode) where its rows fit a tile (and, in bf16 widened to float32, a key's row of every KV head
    // fits the widening buffer).
    const ItemKernels<T> kernels = item_kernels<T>(sh.head_dim);
    const bool whole = kernels.decode && sh.num_heads <= MAX_ROWS
                       && sh.num_kv_heads * sh.head_dim <= kernels.max_decode_row;
    for (int64_t s = 0; s < num_seqs; ++s) {
        const int64_t qlen = query_start[s + 1] - query_start[s];
        const bool uncut = sh.window == 0 || seq_lens[s] <= sh.window;  // every token sees every key
        if (whole && (qlen == 1 || (qlen <= DECODE_RUN_TOKENS && qlen * sh.num_heads <= MAX_ROWS && uncut))) {
            items.push_back({s, -1, query_start[s], query_start[s + 1]});
            continue;
        }
        for (int64_t b = query_start[s]; b < query_start[s + 1]; b += tokens)
            for (int64_t h = 0; h < sh.num_kv_heads; ++h)
                items.push_back({s, h, b, std::min(b + tokens, query_start[s + 1])});
    }
    auto weight = [&](const Item& a) {  // query tokens x the keys they read (a window caps those)
        const int64_t n = a.q_end - a.q_begin, keys = seq_lens[a.seq];
        return n * (sh.window > 0 ? std::min(keys, sh.window + n) : keys) * (a.kv_head < 0 ? sh.num_kv_heads : 1);
    };
    std::stable_sort(items.begin(), items.end(), [&](const Item& a, const Item& b) { return weight(a) > weight(b); });
    const int64_t n = static_cast<int64_t>(items.size());
    // Head dims 64 and 128 (most Llama-family models) get the loops unrolled at compile time.
    auto tile = sh.head_dim == 64    ? attend_tile<T, 64>
                : sh.head_dim == 128 ? attend_tile<T, 128>
                                     : attend_tile<T, 0>;
    // A thread grabs all KV heads of one (sequence, tile) (adjacent after the sort): their rows interleave in
    // memory, so it streams the blocks rather than reading them once per head.
    const int64_t grab = whole ? 1 : sh.num_kv_heads;
    const auto decode = sh.softcap > 0.f ? kernels.decode_capped : kernels.decode;
    // Chunk tiles (8+ query rows) take the key-major kernel (paged_chunk.h) where the head dim allows.
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, grab)
    for (int64_t i = 0; i < n; ++i) {
        if (items[i].kv_head < 0) {
            decode(items[i], q, k_cache, v_cache, out, seq_lens[items[i].seq], block_tables, sh);
            continue;
        }
        if (kernels.chunk && (items[i].q_end - items[i].q_begin) * G >= 8) {
            kernels.chunk(items[i], q, k_cache, v_cache, out, query_start, seq_lens, block_tables, sh);
            continue;
        }
        tile(items[i], q, k_cache, v_cache, out, query_start, seq_lens, block_tables, sh);
    }
}

// K and V of the step's tokens into their slots (block * block_size + offset): one pass, strided inputs.
template <typename T>
void store_kv(const T* k, const T* v, int64_t k_stride_t, int64_t k_stride_h, int64_t v_stride_t,
              int64_t v_stride_h, T* k_cache, T* v_cache, const int64_t* slots, int64_t tokens,
              int64_t num_kv_heads, int64_t head_dim) {
    for (int64_t t = 0; t < tokens; ++t)
        for (int64_t h = 0; h < num_kv_heads; ++h) {
            const int64_t dst = (slots[t] * num_kv_heads + h) * head_dim;
            memcpy(k_cache + dst, k + t * k_stride_t + h * k_stride_h, head_dim * sizeof(T));
            memcpy(v_cache + dst, v + t * v_stride_t + h * v_stride_h, head_dim * sizeof(T));
        }
}

}  // namespace

extern "C" {

// Caches as for mixserve_paged_attention; k and v (tokens, num_kv_heads, head_dim), last dim contiguous.
int mixserve_store_kv(int dtype, const void* k, const void* v, int64_t k_stride_t, int64_t k_stride_h,
                      int64_t v_stride_t, int64_t v_stride_h, void* k_cache, void* v_cache,
                      const int64_t* slots, int64_t tokens, int64_t num_kv_heads, int64_t head_dim) {
    if (dtype == 0)
        store_kv(static_cast<const float*>(k), static_cast<const float*>(v), k_stride_t, k_stride_h, v_stride_t,
                 v_stride_h, static_cast<float*>(k_cache), static_cast<float*>(v_cache), slots, tokens,
                 num_kv_heads, head_dim);
    else if (dtype == 1)
        store_kv(static_cast<const uint16_t*>(k), static_cast<const uint16_t*>(v), k_stride_t, k_stride_h,
                 v_stride_t, v_stride_h, static_cast<uint16_t*>(k_cache), static_cast<uint16_t*>(v_cache), slots,
                 tokens, num_kv_heads, head_dim);
    else
        return 3;
    return 0;
}

// dtype: 0 = float32, 1 = bfloat16. Caches (num_blocks, block_size, num_kv_heads, head_dim) contiguous;
// q and out (T, num_heads, head_dim) with the given token and head strides (last dim contiguous).
// scale multiplies q.k; window (0: full causal) and softcap (0: none) as in Shape.
// Returns 0, or a positive code for arguments the kernel cannot take.
int mixserve_paged_attention(int dtype, const void* q, const void* k_cache, const void* v_cache, void* out,
                             const int64_t* query_start, const int64_t* seq_lens,
                             const int64_t* block_tables, int64_t num_seqs, int64_t max_blocks,
                             int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                             int64_t q_stride_t, int64_t q_stride_h, int64_t o_stride_t, int64_t o_stride_h,
                             float scale, int num_threads, int64_t window, float softcap) {
    if (head_dim > MAX_HEAD_DIM || num_kv_heads < 1 || num_heads % num_kv_heads != 0) return 1;
    if (num_heads / num_kv_heads > MAX_ROWS) return 2;
    if (window < 0 || softcap < 0.f) return 4;
    const Shape sh{num_heads, num_kv_heads, head_dim, block_size, max_blocks,
                   q_stride_t, q_stride_h, o_stride_t, o_stride_h, scale, window, softcap};
    if (dtype == 0)
        run(static_cast<const float*>(q), static_cast<const float*>(k_cache), static_cast<const float*>(v_cache),
            static_cast<float*>(out), query_start, seq_lens, block_tables, num_seqs, sh, num_threads);
    else if (dtype == 1)
        run(static_cast<const uint16_t*>(q), static_cast<const uint16_t*>(k_cache),
            static_cast<const uint16_t*>(v_cache), static_cast<uint16_t*>(out), query_start, seq_lens,
            block_tables, num_seqs, sh, num_threads);
    else
        return 3;
    return 0;
}

}  // extern "C"
