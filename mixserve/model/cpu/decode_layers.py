"""A decode step's whole stack of dense layers as one C++ call (csrc/decode_layers.cpp), on quantized weights.

On a one-token step of the default model the Python layer body makes ~12 kernel calls a layer, 360 a token,
each with its argument checks, tensors and ctypes conversions: ~3 ms of a ~10 ms token, where llama.cpp's
whole token is ~8 ms. The C++ stack runs the same kernels in the same order, so its output is bit-identical
to the body's; it takes over where every layer is a plain one (see `why_not`) and the step has few rows.
float32 and bfloat16 models (a bf16 step's linears widen their rows to float32 and round the product, as the
body's do below quant_linear.BF16_PANEL_ROWS). docs/decisions/decode-layer-stack.md has the measurements.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from mixserve.model.attention.base import AttentionMetadata, check_features
from mixserve.model.cpu import quant_linear
from mixserve.model.cpu.build import load_library
from mixserve.model.cpu.layer_ops import DTYPE_CODE
from mixserve.model.cpu.quant_linear import QuantWeight

if TYPE_CHECKING:
    from mixserve.model.decoder import DecoderModel, KVCaches
    from mixserve.model.ops import LayerOps

MAX_SEGMENTS = 4  # as csrc/decode_layers.cpp
_I64, _P, _F = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


class QuantLinearSpec(ctypes.Structure):
    _fields_ = [("n", _I64), ("k", _I64), ("segments", _I64), ("types", _I64 * MAX_SEGMENTS),
                ("data", _P * MAX_SEGMENTS), ("row_bytes", _I64 * MAX_SEGMENTS),
                ("rows", _I64 * MAX_SEGMENTS), ("scales", _P * MAX_SEGMENTS), ("bias", _P)]


class LayerSpec(ctypes.Structure):
    _fields_ = [("qkv", QuantLinearSpec), ("o", QuantLinearSpec), ("gate_up", QuantLinearSpec),
                ("down", QuantLinearSpec), ("input_norm", _P), ("post_norm", _P), ("cos", _P), ("sin", _P),
                ("k_cache", _P), ("v_cache", _P), ("scale", _F), ("softcap", _F), ("window", _I64)]


class StackShape(ctypes.Structure):
    _fields_ = [("hidden", _I64), ("heads", _I64), ("kv_heads", _I64), ("head_dim", _I64), ("inter", _I64),
                ("block_size", _I64), ("eps", _F), ("gelu", ctypes.c_int32), ("int8_inputs", ctypes.c_int32),
                ("dtype", ctypes.c_int32)]


class StepBatch(ctypes.Structure):
    _fields_ = [("tokens", _I64), ("positions", _P), ("slots", _P), ("query_start", _P), ("seq_lens", _P),
                ("block_tables", _P), ("num_seqs", _I64), ("max_blocks", _I64)]


def linear_spec(w: QuantWeight, bias: Tensor | None) -> QuantLinearSpec:
    spec = QuantLinearSpec(n=w.n, k=w.k, segments=len(w.segments),
                           bias=None if bias is None else bias.data_ptr())
    for i, seg in enumerate(w.segments):
        qtype, data, row_bytes, rows, scales = seg.args
        spec.types[i], spec.data[i], spec.row_bytes[i], spec.rows[i], spec.scales[i] = (
            qtype, data, row_bytes, rows, scales)
    return spec


def _of(t: Tensor | None, dtype: torch.dtype) -> bool:
    return t is not None and t.dtype == dtype and t.is_contiguous() and t.device.type == "cpu"


def _pointer(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def why_not(model: DecoderModel, ops: LayerOps) -> str | None:
    """None when the stack can run this model's layers, else why not (one line)."""
    from mixserve.model.mlp import GatedMlp

    if not ops.name.endswith("+cpp") or model.dtype not in DTYPE_CODE:
        return f"the stack runs float32 or bfloat16 on the CPU kernels, not {ops.name} in {model.dtype}"
    for i, layer in enumerate(model.layers):
        mlp = layer.mlp
        if not isinstance(mlp, GatedMlp) or mlp.activation not in ("silu", "gelu_tanh"):
            return f"layer {i} has no dense gated MLP"
        if layer.q_norm is not None or layer.attn_out_norm is not None:
            return f"layer {i} has per-head or sandwich norms"
        weights = (layer.packed.qkv, layer.packed.o_proj, mlp.packed.gate_up, mlp.packed.down)
        if not all(isinstance(w, QuantWeight) and len(w.segments) <= MAX_SEGMENTS for w in weights):
            return f"layer {i}'s linears are not all quantized"
        if layer.qkv_bias is not None and not _of(layer.qkv_bias, model.dtype):
            return f"layer {i}'s q/k/v bias is not {model.dtype}"
        if not (_of(layer.input_norm, model.dtype) and _of(layer.post_norm, model.dtype)):
            return f"layer {i}'s norms are not {model.dtype}"
    return None


