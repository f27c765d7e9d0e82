"""The decoder layer's ops (linear, norms, SwiGLU, RoPE): one frozen set per device, picked once at start-up.

Three sets: `torch_ops()` (plain PyTorch, the reference), `cpu_ops(dtype)` (linears on weights packed once at
load: MKL's packed GEMM in float32 (model/cpu/mkl_linear.py), oneDNN in bfloat16 or where MKL is missing;
norms, RoPE and SwiGLU as one C++ call each, mixserve/model/cpu) and `triton_ops()` (mixserve/kernels, CUDA).
The model runs whichever set `DecoderModel.prepare(ops)` was handed; one layer body serves all three.
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from mixserve import kernels
from mixserve.model.rope import RotaryTable, apply_rotary

log = logging.getLogger("mixserve")

Rotary = tuple[Tensor, ...]  # what `rotary_state` builds once per forward and `rotary` reads in every layer


def gelu_tanh_and_mul(gate_up: Tensor) -> Tensor:
    """GeGLU with the tanh approximation (Gemma's gelu_pytorch_tanh); gate then up along the last dim."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


@dataclass(frozen=True)
class LayerOps:
    """What a decoder layer calls. `pack` turns a loaded weight into what `linear` takes (once, at load)."""

    name: str
    pack: Callable[[Tensor], Any]
    linear: Callable[[Tensor, Any, Tensor | None], Tensor]
    rms_norm: Callable[[Tensor, Tensor, float], Tensor]
    # (x, residual, weight, eps) -> (norm(x + residual), x + residual): the residual stream rides along
    # (the CPU and Triton sets write the sum into `residual` in place: the caller passes one it owns)
    add_rms_norm: Callable[[Tensor, Tensor, Tensor, float], tuple[Tensor, Tensor]]
    silu_and_mul: Callable[[Tensor], Tensor]
    rotary_state: Callable[[RotaryTable, Tensor], Rotary]
    # (qk (T, Hq + Hkv, D): q's heads then k's, Hq, state) -> rotated (q, k); the Triton set rotates in place
    rotary: Callable[[Tensor, int, Rotary], tuple[Tensor, Tensor]]
    triton: bool = False  # runs mixserve/kernels: `kernels.set_enabled(False)` later swaps in torch_ops()
    gelu_tanh_and_mul: Callable[[Tensor], Tensor] = gelu_tanh_and_mul  # Gemma's GeGLU


# ---- the torch set ---------------------------------------------------------------------------------------

def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm computed in float32 like HF, then scaled in the weight's dtype."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """The residual add in the model's dtype (as HF adds it), then RMSNorm of the sum."""
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def silu_and_mul(gate_up: Tensor) -> Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _lookup(table: RotaryTable, positions: Tensor) -> Rotary:
    return table.lookup(positions)  # gathered once per forward, not once per layer


def _rotary(qk: Tensor, num_q_heads: int, state: Rotary) -> tuple[Tensor, Tensor]:
    cos, sin = state
    rotated = apply_rotary(qk, cos, sin)  # q and k in one go: half the small ops of a decode step's RoPE
    return rotated[:, :num_q_heads], rotated[:, num_q_heads:]


def _identity(w: Tensor) -> Tensor:
    return w


def _reads_quantized(pack: Callable[[Tensor], Any], linear: Callable[[Tensor, Any, Tensor | None], Tensor]
                     ) -> tuple[Callable[[Any], Any], Callable[[Tensor, Any, Tensor | None], Tensor]]:
    """`pack` and `linear` that pass quantized weights (cpu/quant_linear.py) to their own kernels."""
    from mixserve.model.cpu import quant_linear

    def q_pack(w: Any) -> Any:
        return w if isinstance(w, quant_linear.QuantWeight) else pack(w)

    def q_linear(x: Tensor, w: Any, bias: Tensor | None) -> Tensor:
        if isinstance(w, quant_linear.QuantWeight):
            return quant_linear.linear(x, w, bias)
        return linear(x, w, bias)

    return q_pack, q_linear


@functools.cache
def torch_ops() -> LayerOps:
    """Plain PyTorch: F.linear on the loaded weights. The reference, and what fp16 on a CPU runs."""
    pack, linear = _reads_quantized(_identity, F.linear)
    return LayerOps(name="torch", pack=pack, linear=linear, rms_norm=rms_norm,
                    add_rms_norm=add_rms_norm, silu_and_mul=silu_and_mul, rotary_state=_lookup,
                    rotary=_rotary)


# ---- the CPU set: oneDNN linears on weights reordered once ----------------------------------------------

@dataclass(frozen=True)
class PackedWeight:
    """A weight in oneDNN's blocked layout (an opaque mkldnn tensor), and the plain one for tiny batches."""

    plain: Tensor
    packed: Tensor
    min_rows: int  # from this many rows the packed GEMM; 2 .. min_rows-1 F.linear (_MIN_ROWS says why)
    few: Any = None  # few_row_linear.PanelWeight: 1 .. its max_rows rows go there instead, where packed


# Row counts from which the prepacked oneDNN linear beats F.linear; 1 row is a GEMV, where aten's torch.mv
# does best with the weight coming from memory (measured: docs/decisions/cpu-linear-row-thresholds.md).
_MIN_ROWS = {torch.float32: 4, torch.bfloat16: 2}  # 1 row is always a GEMV
_BIG_WEIGHT = 1 << 23  # elements (32 MiB in fp32) from which oneDNN's fixed cost per call does not matter


def mkldnn_linear_available(dtype: torch.dtype) -> str | None:
    """None when the prepacked oneDNN linear works for `dtype` here, else why not (one line)."""
    if dtype not in _MIN_ROWS:
        return f"no packed oneDNN linear for {dtype} (float32 and bfloat16 only)"
    if not torch.backends.mkldnn.is_available():
        return "this torch was built without oneDNN (mkldnn)"
    try:
        w, x = torch.ones(4, 8, dtype=dtype), torch.ones(3, 8, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        got = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except (AttributeError, RuntimeError, NotImplementedError) as e:  # an older torch lacks the ops
        return f"torch.ops.mkldnn linear ops unusable: {type(e).__name__}: {' '.join(str(e).split())[:200]}"
    if not torch.equal(got.float(), torch.full((3, 4), 8.0)):
        return "torch.ops.mkldnn._linear_pointwise gave a wrong result"
    return None


def _pack(w: Tensor, dtype: torch.dtype, few_rows: bool = False) -> PackedWeight:
    # batch_size=None: a layout for any row count (one reordered copy serves decode and prefill alike).
    packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), None)
    from mixserve.model.cpu import few_row_linear

    return PackedWeight(plain=w, packed=packed, min_rows=2 if w.numel() >= _BIG_WEIGHT else _MIN_ROWS[dtype],
                        few=few_row_linear.pack(w) if few_rows else None)


