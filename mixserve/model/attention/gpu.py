"""GpuAttention: the GPU fast path, composed once from a decode part and a packed part.

Decode-only steps (one token per sequence) whose contexts the decode part takes run it; every other step
runs the packed part, one launch per layer for decodes and prefill chunks together. Which kernels, is
decided once per device (`configure`, or the first `prepare`):

  decode part   "triton": paged flash-decoding reading K/V in place (kernels/paged_attention.py), where
                `kernels.use_triton` says yes; "dense": batched matmuls over K/V gathered to a capacity
                (dense_decode.py)
  packed part   "triton": the paged varlen kernel (packed_varlen.py) where `kernels.use_triton` says yes;
                "flex": FlexAttention over a gathered, packed KV view (packed_flex.py)

The decode part's launches depend only on (S, capacity), so it also serves CUDA graphs: the backend's
decode_capacity and graph_metadata hooks are all runner/cuda_graph.py knows of it. Metadata is built once
per forward on the host (base.flatten) and sent in one H2D copy; `forward` per layer writes the cache
(one Triton store_kv launch where use_triton, sdpa.write_kv) and runs the part its plan names, with the
layer's scale, window and softcap (per-layer constants: a CUDA graph captures each layer with its own).
On a CPU (no triton) it is dense decode and eager FlexAttention: correct, for tests, not fast.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from mixserve import kernels
from mixserve.core import ForwardBatch
from mixserve.model.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    GraphInputs,
    build_metadata,
    check_features,
    is_decode_only,
)
from mixserve.model.attention.dense_decode import DecodePlan, DenseDecode
from mixserve.model.attention.packed_flex import FlexPacked
from mixserve.model.attention.packed_varlen import VarlenPacked
from mixserve.model.attention.sdpa import write_kv

DECODE_KERNELS = ("auto", "triton", "dense")  # GpuAttention(decode_kernel=...)
PACKED_KERNELS = ("auto", "triton", "flex")  # GpuAttention(packed_kernel=...)


class DecodePart(Protocol):
    name: str

    def capacity(self, seq_lens: Sequence[int], block_size: int) -> int | None:
        """Context capacity for decodes of these context lengths; None: they go to the packed part."""

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
               plan: DecodePlan, scale: float | None, window: int, softcap: float) -> torch.Tensor: ...


class PackedPart(Protocol):
    name: str

    def prepare(self, batch: ForwardBatch, block_size: int, device: torch.device) -> AttentionMetadata: ...

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, meta: AttentionMetadata, scale: float | None, window: int,
               softcap: float) -> torch.Tensor: ...


def paged_capacity(max_seq_len: int, block_size: int) -> int:
    """Context capacity for the paged Triton decode kernel: a power of two, in whole blocks.

    That kernel reads each sequence only up to its own length (on the device), so a larger capacity
    costs only block-table columns and early-exiting programs, not K/V reads; powers of two mean a
    handful of capacities, so few graphs are captured (and few captures stall a serving engine).
    """
    n = max(max_seq_len, block_size, 1)
    return -(-(1 << (n - 1).bit_length()) // block_size) * block_size


class TritonDecode:
    """The decode part on the paged flash-decoding kernel: takes every decode-only step."""

    name = "triton"

    def capacity(self, seq_lens: Sequence[int], block_size: int) -> int | None:
        return paged_capacity(max(seq_lens), block_size)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
               plan: DecodePlan, scale: float | None, window: int, softcap: float) -> torch.Tensor:
        from mixserve.kernels.paged_attention import paged_decode_attention  # imports triton

        return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, plan.ctx, scale,
                                      window=window, softcap=softcap)


class GpuAttention(AttentionBackend):
    """A decode part and a packed part behind one backend (attention_backend "gpu", alias "flex")."""

    name = "gpu"
    supports_graphs = True

    def __init__(self, compile: bool | None = None, decode_kernel: str = "auto",
                 packed_kernel: str = "auto") -> None:
        if decode_kernel not in DECODE_KERNELS:
            raise ValueError(f"decode_kernel must be one of {', '.join(DECODE_KERNELS)}, "
                             f"got {decode_kernel!r}")
        if packed_kernel not in PACKED_KERNELS:
            raise ValueError(f"packed_kernel must be one of {', '.join(PACKED_KERNELS)}, "
                             f"got {packed_kernel!r}")
        self.compile = compile  # FlexAttention: None compiles on CUDA only
        self.decode_kernel, self.packed_kernel = decode_kernel, packed_kernel
        self._group = 1  # the model's GQA group (configure): sizes the varlen kernel's query tiles
        self._parts: tuple[DecodePart, PackedPart] | None = None

    def configure(self, num_heads: int, num_kv_heads: int, device: torch.device | None = None) -> None:
        """The GQA group sizes the varlen kernel's tiles; with the device the parts are composed now
        (the runner calls this after the kernels' start-up self-check, which may turn them off)."""
        self._group = max(1, num_heads // max(1, num_kv_heads))
        if device is not None:
            self.parts(torch.device(device))

    def parts(self, device: torch.device | None = None) -> tuple[DecodePart, PackedPart]:
        """(decode part, packed part), composed on the first call from the kernels usable on `device`."""
        if self._parts is None:
            if device is None:
                raise ValueError("GpuAttention has no device yet: configure it or prepare a batch first")
            triton = kernels.use_triton(torch.empty(0, device=device))
            kernel = self.decode_kernel if self.decode_kernel != "auto" else "triton" if triton else "dense"
            decode = TritonDecode() if kernel == "triton" else DenseDecode()
            # Triton needs use_triton: a CPU, a missing triton or kernels off after a failed self-check all
            # keep FlexAttention, whatever packed_kernel says.
            packed = VarlenPacked(self._group) if triton and self.packed_kernel != "flex" \
                else FlexPacked(self.compile)
            self._parts = (decode, packed)
        return self._parts

    @property
    def fallback_reason(self) -> str | None:
        """Why FlexAttention failed here (mixed steps then run per-sequence SDPA); None when it did not."""
        return getattr(self._parts[1], "fallback_reason", None) if self._parts else None

    def prepare(self, batch: ForwardBatch, block_size: int, device: torch.device) -> AttentionMetadata:
        """The decode part's plan for decode-only steps it takes, else the packed part's metadata."""
        decode, packed = self.parts(device)
        if is_decode_only(batch):
            ctx = decode.capacity([s.start + 1 for s in batch.seqs], block_size)
            if ctx is not None:
                meta = build_metadata(batch, block_size, device, width=ctx // block_size)
                meta.plan = DecodePlan(ctx=ctx, block_size=block_size)
                return meta
        return packed.prepare(batch, block_size, device)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, *, scale: float | None = None,
                window: int = 0, softcap: float = 0.0) -> torch.Tensor:
        """q (T, Hq, D), k/v (T, Hkv, D); writes k/v into the caches, returns (T, Hq, D)."""
        check_features(q.shape[-1], scale, window, softcap)
        decode, packed = self.parts(q.device)
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if isinstance(meta.plan, DecodePlan):
            return decode.attend(q, k_cache, v_cache, meta, meta.plan, scale, window, softcap)
        return packed.attend(q, k, v, k_cache, v_cache, meta, scale, window, softcap)

    def decode_capacity(self, seq_lens: Sequence[int], block_size: int) -> int | None:
        return self.parts()[0].capacity(seq_lens, block_size)

    def graph_metadata(self, inputs: GraphInputs, ctx: int, block_size: int) -> AttentionMetadata:
        size = inputs.positions.shape[0]
        device = inputs.positions.device
        return AttentionMetadata(
            positions=inputs.positions, slot_mapping=inputs.slot_mapping,
            query_start=torch.arange(size + 1, dtype=torch.int64, device=device),
            seq_lens=inputs.seq_lens, block_tables=inputs.block_tables,
            last_token_index=torch.arange(size, dtype=torch.int64, device=device),
            query_lens_cpu=[1] * size,
            seq_lens_cpu=[1] * size,  # unread by the decode parts: the real lengths live on the device
            plan=DecodePlan(ctx=ctx, block_size=block_size))