@dataclass
class LayerStack:
    """The layers' weights as the C++ stack reads them, built once at prepare; KV pointers per cache list."""

    ops: LayerOps  # the ops it was built for: a model handed other ops (a profiler's) runs its Python body
    shape: StackShape
    layers: ctypes.Array  # of LayerSpec
    model: DecoderModel
    max_tokens: int = quant_linear.FEW_ROWS  # past this the linears take other kernels than the block one
    caches: KVCaches | None = None  # the cache list whose pointers `layers` holds
    biases: list[Tensor] = field(default_factory=list)  # float32 copies of bf16 q/k/v biases `layers` reads

    def runs(self, ops: LayerOps, tokens: int, attn_name: str) -> bool:
        """Whether this forward runs here: the ops it was built for, few rows, the CPU paged attention."""
        return ops is self.ops and tokens <= self.max_tokens and attn_name == "cpu" and self.model.tp is None

    def _point_at(self, caches: KVCaches) -> None:
        dtype = self.model.dtype
        for spec, (k_cache, v_cache) in zip(self.layers, caches, strict=True):
            if not (k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.dtype == dtype):
                raise ValueError(f"the decode layer stack needs contiguous {dtype} KV caches")
            spec.k_cache, spec.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
        self.shape.block_size = caches[0][0].shape[1]
        self.caches = caches

    def run(self, hidden: Tensor, meta: AttentionMetadata, caches: KVCaches) -> tuple[Tensor, Tensor]:
        """(hidden, residual) after every layer, as the Python body returns them; `hidden` (the embedding's
        output, which the caller owns) is overwritten."""
        if caches is not self.caches:
            self._point_at(caches)
        sh, dtype = self.shape, self.model.dtype
        m = hidden.shape[0]
        hidden = hidden.to(dtype).contiguous()
        residual = torch.empty_like(hidden)
        width = (sh.heads + 2 * sh.kv_heads) * sh.head_dim
        work = torch.empty(m * (sh.hidden + width + sh.heads * sh.head_dim + 3 * sh.inter), dtype=dtype)
        wide = product = None  # bf16: each linear's input widened and its product, in float32
        if dtype == torch.bfloat16:
            wide = torch.empty(m * max(sh.hidden, sh.heads * sh.head_dim, sh.inter), dtype=torch.float32)
            product = torch.empty(m * max(sh.hidden, width, 2 * sh.inter), dtype=torch.float32)
        tables = meta.block_tables
        batch = StepBatch(m, meta.positions.data_ptr(), meta.slot_mapping.data_ptr(),
                          meta.query_start.data_ptr(), meta.seq_lens.data_ptr(), tables.data_ptr(),
                          tables.shape[0], tables.shape[1])
        rc = load_library().mixserve_decode_layers(
            ctypes.addressof(sh), ctypes.addressof(self.layers), len(self.layers), ctypes.addressof(batch),
            hidden.data_ptr(), residual.data_ptr(), work.data_ptr(), _pointer(wide), _pointer(product),
            torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"the decode layer stack's kernels cannot take this step (code {rc})")
        return hidden, residual


def _int8_inputs(model: DecoderModel) -> bool:
    """Whether the linears multiply int8-rounded inputs: the stack passes one flag to every linear, and the
    C++ applies it to the formats that have integer dots (quant_linear.with_int8_inputs marks only those)."""
    return any(w.int8_inputs for layer in model.layers for w in (
        layer.packed.qkv, layer.packed.o_proj, layer.mlp.packed.gate_up, layer.mlp.packed.down))


def plan(model: DecoderModel, ops: LayerOps) -> LayerStack | None:
    """The stack for `model` run with `ops`, or None where it cannot run them (`why_not`)."""
    if not model.layers or why_not(model, ops) is not None:
        return None
    cfg, first = model.config, model.layers[0]
    shape = StackShape(hidden=cfg.hidden_size, heads=first.num_heads, kv_heads=first.num_kv_heads,
                       head_dim=first.head_dim, inter=cfg.intermediate_size, block_size=0,
                       eps=first.eps, gelu=int(cfg.activation == "gelu_tanh"),
                       int8_inputs=int(_int8_inputs(model)), dtype=DTYPE_CODE[model.dtype])
    specs = (LayerSpec * len(model.layers))()
    biases = []
    for spec, layer in zip(specs, model.layers, strict=True):
        table = model.rotaries[layer.rope_table]
        if not (_of(table.cos, model.dtype) and _of(table.sin, model.dtype)):
            return None
        args = layer.attn_args
        window = int(args.get("window", 0))
        bias = layer.qkv_bias
        if bias is not None and bias.dtype != torch.float32:  # the body adds it in float32 too
            bias = bias.float().contiguous()
            biases.append(bias)
        spec.qkv = linear_spec(layer.packed.qkv, bias)
        spec.o = linear_spec(layer.packed.o_proj, None)
        spec.gate_up = linear_spec(layer.mlp.packed.gate_up, None)
        spec.down = linear_spec(layer.mlp.packed.down, None)
        spec.input_norm, spec.post_norm = layer.input_norm.data_ptr(), layer.post_norm.data_ptr()
        spec.cos, spec.sin = table.cos.data_ptr(), table.sin.data_ptr()
        spec.scale = check_features(layer.head_dim, args.get("scale"), window, args.get("softcap", 0.0))
        spec.softcap = float(args.get("softcap", 0.0))
        spec.window = window if window < 1 << 30 else 0
    # bf16 rows of BF16_PANEL_ROWS or more take the bf16 panels in the body (quant_linear.linear), not the
    # float32 block kernel the stack calls
    bf16_panels = model.dtype == torch.bfloat16 and quant_linear.bf16_panels()
    rows = quant_linear.BF16_PANEL_ROWS - 1 if bf16_panels else quant_linear.FEW_ROWS
    return LayerStack(ops=ops, shape=shape, layers=specs, model=model, max_tokens=rows, biases=biases)