def _packed_linear(x: Tensor, w: PackedWeight, bias: Tensor | None) -> Tensor:
    rows = x.shape[0]
    if w.few is not None and rows <= w.few.max_rows:
        from mixserve.model.cpu import few_row_linear

        return few_row_linear.linear(x, w.few, bias)
    if rows == 1:  # a GEMV: aten's own beats both GEMMs there (see the table above)
        y = torch.mv(w.plain, x[0]) if bias is None else torch.addmv(bias, w.plain, x[0])
        return y.unsqueeze(0)
    if rows < w.min_rows:
        return F.linear(x, w.plain, bias)
    return torch.ops.mkldnn._linear_pointwise(x, w.packed, bias, "none", [], "")


def cpu_ops(dtype: torch.dtype) -> LayerOps:
    """The CPU set for `dtype`: prepacked oneDNN linears where they work, else torch_ops() (warns once why,
    unless the dtype simply has none: fp16)."""
    reason = mkldnn_linear_available(dtype)
    if reason is not None:
        if dtype in _MIN_ROWS:
            warnings.warn(f"CPU linears run F.linear, not the prepacked oneDNN path: {reason}",
                          RuntimeWarning, stacklevel=2)
        return torch_ops()
    name = f"cpu-onednn-{str(dtype).removeprefix('torch.')}"
    pack, linear = functools.partial(_pack, dtype=dtype), _packed_linear
    from mixserve.model.cpu import mkl_linear

    if dtype == torch.float32 and mkl_linear.unavailable() is None:  # faster at any row count (mkl_linear.py)
        name, pack, linear = "cpu-mkl-float32", mkl_linear.pack, mkl_linear.linear
    from mixserve.model.cpu.build import available

    why_not = available()  # builds the C++ kernels on first use (~30 s once per machine)
    if why_not is not None:  # no quantized weights either: quantization.resolve loads them unquantized
        log.warning("CPU layer ops run as eager PyTorch (slower): %s", why_not)
        return LayerOps(name=name, pack=pack, linear=linear, rms_norm=rms_norm,
                        add_rms_norm=add_rms_norm, silu_and_mul=silu_and_mul, rotary_state=_lookup,
                        rotary=_rotary)
    from mixserve.model.cpu import layer_ops

    # with the kernels built, decode-sized GEMMs take panels (few_row_linear.py)
    if pack is mkl_linear.pack:
        pack = functools.partial(mkl_linear.pack, few_rows=True)
    else:
        pack = functools.partial(_pack, dtype=dtype, few_rows=True)

    def rotary(qk: Tensor, num_q_heads: int, state: Rotary) -> tuple[Tensor, Tensor]:
        cos, sin, positions = state
        layer_ops.rotary_(qk, cos, sin, positions)
        return qk[:, :num_q_heads], qk[:, num_q_heads:]

    pack, linear = _reads_quantized(pack, linear)
    return LayerOps(name=name + "+cpp", pack=pack, linear=linear, rms_norm=layer_ops.rms_norm,
                    add_rms_norm=layer_ops.add_rms_norm, silu_and_mul=layer_ops.silu_and_mul,
                    rotary_state=_positions_state, rotary=rotary,
                    gelu_tanh_and_mul=layer_ops.gelu_tanh_and_mul)


