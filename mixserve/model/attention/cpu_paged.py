"""The CPU backend: one C++ call per layer attends a whole mixed batch, reading K/V in the paged cache.

Where the reference backend gathers every sequence's context into a dense copy (half of a CPU decode
step's time went to that `index_select`) and calls SDPA once per prefill chunk, this one writes the
step's K/V into the cache and hands the kernel (model/cpu/csrc/paged_attention.cpp) the pointers: decodes
and chunks, every layer, with no per-chunk Python. float32 and bfloat16 (bf16 products through vdpbf16ps
where the CPU has AVX512-BF16, else widened to float32; the sums are float32's either way). A layer's scale,
sliding window and softcap go to the kernel as they are: a window only moves where each row's keys start.
"""

from __future__ import annotations

import torch

from mixserve.model.attention.base import AttentionBackend, AttentionMetadata, check_features
from mixserve.model.cpu.build import load_library
from mixserve.model.cpu.layer_ops import DTYPE_CODE


class CpuPagedAttention(AttentionBackend):
    """Paged attention for mixed batches on the CPU (C++ kernel built once per machine)."""

    name = "cpu"

    def __init__(self) -> None:
        lib = load_library()  # KernelBuildError when it cannot be built
        self._attend, self._store = lib.mixserve_paged_attention, lib.mixserve_store_kv

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, *, scale: float | None = None,
                window: int = 0, softcap: float = 0.0) -> torch.Tensor:
        scale = check_features(q.shape[-1], scale, window, softcap)
        window = window if window < 1 << 30 else 0  # past any context: full attention (int32 in the kernel)
        code = DTYPE_CODE.get(q.dtype)
        if code is None or q.device.type != "cpu":
            raise ValueError(f"the cpu attention backend takes float32 or bfloat16 on the CPU, got {q.dtype} "
                             f"on {q.device}: use attention_backend = 'torch'")
        if q.stride(-1) != 1 or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("the cpu attention backend needs q's head dim and the caches contiguous")
        t, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[2]
        if k.stride(-1) != 1 or v.stride(-1) != 1:
            raise ValueError("the cpu attention backend needs k's and v's head dim contiguous")
        self._store(code, k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                    k_cache.data_ptr(), v_cache.data_ptr(), meta.slot_mapping.data_ptr(), t, num_kv_heads,
                    head_dim)
        out = torch.empty((t, num_heads, head_dim), dtype=q.dtype)
        tables = meta.block_tables
        rc = self._attend(
            code, q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
            meta.query_start.data_ptr(), meta.seq_lens.data_ptr(), tables.data_ptr(),
            tables.shape[0], tables.shape[1], num_heads, num_kv_heads, head_dim, k_cache.shape[1],
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), scale, torch.get_num_threads(), window,
            softcap,
        )
        if rc != 0:
            raise ValueError(f"the cpu attention kernel cannot take this shape (code {rc}): "
                             f"{num_heads} heads, {k_cache.shape[2]} KV heads, head dim {head_dim}")
        return out
