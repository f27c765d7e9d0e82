"""The mixture-of-experts MLP (Qwen3-MoE, Mixtral): a router picks `top_k` gated MLPs per token, and the
step's tokens run grouped by expert: one gate/up GEMM, activation and down GEMM per active expert on its rows,
through the ops' packed linears (on a CPU the prepacked GEMMs, and the few-row kernels decode steps hit).
A GGUF file's experts stay in their blocks where the dense linears do (cpu/quant_linear.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from mixserve.model.config import ModelConfig
from mixserve.model.cpu.quant_linear import QuantWeight
from mixserve.model.mlp import MlpWeights, activation_and_mul, param
from mixserve.model.ops import LayerOps
from mixserve.model.weights import dense

if TYPE_CHECKING:
    from mixserve.model.weights import WeightSource


def route(logits: Tensor, top_k: int, renormalise: bool, weights_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(weights, experts), each (T, top_k), of router logits (T, E) as HF's routers compute them: softmax in
    float32 over every expert, the top k, renormalised to sum to 1 where asked (Mixtral always: the same as
    a softmax over the top k logits), then cast to `weights_dtype`."""
    weights, experts = torch.topk(torch.softmax(logits.float(), dim=-1), top_k, dim=-1)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(weights_dtype), experts


@dataclass(frozen=True)
class SparseWeights:
    """The router's and the experts' linears as the ops' `linear` takes them (a plain attribute, not
    parameters: see decoder.LayerWeights)."""

    router: Any
    experts: tuple[MlpWeights, ...]


