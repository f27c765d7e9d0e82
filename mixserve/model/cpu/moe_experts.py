"""A mixture-of-experts layer's experts as one C++ call (csrc/moe_experts.cpp), where their kernels allow.

`SparseMlp.grouped` runs each active expert's gate/up, activation and down on its run of the step's rows: ~5
Python calls an expert, ~200 a layer on a decode step of a 64-expert model, ~8 us each. The C++ loop calls
the same kernels (few-row float panels, or quantized blocks); an expert with more rows than its kernels
take (a quantized or bf16 prefill chunk's) is left to the Python loop and its GEMMs. Float32 panels on AVX-512
take any rows here, a prefill chunk's too: an expert's run is as fast on them as on oneDNN's GEMM, and a layer
of them stays one call. The sort, gather and weighted sum around the experts are C++ too (dispatch, combine).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from mixserve.model.cpu import quant_linear
from mixserve.model.cpu.build import load_library
from mixserve.model.cpu.decode_layers import MAX_SEGMENTS, QuantLinearSpec, linear_spec
from mixserve.model.cpu.few_row_linear import PanelWeight, panel_width
from mixserve.model.cpu.layer_ops import DTYPE_CODE
from mixserve.model.cpu.quant_linear import QuantWeight

_I64, _P = ctypes.c_int64, ctypes.c_void_p
ANY_ROWS = 1 << 62  # max_rows of a kernel that takes any run of rows
# float32 panels 64 wide (AVX-512) match oneDNN's GEMM at an expert's shapes at every row count measured
# (docs/decisions/moe-experts-in-one-call.md); AVX2's 16-wide ones keep their few rows
F32_ANY_ROWS_WIDTH = 64


class ExpertLinear(ctypes.Structure):
    _fields_ = [("quantized", _I64), ("n", _I64), ("k", _I64), ("max_rows", _I64), ("panels", _P),
                ("quant", QuantLinearSpec)]


def _expert_linear(w: object, dtype: torch.dtype) -> ExpertLinear | None:
    """The C++ view of one packed expert weight, or None where it has no few-row kernel."""
    if isinstance(w, QuantWeight):  # (experts on int8-rounded inputs stay in Python: linear takes them)
        if dtype != torch.float32 or len(w.segments) > MAX_SEGMENTS or w.int8_inputs:
            return None
        return ExpertLinear(1, w.n, w.k, quant_linear.FEW_ROWS, None, linear_spec(w, None))
    few = getattr(w, "few", None)  # the CPU ops' packed float weights keep their panels here
    if not isinstance(few, PanelWeight) or few.panels.dtype != dtype:
        return None
    rows = ANY_ROWS if dtype == torch.float32 and panel_width() == F32_ANY_ROWS_WIDTH else few.max_rows
    return ExpertLinear(0, few.n, few.k, rows, few.panels.data_ptr(), QuantLinearSpec())


@dataclass
class ExpertTable:
    """Every expert's two linears as the C++ loop reads them, built once at prepare."""

    gate_up: ctypes.Array  # of ExpertLinear
    down: ctypes.Array
    dtype: torch.dtype
    hidden: int
    inter: int
    gelu: bool
    weights: Sequence[object]  # the packed weights the pointers point into, held alive here

    def dispatch(self, x: Tensor, experts: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(rows, bounds, order): the (token, choice) pairs of `experts` (T, k) stably sorted by expert, as
        torch.sort orders them, x's row of each, and where each expert's run of them starts and ends."""
        t, k = experts.shape
        experts, x = experts.contiguous(), x.contiguous()  # (held: the call reads their memory)
        rows = torch.empty((t * k, x.shape[1]), dtype=x.dtype)
        bounds = torch.empty(len(self.gate_up) + 1, dtype=torch.int64)
        order = torch.empty(t * k, dtype=torch.int64)
        rc = load_library().mixserve_moe_dispatch(
            experts.data_ptr(), t, k, len(self.gate_up), x.data_ptr(), x.shape[1] * x.element_size(),
            bounds.data_ptr(), order.data_ptr(), rows.data_ptr(), torch.get_num_threads())
        if rc != 0:
            raise ValueError("an expert id is out of range")
        return rows, bounds, order

    def combine(self, out: Tensor, weights: Tensor, order: Tensor) -> Tensor:
        """Each token's sum of its choices' rows of `out` times their weights (T, k), as `grouped`'s torch
        path rounds and adds them (index_add_ in sorted order), bit for bit."""
        t, k = weights.shape
        y = torch.empty((t, out.shape[1]), dtype=out.dtype)
        w = weights.float().contiguous()  # (a bf16 weight converts exactly)
        rc = load_library().mixserve_moe_combine(
            DTYPE_CODE[out.dtype], out.data_ptr(), w.data_ptr(), order.data_ptr(), t, k, out.shape[1],
            y.data_ptr(), torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"the experts' weighted sum cannot take this step (code {rc})")
        return y

    def run(self, rows: Tensor, bounds: Tensor, out: Tensor) -> list[int]:
        """Each expert's output rows into `out` where the C++ loop takes its run; the experts it left."""
        m = rows.shape[0]
        gate_up = torch.empty((m, 2 * self.inter), dtype=self.dtype)
        act = torch.empty((m, self.inter), dtype=self.dtype)
        done = torch.zeros(len(self.gate_up), dtype=torch.uint8)
        rc = load_library().mixserve_moe_experts(
            ctypes.addressof(self.gate_up), ctypes.addressof(self.down), len(self.gate_up), bounds.data_ptr(),
            DTYPE_CODE[self.dtype], rows.data_ptr(), gate_up.data_ptr(), act.data_ptr(), out.data_ptr(),
            self.hidden, self.inter, int(self.gelu), done.data_ptr(), torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"the experts' kernels cannot take this step (code {rc})")
        return (done == 0).nonzero().flatten().tolist()


def plan(experts: Sequence[tuple[object, object]], dtype: torch.dtype, hidden: int, inter: int,
         activation: str, ops_name: str) -> ExpertTable | None:
    """The table for experts packed as (gate_up, down) by the CPU ops, or None where any lacks a kernel."""
    if not ops_name.endswith("+cpp") or dtype not in DTYPE_CODE or activation not in ("silu", "gelu_tanh"):
        return None
    specs = [(_expert_linear(gu, dtype), _expert_linear(d, dtype)) for gu, d in experts]
    if any(gu is None or d is None for gu, d in specs):
        return None
    gate_up = (ExpertLinear * len(specs))(*(gu for gu, _ in specs))
    down = (ExpertLinear * len(specs))(*(d for _, d in specs))
    return ExpertTable(gate_up, down, dtype, hidden, inter, activation == "gelu_tanh",
                       [w for pair in experts for w in pair])