# ---- the Triton set (CUDA) -------------------------------------------------------------------------------

def _positions_state(table: RotaryTable, positions: Tensor) -> Rotary:
    return table.cos, table.sin, positions  # the kernel reads the tables at each token's position


@functools.cache
def triton_ops() -> LayerOps:
    """mixserve/kernels (imports triton, so call it only where `kernels.use_triton` says yes): 2 norm launches
    (each with the residual add), 1 RoPE in place, 1 SiLU*up per layer; F.linear for the GEMMs (cuBLAS)."""
    from mixserve.kernels import activation, norm, rope

    def rotary(qk: Tensor, num_q_heads: int, state: Rotary) -> tuple[Tensor, Tensor]:
        cos, sin, positions = state
        q, k = qk[:, :num_q_heads], qk[:, num_q_heads:]
        rope.rotary_qk_(q, k, cos, sin, positions)
        return q, k

    return LayerOps(name="triton", pack=_identity, linear=F.linear, rms_norm=norm.rms_norm,
                    add_rms_norm=norm.add_rms_norm, silu_and_mul=activation.silu_and_mul,
                    rotary_state=_positions_state, rotary=rotary, triton=True)


def select_ops(device: torch.device, dtype: torch.dtype, hidden_size: int) -> LayerOps:
    """The set for this device, decided once at start-up: Triton where the kernels run (CUDA with triton,
    enabled, a row the norm kernel holds), the prepacked oneDNN set on a CPU, plain torch otherwise."""
    if kernels.use_triton(torch.empty(0, device=device)) and hidden_size <= kernels.NORM_MAX_HIDDEN:
        return triton_ops()
    if device.type == "cpu":
        return cpu_ops(dtype)
    return torch_ops()


# ---- CPU features -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CpuFeatures:
    """What decides whether bf16 GEMMs are fast on this CPU."""

    avx512_bf16: bool  # AVX512-BF16: bf16 dot products (Cooper Lake, Zen 4 and later)
    amx_bf16: bool  # AMX tiles (Sapphire Rapids and later): bf16 GEMMs several times fp32's rate
    capability: str  # torch.backends.cpu.get_cpu_capability(): the vector ISA torch's own kernels use
    vendor: str = ""  # /proc/cpuinfo's vendor_id (GenuineIntel, AuthenticAMD): MKL's fast paths are Intel's

    @property
    def fast_bf16(self) -> bool:
        return self.avx512_bf16 or self.amx_bf16

    def __str__(self) -> str:
        bf16 = [n for n, on in (("avx512_bf16", self.avx512_bf16), ("amx_bf16", self.amx_bf16)) if on]
        return f"{self.capability}, bf16: {'+'.join(bf16) or 'no native support'}"


@functools.cache
def cpu_features(cpuinfo: str = "/proc/cpuinfo") -> CpuFeatures:
    """Read the CPU's vendor and flags once (Linux); elsewhere neither bf16 feature is claimed."""
    flags: set[str] = set()
    vendor = ""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("vendor_id") and not vendor:
                    vendor = line.split(":", 1)[1].strip()
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    return CpuFeatures(avx512_bf16="avx512_bf16" in flags, amx_bf16="amx_bf16" in flags,
                       capability=torch.backends.cpu.get_cpu_capability(), vendor=vendor)


def log_bf16_on_cpu(features: CpuFeatures, dtype: torch.dtype) -> bool:
    """On a CPU without AVX512-BF16 or AMX, say in one line why bf16 is not faster there; True if it did."""
    if dtype != torch.bfloat16 or features.fast_bf16:
        return False
    log.warning("bfloat16 on this CPU (%s) is not faster than float32: without AVX512-BF16 or AMX every bf16 "
                "GEMM converts to fp32 and runs at the fp32 rate, plus the conversions; dtype float32 (the "
                "'auto' on a CPU) is as fast and more accurate", features)
    return True
