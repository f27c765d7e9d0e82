"""The small per-layer ops of the CPU set as single C++ calls (csrc/layer_ops.cpp), float32 and bfloat16.

Eager PyTorch spends ~20 small ops a layer on norms, RoPE and SwiGLU, each 10-30 us of dispatch on a CPU:
for one decoded token that is more than the time to read the layer's weights. Here each is one call.
Inputs must be CPU tensors of the model's dtype with a contiguous last dimension.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mixserve.model.cpu.build import load_library

DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1}


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise ValueError(f"the CPU {what} kernel cannot take these inputs (code {rc})")


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm of each row of x (T, H) (rows may be strided), as HF computes it."""
    out = torch.empty(x.shape, dtype=x.dtype)
    rc = load_library().mixserve_rms_norm(DTYPE_CODE[x.dtype], x.data_ptr(), x.stride(0), None,
                                          weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps,
                                          torch.get_num_threads())
    _check(rc, "RMSNorm")
    return out


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(RMSNorm(x + residual), x + residual); the sum is written into `residual` (contiguous), which the
    layer body hands on as the next residual, so no tensor is allocated for it."""
    out = torch.empty(residual.shape, dtype=residual.dtype)
    rc = load_library().mixserve_rms_norm(DTYPE_CODE[x.dtype], x.data_ptr(), x.stride(0), residual.data_ptr(),
                                          weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps,
                                          torch.get_num_threads())
    _check(rc, "RMSNorm")
    return out, residual


def _act_and_mul(gate_up: Tensor, name: str, what: str) -> Tensor:
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, inter), dtype=gate_up.dtype)
    rc = getattr(load_library(), name)(DTYPE_CODE[gate_up.dtype], gate_up.data_ptr(), out.data_ptr(), rows,
                                       inter, torch.get_num_threads())
    _check(rc, what)
    return out


def silu_and_mul(gate_up: Tensor) -> Tensor:
    """SiLU(gate) * up of a (T, 2I) contiguous tensor holding gate then up: (T, I)."""
    return _act_and_mul(gate_up, "mixserve_silu_and_mul", "SiLU-and-mul")


def gelu_tanh_and_mul(gate_up: Tensor) -> Tensor:
    """GeGLU: tanh-approximated GELU(gate) * up, as silu_and_mul lays them out."""
    return _act_and_mul(gate_up, "mixserve_gelu_tanh_and_mul", "GELU-and-mul")


def rotary_(qk: Tensor, cos: Tensor, sin: Tensor, positions: Tensor) -> None:
    """Rotate-half RoPE in place on every head of qk (T, H, D) (a strided view is fine), at `positions`;
    cos/sin (max_position, D/2) in qk's dtype."""
    rc = load_library().mixserve_rotary(DTYPE_CODE[qk.dtype], qk.data_ptr(), qk.stride(0), qk.stride(1),
                                        qk.shape[0], qk.shape[1], qk.shape[2], cos.data_ptr(), sin.data_ptr(),
                                        positions.data_ptr(), torch.get_num_threads())
    _check(rc, "RoPE")
