// Which item kernels the paged attention kernel runs for a head dim: the decode item (paged_decode.h) and the
// chunk item (paged_chunk.h, or paged_chunk_bf16.h for bf16 where the CPU has AVX512-BF16), each compiled
// for the head dims below with their loops unrolled. Other head dims take the generic tile loop.
#pragma once
#include <stdint.h>

#include <type_traits>

#include "bf16_dot.h"
#include "paged_chunk.h"
#include "paged_chunk_bf16.h"
#include "paged_decode.h"
#include "paged_tiles.h"

namespace mixserve {

template <typename T>
struct ItemKernels {
    int64_t max_decode_row = 0;  // the largest row of every KV head (elements) the decode item takes
    void (*decode)(const Item&, const T*, const T*, const T*, T*, int64_t, const int64_t*, const Shape&) = nullptr;
    decltype(decode) decode_capped = nullptr;  // the decode item of a layer with a softcap
    void (*chunk)(const Item&, const T*, const T*, const T*, T*, const int64_t*, const int64_t*, const int64_t*,
                  const Shape&) = nullptr;
};

template <typename T, int DC>
ItemKernels<T> kernels_for() {
    ItemKernels<T> k;
    k.decode = attend_decode<T, DC, false>;
    k.decode_capped = attend_decode<T, DC, true>;
    k.max_decode_row = decode_reads_in_place<T, DC>() ? INT64_MAX : MAX_DECODE_ROW;
    if constexpr (BF16_DOT && std::is_same_v<T, uint16_t> && DC % 32 == 0)
        k.chunk = attend_chunk_bf16<DC>;  // vdpbf16ps on the cache's bf16 (bf16_dot.h)
    else
        k.chunk = attend_chunk<T, DC>;
    return k;
}

// Head dims of the Llama family and its neighbours (32: tiny models, 80: StableLM, 96: Phi-3, 256: Gemma);
// null kernels for the rest. A head dim of 80 in bf16 widens to float32 (vdpbf16ps takes pairs of 16-lane halves).
template <typename T>
ItemKernels<T> item_kernels(int64_t head_dim) {
    switch (head_dim) {
        case 32: return kernels_for<T, 32>();
        case 64: return kernels_for<T, 64>();
        case 80: return kernels_for<T, 80>();
        case 96: return kernels_for<T, 96>();
        case 128: return kernels_for<T, 128>();
        case 256: return kernels_for<T, 256>();
        default: return {};
    }
}

}  // namespace mixserve
