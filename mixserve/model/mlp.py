"""The dense gated MLP (SwiGLU or GeGLU) every family's layers run, and the parameter helper they share."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from mixserve.model.ops import LayerOps

if TYPE_CHECKING:
    from mixserve.model.weights import WeightSource


def param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


def activation_and_mul(activation: str, ops: LayerOps) -> Callable[[Tensor], Tensor]:
    """The gated activation by ModelConfig.activation: the ops' fused SiLU or GeGLU."""
    if activation == "silu":
        return ops.silu_and_mul
    if activation == "gelu_tanh":
        return ops.gelu_tanh_and_mul
    raise ValueError(f"unknown MLP activation {activation!r}; supported: silu, gelu_tanh")


@dataclass(frozen=True)
class MlpWeights:
    """The MLP's linears as the ops' `linear` takes them (see decoder.LayerWeights)."""

    gate_up: Any
    down: Any


class GatedMlp(nn.Module):
    """down(act(gate(x)) * up(x)), gate and up fused into one GEMM."""

    def __init__(self, hidden: int, intermediate: int, activation: str, dtype: torch.dtype,
                 device: torch.device):
        super().__init__()
        self.activation = activation
        self.gate_up = param(2 * intermediate, hidden, dtype=dtype, device=device)
        self.down = param(hidden, intermediate, dtype=dtype, device=device)

    def prepare(self, ops: LayerOps) -> None:
        self.packed = MlpWeights(gate_up=ops.pack(self.gate_up), down=ops.pack(self.down))
        self.act = activation_and_mul(self.activation, ops)

    def forward(self, x: Tensor, ops: LayerOps) -> Tensor:
        w = self.packed
        return ops.linear(self.act(ops.linear(x, w.gate_up, None)), w.down, None)

    def load(self, src: WeightSource, prefix: str) -> None:
        """From HF names under `prefix` ("model.layers.N.mlp."); quantized weights stay quantized."""
        src.put_linear(self, "gate_up", src.rows([prefix + "gate_proj.weight", prefix + "up_proj.weight"]),
                       prefix + "gate_up_proj.weight")
        src.put_linear(self, "down", src.raw(prefix + "down_proj.weight"), prefix + "down_proj.weight")
