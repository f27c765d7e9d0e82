"""Triton kernels for the CUDA path: fewer, larger launches per decoder layer.

A decode step of a small model is launch-bound: eager PyTorch spends ~50 kernels a layer on norms, RoPE,
activations, cache writes and a gathered attention. These kernels fuse each of those into one launch:

  norm.py              rms_norm, add_rms_norm (residual add + RMSNorm in one pass)
  activation.py        silu_and_mul (SwiGLU's gate * up)
  rope.py              rotary_qk_ (RoPE on q and k in place, cos/sin read at each token's position)
  paged_attention.py   store_kv (K and V into the paged cache), paged_decode_attention (flash-decoding
                       over block tables: K/V read once, straight from the cache)
  varlen_attention.py  paged_varlen_attention (a whole mixed batch, decodes and prefill chunks, in one
                       launch: causal tiles of one sequence's queries over its pages, no gather, no padding)
  paged_tiles.py       what both attention kernels share: a KV tile read through a block table, and one
                       step of the online softmax
  self_check.py        every kernel against its reference on the device at start-up (off on a failure)

Each kernel module imports triton at module level, so import them only after `use_triton(tensor)` said
yes. The model calls them only for CUDA tensors; the CPU path stays pure PyTorch. Tests run every kernel
on CPU tensors through Triton's interpreter (TRITON_INTERPRET=1, set in tests/conftest.py), against the
PyTorch reference each module also exports.

`MIXSERVE_TRITON=0` in the environment, or `set_enabled(False)`, turns the kernels off (the eager PyTorch
ops run instead), so their effect can be measured side by side (bench/gpu_bench.py does).
"""

from __future__ import annotations

import importlib.util
import os

import torch

# RMSNorm holds a whole row in one program's registers: wider models keep the eager PyTorch layers.
NORM_MAX_HIDDEN = 8192

_enabled = os.environ.get("MIXSERVE_TRITON", "1") != "0"
_importable: bool | None = None


def triton_importable() -> bool:
    """True when the triton package is installed (checked once, without importing it)."""
    global _importable
    if _importable is None:
        _importable = importlib.util.find_spec("triton") is not None
    return _importable


def set_enabled(enabled: bool) -> None:
    """Turn the Triton kernels on or off for later calls (graphs already captured keep what they hold)."""
    global _enabled
    _enabled = enabled


def enabled() -> bool:
    """Whether the kernels are turned on (they still run only for CUDA tensors with triton installed)."""
    return _enabled


def use_triton(t: torch.Tensor) -> bool:
    """True when `t` lives on a CUDA device, triton is installed and the kernels are enabled."""
    return t.is_cuda and _enabled and triton_importable()
