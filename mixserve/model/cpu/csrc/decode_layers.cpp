// A stack of dense decoder layers on quantized weights in one call, for the few rows of a decode step.
//
// The same kernels in the same order as the Python layer body (decoder.DecoderLayer.forward), so the output
// is bit-identical; what goes is the ~12 Python->C calls a layer and their tensors, which on a one-token step
// of a small model cost about as much as a third of its weights' reading (docs/decisions/decode-layer-stack.md).

#include <cstdint>
#include <cstring>

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
    const float* input_norm;
    const float* post_norm;
    const float* cos;  // this layer's RoPE table (max_position, head_dim / 2)
    const float* sin;
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

}  // namespace

extern "C" {

// hidden (m, hidden) float32: in, the first layer's input; out, the last layer's MLP output. residual
// (m, hidden): out, the residual stream beside it (their sum is the stack's output, as the Python body
// carries it). work: m * (hidden + q/k/v width + heads * head_dim + 3 * inter) floats of scratch.
// 0, or the failing kernel's code.
int mixserve_decode_layers(const StackShape* sh, const LayerSpec* layers, int64_t num_layers, const StepBatch* b,
                           float* hidden, float* residual, float* work, int threads) {
    const int64_t m = b->tokens, h = sh->hidden, d = sh->head_dim;
    const int64_t q_size = sh->heads * d, kv_size = sh->kv_heads * d, nqkv = q_size + 2 * kv_size;
    float* x = work;
    float* qkv = x + m * h;
    float* att = qkv + m * nqkv;
    float* gate_up = att + m * q_size;
    float* act = gate_up + m * 2 * sh->inter;
    const int int8 = sh->int8_inputs;
    for (int64_t l = 0; l < num_layers; ++l) {
        const LayerSpec& L = layers[l];
        int rc;
        if (l == 0) {  // the first layer's input is whole: it is the residual stream
            std::memcpy(residual, hidden, sizeof(float) * m * h);
            rc = mixserve_rms_norm(0, hidden, h, nullptr, L.input_norm, x, m, h, sh->eps, threads);
        } else {
            rc = mixserve_rms_norm(0, hidden, h, residual, L.input_norm, x, m, h, sh->eps, threads);
        }
        if (rc == 0) rc = mixserve::quant_linear(L.qkv, x, m, qkv, int8, threads);
        if (rc == 0)
            rc = mixserve_rotary(0, qkv, nqkv, d, m, sh->heads + sh->kv_heads, d, L.cos, L.sin, b->positions,
                                 threads);
        if (rc == 0)
            rc = mixserve_store_kv(0, qkv + q_size, qkv + q_size + kv_size, nqkv, d, nqkv, d, L.k_cache,
                                   L.v_cache, b->slots, m, sh->kv_heads, d);
        if (rc == 0)
            rc = mixserve_paged_attention(0, qkv, L.k_cache, L.v_cache, att, b->query_start, b->seq_lens,
                                          b->block_tables, b->num_seqs, b->max_blocks, sh->heads, sh->kv_heads, d,
                                          sh->block_size, nqkv, d, q_size, d, L.scale, threads, L.window,
                                          L.softcap);
        if (rc == 0) rc = mixserve::quant_linear(L.o, att, m, hidden, int8, threads);
        if (rc == 0) rc = mixserve_rms_norm(0, hidden, h, residual, L.post_norm, x, m, h, sh->eps, threads);
        if (rc == 0) rc = mixserve::quant_linear(L.gate_up, x, m, gate_up, int8, threads);
        if (rc == 0)
            rc = sh->gelu ? mixserve_gelu_tanh_and_mul(0, gate_up, act, m, sh->inter, threads)
                          : mixserve_silu_and_mul(0, gate_up, act, m, sh->inter, threads);
        if (rc == 0) rc = mixserve::quant_linear(L.down, act, m, hidden, int8, threads);
        if (rc != 0) return rc;
    }
    return 0;
}

}  // extern "C"