class SparseMlp(nn.Module):
    """Router (mlp.gate) and `num_experts` gated MLPs, each expert's gate and up fused into one weight."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        moe = cfg.moe
        if moe is None:
            raise ValueError("SparseMlp needs a ModelConfig with a MoeConfig")
        e, h, i = moe.num_experts, cfg.hidden_size, moe.intermediate_size
        self.num_experts, self.top_k, self.renormalise, self.inter = e, moe.top_k, moe.norm_topk_prob, i
        self.activation = cfg.activation
        self.weights_dtype = dtype if moe.weights_in_model_dtype else torch.float32
        self.gate = param(e, h, dtype=dtype, device=device)
        self.gate_up = param(e, 2 * i, h, dtype=dtype, device=device)
        self.down = param(e, h, i, dtype=dtype, device=device)
        self.quantized: tuple[tuple[QuantWeight, QuantWeight], ...] = ()  # (gate_up, down) per expert if kept
        # 0..E: searched in the sorted expert ids, they give where each expert's rows start and end
        self.register_buffer("expert_ids", torch.arange(e + 1, device=device), persistent=False)

    def prepare(self, ops: LayerOps) -> None:
        """Pack the router and each expert's two weights for `ops` (views of the loaded ones: no copy where
        the ops take the plain weight)."""
        weights = self.quantized or tuple((self.gate_up[j], self.down[j]) for j in range(self.num_experts))
        experts = tuple(MlpWeights(gate_up=ops.pack(gu), down=ops.pack(d)) for gu, d in weights)
        self.packed = SparseWeights(router=ops.pack(self.gate), experts=experts)
        self.act = activation_and_mul(self.activation, ops)
        self.native = None  # the experts' C++ loop, where the CPU ops packed every expert for one
        if ops.name.endswith("+cpp"):
            from mixserve.model.cpu import moe_experts

            self.native = moe_experts.plan([(w.gate_up, w.down) for w in experts], self.gate.dtype,
                                           self.gate.shape[1], self.inter, self.activation, ops.name)

    def forward(self, x: Tensor, ops: LayerOps) -> Tensor:
        """x (T, hidden) -> the weighted sum of each token's top_k experts, (T, hidden) in x's dtype."""
        logits = ops.linear(x, self.packed.router, None)  # in the model's dtype, as HF's router linear
        weights, experts = route(logits, self.top_k, self.renormalise, self.weights_dtype)
        if x.is_cuda and torch.cuda.is_current_stream_capturing():  # (quantized experts load on a CPU only)
            return self.all_experts(x, weights, experts)
        return self.grouped(x, weights, experts, ops)

    def grouped(self, x: Tensor, weights: Tensor, experts: Tensor, ops: LayerOps) -> Tensor:
        """Each active expert once, on the rows routed to it: (token, choice) pairs sorted by expert, one
        gather of their rows, the GEMMs of each expert on its run of them, then each token's weighted sum."""
        if self.native is not None:  # the same steps in C++, bit for bit, around the experts' C++ loop
            rows, starts, order = self.native.dispatch(x, experts)
            out = torch.empty_like(rows)
            self.run_left(self.native.run(rows, starts, out), rows, starts, out, ops)
            return self.native.combine(out, weights, order)
        t, k = experts.shape
        sorted_ids, order = torch.sort(experts.flatten(), stable=True)
        rows = x.index_select(0, order // k)
        starts = torch.searchsorted(sorted_ids, self.expert_ids)  # where each expert's run of rows starts
        out = torch.empty_like(rows)
        self.run_left(range(self.num_experts), rows, starts, out, ops)
        # weight * output in HF's dtypes (Mixtral's float32 weights promote the product), then each token's
        # sum over its choices
        scaled = (out * weights.flatten()[order].unsqueeze(1)).to(x.dtype)
        if x.is_cuda:  # index_add_'s atomics would add in a varying order there: back to pair order and sum
            return torch.empty_like(scaled).index_copy_(0, order, scaled).view(t, k, -1).sum(1)
        return torch.zeros_like(x).index_add_(0, order // k, scaled)  # on a CPU in row order: expert order

    def run_left(self, left: Sequence[int], rows: Tensor, starts: Tensor, out: Tensor, ops: LayerOps) -> None:
        """Experts `left` (all, or those the C++ loop could not take) on their runs of rows, into `out`
        (the layer's one host sync: the bounds)."""
        bounds = starts.tolist() if left else []
        for j in left:
            a, b = bounds[j], bounds[j + 1]
            if a < b:
                w = self.packed.experts[j]
                out[a:b] = ops.linear(self.act(ops.linear(rows[a:b], w.gate_up, None)), w.down, None)

    def all_experts(self, x: Tensor, weights: Tensor, experts: Tensor) -> Tensor:
        """Every expert on every row, weighted 0 where not chosen: no shape depends on the routing and no host
        sync, so a CUDA graph can capture it (num_experts / top_k times the FLOPs: decode graphs only)."""
        dense = torch.zeros(x.shape[0], self.num_experts, dtype=weights.dtype, device=x.device)
        dense.scatter_(1, experts, weights)
        h = torch.matmul(x, self.gate_up.transpose(1, 2))  # (E, T, 2I)
        act = self.act(h.view(-1, h.shape[-1])).view(self.num_experts, x.shape[0], -1)
        y = torch.bmm(act, self.down.transpose(1, 2))  # (E, T, hidden)
        return (y * dense.t().unsqueeze(-1)).sum(0).to(x.dtype)

    def load(self, src: WeightSource, prefix: str) -> None:
        """From the canonical names under `prefix` ("model.layers.N.mlp."): gate.weight (the router) and
        experts.J.{gate,up,down}_proj.weight (families/moe.py renames and splits the others' into these).
        Experts all quantized (a GGUF file's, kept in their blocks) stay so; else they load as floats."""
        src.put(self.gate, src.take(prefix + "gate.weight"), prefix + "gate.weight")
        names = [(f"{prefix}experts.{j}.gate_up_proj.weight", f"{prefix}experts.{j}.down_proj.weight")
                 for j in range(self.num_experts)]
        kept = [(src.rows([gu.replace("gate_up", "gate"), gu.replace("gate_up", "up")]), src.raw(d))
                for gu, d in names]
        for j, ((gu_name, d_name), (gu, d)) in enumerate(zip(names, kept, strict=True)):
            src.check(self.gate_up[j], gu, gu_name)
            src.check(self.down[j], d, d_name)
        if all(isinstance(w, QuantWeight) for pair in kept for w in pair):
            self.quantized = tuple(kept)  # type: ignore[assignment]  (all QuantWeight: checked above)
            for attr in ("gate_up", "down"):  # never touched, so never resident: the blocks replace them
                self._parameters.pop(attr)
            return
        for j, (gu, d) in enumerate(kept):
            self.gate_up[j].copy_(dense(gu))
            self.down[j].copy_(dense(d))
