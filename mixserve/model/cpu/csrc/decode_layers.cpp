// A stack of dense decoder layers on quantized weights in one call, for the few rows of a decode step, in
// float32 or bfloat16 activations.
//
// The same kernels in the same order as the Python layer body (decoder.DecoderLayer.forward), so the output
// is bit-identical; what goes is the ~12 Python->C calls a layer and their tensors, which on a one-token step
// of a small model cost about as much as a third of its weights' reading (docs/decisions/decode-layer-stack.md).

#include <cstdint>
#include <cstring>

#include "common.h"
#include "quant_spec.h"

extern "C" {
int mixserve_rms_norm(int dtype, const void* x, int64_t x_stride, void* residual, const void* w, void* out,
                      int64_t rows, int64_t hidden, float eps, int num_threads);
int mixserve_rotary(int dtype, void* qk, int64_t stride_t, int64_t stride_h, int64_t rows, int64_t heads,
                    int64_t head_dim, const void* cos, const void* sin, const int64_t* positions, int num_threads);
int mixserve_store_kv(int dtype, const void* k, const void* v, int64_t k_stride_t, int64_t k_stride_h,
                      int64_t v_stride_t, int64_t v_stride_h, void* k_cache, void* v_cache, const int64_t* slots,
                      int64_t tokens, int64_t num_kv_heads, int64_t head_dim);
int mixserve_paged_attention(int dtype, const void* q, const void* k_cache, const void* v_cache, void* out,
                             const int64_t* query_start, const int64_t* seq_lens, const int64_t* block_tables,
                             int64_t num_seqs, int64_t max_blocks, int64_t num_heads, int64_t num_kv_heads,
                             int64_t head_dim, int64_t block_size, int64_t q_stride_t, int64_t q_stride_h,
                             int64_t o_stride_t, int64_t o_stride_h, float scale, int num_threads, int64_t window,
                             float softcap);
int mixserve_silu_and_mul(int dtype, const void* gate_up, void* out, int64_t rows, int64_t inter, int num_threads);
int mixserve_gelu_tanh_and_mul(int dtype, const void* gate_up, void* out, int64_t rows, int64_t inter,
                               int num_threads);
}

namespace {

struct LayerSpec {
    mixserve::QuantLinearSpec qkv, o, gate_up, down;
    const void* input_norm;  // the norms' weights and the RoPE tables are in the stack's dtype
    const void* post_norm;
    const void* cos;  // this layer's RoPE table (max_position, head_dim / 2)
    const void* sin;
    void* k_cache;  // (num_blocks, block_size, kv_heads, head_dim)
    void* v_cache;
    float scale, softcap;
    int64_t window;  // 0: full causal
};

struct StackShape {
    int64_t hidden, heads, kv_heads, head_dim, inter, block_size;
    float eps;
    int32_t gelu;         // 1: GeGLU (tanh), 0: SiLU
    int32_t int8_inputs;  // quant_linear.INT8_INPUTS
    int32_t dtype;        // the activations' and the KV cache's: 0 float32, 1 bfloat16
};

// The step's tokens and sequences, as AttentionMetadata holds them (int64, contiguous).
struct StepBatch {
    int64_t tokens;
    const int64_t* positions;
    const int64_t* slots;
    const int64_t* query_start;
    const int64_t* seq_lens;
    const int64_t* block_tables;
    int64_t num_seqs, max_blocks;
};

// out (m, n) = x @ w.T in the stack's dtype. bf16 rows are widened into `wide` and the float32 product
// is rounded into out once, as the Python body's quant_linear.linear does for bf16 inputs of few rows.
int linear(const mixserve::QuantLinearSpec& w, const float* x, int64_t m, float* out, int int8, int threads,
           float*, float*) {
    return mixserve::quant_linear(w, x, m, out, int8, threads);
}

int linear(const mixserve::QuantLinearSpec& w, const uint16_t* x, int64_t m, uint16_t* out, int int8,
           int threads, float* wide, float* product) {
    for (int64_t i = 0; i < m * w.k; ++i) wide[i] = mixserve::bf16_to_float(x[i]);
    const int rc = mixserve::quant_linear(w, wide, m, product, int8, threads);
    for (int64_t i = 0; i < m * w.n; ++i) out[i] = mixserve::float_to_bf16(product[i]);
    return rc;
}

template <typename T>
int run_layers(const StackShape* sh, const LayerSpec* layers, int64_t num_layers, const StepBatch* b, T* hidden,
               T* residual, T* work, float* wide, float* product, int threads) {
    const int64_t m = b->tokens, h = sh->hidden, d = sh->head_dim;
    const int64_t q_size = sh->heads * d, kv_size = sh->kv_heads * d, nqkv = q_size + 2 * kv_size;
    const int dt = sh->dtype, int8 = sh->int8_inputs;
    T* x = work;
    T* qkv = x + m * h;
    T* att = qkv + m * nqkv;
    T* gate_up = att + m * q_size;
    T* act = gate_up + m * 2 * sh->inter;
    for (int64_t l = 0; l < num_layers; ++l) {
        const LayerSpec& L = layers[l];
        int rc;
        if (l == 0) {  // the first layer's input is whole: it is the residual stream
            std::memcpy(residual, hidden, sizeof(T) * m * h);
            rc = mixserve_rms_norm(dt, hidden, h, nullptr, L.input_norm, x, m, h, sh->eps, threads);
        } else {
            rc = mixserve_rms_norm(dt, hidden, h, residual, L.input_norm, x, m, h, sh->eps, threads);
        }
        if (rc == 0) rc = linear(L.qkv, x, m, qkv, int8, threads, wide, product);
        if (rc == 0)
            rc = mixserve_rotary(dt, qkv, nqkv, d, m, sh->heads + sh->kv_heads, d, L.cos, L.sin, b->positions,
                                 threads);
        if (rc == 0)
            rc = mixserve_store_kv(dt, qkv + q_size, qkv + q_size + kv_size, nqkv, d, nqkv, d, L.k_cache,
                                   L.v_cache, b->slots, m, sh->kv_heads, d);
        if (rc == 0)
            rc = mixserve_paged_attention(dt, qkv, L.k_cache, L.v_cache, att, b->query_start, b->seq_lens,
                                          b->block_tables, b->num_seqs, b->max_blocks, sh->heads, sh->kv_heads, d,
                                          sh->block_size, nqkv, d, q_size, d, L.scale, threads, L.window,
                                          L.softcap);
        if (rc == 0) rc = linear(L.o, att, m, hidden, int8, threads, wide, product);
        if (rc == 0) rc = mixserve_rms_norm(dt, hidden, h, residual, L.post_norm, x, m, h, sh->eps, threads);
        if (rc == 0) rc = linear(L.gate_up, x, m, gate_up, int8, threads, wide, product);
        if (rc == 0)
            rc = sh->gelu ? mixserve_gelu_tanh_and_mul(dt, gate_up, act, m, sh->inter, threads)
                          : mixserve_silu_and_mul(dt, gate_up, act, m, sh->inter, threads);
        if (rc == 0) rc = linear(L.down, act, m, hidden, int8, threads, wide, product);
        if (rc != 0) return rc;
    }
    return 0;
}

}  // namespace

extern "C" {

// hidden (m, hidden) in the stack's dtype: in, the first layer's input; out, the last layer's MLP output.
// residual (m, hidden): out, the residual stream beside it (their sum is the stack's output, as the Python
// body carries it). work: m * (hidden + q/k/v width + heads * head_dim + 3 * inter) elements of scratch in
// that dtype, and for bf16 also wide and product, float32 (m * the widest k, m * the widest n); null for
// float32. 0, or the failing kernel's code (-1: an unknown dtype).
int mixserve_decode_layers(const StackShape* sh, const LayerSpec* layers, int64_t num_layers, const StepBatch* b,
                           void* hidden, void* residual, void* work, float* wide, float* product, int threads) {
    if (sh->dtype == 0)
        return run_layers(sh, layers, num_layers, b, static_cast<float*>(hidden), static_cast<float*>(residual),
                          static_cast<float*>(work), wide, product, threads);
    if (sh->dtype == 1)
        return run_layers(sh, layers, num_layers, b, static_cast<uint16_t*>(hidden),
                          static_cast<uint16_t*>(residual), static_cast<uint16_t*>(work), wide, product, threads);
    return -1;
}

}  // extern "C"
