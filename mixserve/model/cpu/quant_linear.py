"""Quantized weights kept as they are stored, and the linears and embedding lookups that read them in place.

A `QuantWeight` is an (n, k) weight as rows of blocks: GGUF's formats (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K,
a view of the file's memory map where nothing had to move) or int8 per output channel with float32 scales.
Few rows (decode steps) run csrc/quant_linear.cpp on the blocks; more rows (prefill chunks) decode a column
panel of the weight at a time to float32 in cache and multiply it there (csrc/quant_panels.cpp): there the
compute, not the bytes, is the cost, so a bf16 model (dtype bfloat16) decodes them to bf16 pairs instead and
multiplies with vdpbf16ps, half the instructions, where the CPU has AVX512-BF16. A weight marked
`int8_inputs` (`[engine] int8_activations`, the opt-in for llama.cpp's rounding) multiplies inputs rounded to
int8 per block of 32 instead, in integer dots: the block kernel for few rows (csrc/quant_dot.h), panels of
bytes for more (csrc/quant_int8_panels.cpp). docs/decisions/quantized-weights-in-place.md and
docs/decisions/int8-activations.md have the measurements behind each path and its row threshold.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from mixserve.model.cpu import few_row_linear
from mixserve.model.cpu.build import available, kernel_isa, load_library

INT8_ROW = 100  # our int8 per output channel (not a ggml type): a row is k int8 values, its scale beside
# ggml type id -> (name, elements per block, bytes per block) of the formats the kernels read
FORMATS = {2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24),
           8: ("Q8_0", 32, 34), 12: ("Q4_K", 256, 144),
           13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), INT8_ROW: ("int8", 1, 1)}
FEW_ROWS = 32  # up to this many rows the block kernel; above, decoded panels (see the record)
# formats with integer-dot kernels: every GGUF one, and int8 per channel where k is a multiple of 32
INT8_FORMATS = frozenset({2, 3, 6, 7, 8, 12, 13, 14, INT8_ROW})
# bf16 inputs (dtype bfloat16, the opt-in for speed): from this many rows on, the panels rounded to bf16 pairs
# and multiplied by the inputs as they are (vdpbf16ps, float32 sums) where the kernels have AVX512-BF16;
# below, the block kernel's float32 products is faster
BF16_PANEL_ROWS = 16
_TILE_ELEMS = 1 << 22  # float32 elements of weight decoded at a time where there are no panels (16 MiB)


@dataclass(frozen=True, eq=False)
class QuantSegment:
    """Consecutive output rows of one format: data (rows, row_bytes) uint8, scales (rows,) for int8."""

    qtype: int
    data: Tensor
    scales: Tensor | None = None

    @property
    def rows(self) -> int:
        return self.data.shape[0]

    @functools.cached_property
    def args(self) -> tuple[int, int, int, int, int | None]:
        """(qtype, data pointer, row bytes, rows, scales pointer): what every kernel call passes, read once
        (a decode step makes ~200 of these calls; each Python step in them is a noticeable cost)."""
        scales = None if self.scales is None else self.scales.data_ptr()
        return self.qtype, self.data.data_ptr(), self.data.shape[1], self.rows, scales


@dataclass(frozen=True, eq=False)
class QuantWeight:
    """An (n, k) linear weight as one or more segments of rows (a fused q/k/v whose parts differ in format
    keeps one segment each; fused parts of one format are one)."""

    segments: tuple[QuantSegment, ...]
    k: int
    # inputs rounded to int8 per block of 32 and integer dots, in the formats that have them (INT8_FORMATS);
    # float32 products in the others
    int8_inputs: bool = False

    @functools.cached_property
    def n(self) -> int:
        return sum(s.rows for s in self.segments)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    @property
    def nbytes(self) -> int:
        return sum(s.data.numel() + (0 if s.scales is None else s.scales.numel() * 4) for s in self.segments)

    @property
    def formats(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(FORMATS[s.qtype][0] for s in self.segments))


def format_name(qtype: int) -> str | None:
    """The format's name where the kernels read it, else None (the loader dequantizes that tensor)."""
    entry = FORMATS.get(qtype)
    return None if entry is None else entry[0]


def from_blocks(qtype: int, data: Tensor, k: int) -> QuantWeight:
    """A weight of `data` (rows, row_bytes) uint8 in ggml format `qtype`, rows of k elements."""
    _, elems, nbytes = FORMATS[qtype]
    if k % elems or data.dim() != 2 or data.shape[1] != k // elems * nbytes:
        raise ValueError(f"{FORMATS[qtype][0]} rows of {k} elements cannot be {tuple(data.shape)} bytes")
    return QuantWeight((QuantSegment(qtype, data),), k)


def quantize_int8(w: Tensor) -> QuantWeight:
    """Weight-only int8 per output channel: scale = max |row| / 127, q = round(w / scale)."""
    w = w.detach().float()
    scales = (w.abs().amax(dim=1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return QuantWeight((QuantSegment(INT8_ROW, q.view(torch.uint8), scales.contiguous()),), w.shape[1])


def cat(parts: list[QuantWeight]) -> QuantWeight:
    """Row-wise concatenation (a fused q/k/v or gate/up); adjacent segments of one format become one."""
    if len({p.k for p in parts}) != 1:
        raise ValueError("quantized weights of different widths cannot be fused")
    merged: list[list[QuantSegment]] = []
    for seg in (s for p in parts for s in p.segments):
        if merged and merged[-1][0].qtype == seg.qtype:
            merged[-1].append(seg)
        else:
            merged.append([seg])
    segments = tuple(
        run[0] if len(run) == 1 else QuantSegment(
            run[0].qtype, torch.cat([s.data for s in run]),
            None if run[0].scales is None else torch.cat([s.scales for s in run]))
        for run in merged)
    return QuantWeight(segments, parts[0].k, parts[0].int8_inputs)


def map_rows(w: QuantWeight, fn: Callable[[Tensor], Tensor]) -> QuantWeight:
    """`fn` (a row permutation, as Q/K's un-permutation) applied to each segment's rows."""
    return QuantWeight(tuple(QuantSegment(s.qtype, fn(s.data).contiguous(), None if s.scales is None
                                          else fn(s.scales).contiguous()) for s in w.segments), w.k,
                       w.int8_inputs)


def with_int8_inputs(w: QuantWeight) -> QuantWeight:
    """`w` multiplying int8-rounded inputs (`[engine] int8_activations`): the same blocks, not copied; `w`
    itself where no segment has an integer-dot kernel (its float32 products, bf16 panels, stay). The kernels
    take inputs in blocks of 32: int8 rows of another k keep float products (as the C++ int8_dot_takes)."""
    if w.k % 32 or not any(s.qtype in INT8_FORMATS for s in w.segments):
        return w
    return dataclasses.replace(w, int8_inputs=True)


def unavailable() -> str | None:
    """None when the quantized kernels run here, else why not (one line): they are in the CPU kernels."""
    return available()


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise ValueError(f"the quantized {what} kernel cannot take these inputs (code {rc})")


def _decode(seg: QuantSegment, k: int, out: Tensor, first: int = 0, ids: Tensor | None = None) -> None:
    count = out.shape[0]
    rc = load_library().mixserve_quant_decode_rows(
        seg.qtype, seg.data.data_ptr(), seg.data.shape[1], k,
        None if seg.scales is None else seg.scales.data_ptr(),
        None if ids is None else ids.data_ptr(), first, count, out.data_ptr(), out.stride(0),
        torch.get_num_threads())
    _check(rc, "decode")


def dequantize(w: QuantWeight) -> Tensor:
    """The whole weight as float32 (n, k): the reference the kernels are tested against."""
    out = torch.empty(w.shape, dtype=torch.float32)
    row = 0
    for seg in w.segments:
        _decode(seg, w.k, out[row : row + seg.rows])
        row += seg.rows
    return out


def embedding(ids: Tensor, w: QuantWeight, dtype: torch.dtype) -> Tensor:
    """Rows `ids` of the table, decoded (the embedding lookup of a quantized token table)."""
    if len(w.segments) != 1:
        raise ValueError("a quantized embedding table has one format")
    ids = ids.to(torch.int64).contiguous()
    out = torch.empty((ids.numel(), w.k), dtype=torch.float32)
    _decode(w.segments[0], w.k, out, ids=ids)
    return out if dtype == torch.float32 else out.to(dtype)


def linear(x: Tensor, w: QuantWeight, bias: Tensor | None) -> Tensor:
    """x (m, k) -> x @ w.T + bias on the decoded weights, in x's dtype: float32 products, or bf16 ones for
    bf16 x of BF16_PANEL_ROWS rows or more where the kernels have them; integer dots on int8-rounded x for a
    weight marked `int8_inputs` (the C++ entry picks block kernel or panels by the rows)."""
    if w.int8_inputs and x.dtype == torch.float32 and (bias is None or (bias.dtype == torch.float32
                                                                        and bias.is_contiguous())):
        return _few_rows(_rows_contiguous(x, w.k), w, bias)
    if (x.dtype == torch.bfloat16 and not w.int8_inputs and x.shape[0] >= BF16_PANEL_ROWS and w.k % 2 == 0
            and bf16_panels()):
        b = None if bias is None else bias.float().contiguous()
        return _bf16_panels(_rows_contiguous(x, w.k), w, b).to(torch.bfloat16)
    if x.dtype != torch.float32 or (bias is not None and (bias.dtype != torch.float32
                                                         or not bias.is_contiguous())):
        out = linear(x.float(), w, None if bias is None else bias.float().contiguous())
        return out.to(x.dtype)
    x = _rows_contiguous(x, w.k)
    if x.shape[0] <= FEW_ROWS:
        return _few_rows(x, w, bias)
    return _panels(x, w, bias) if few_row_linear.panel_width() else _tiles(x, w, bias)


def _per_segment(x: Tensor, w: QuantWeight, bias: Tensor | None, call: Callable[..., int],
                 what: str) -> Tensor:
    """out (m, n) from `call(qtype, x, ldx, m, data, row_bytes, rows, k, scales, bias, out, ldo)` per segment,
    each writing its own columns of out."""
    m, n, k = x.shape[0], w.n, w.k
    out = torch.empty((m, n), dtype=torch.float32)
    xp, ldx, op = x.data_ptr(), x.stride(0), out.data_ptr()
    bp = None if bias is None else bias.data_ptr()
    col = 0
    for seg in w.segments:
        qtype, data, row_bytes, rows, scales = seg.args
        rc = call(qtype, xp, ldx, m, data, row_bytes, rows, k, scales, None if bp is None else bp + 4 * col,
                  op + 4 * col, n)
        if rc != 0:
            _check(rc, what)
        col += rows
    return out


def _few_rows(x: Tensor, w: QuantWeight, bias: Tensor | None) -> Tensor:
    kernel, threads, int8 = load_library().mixserve_quant_linear, torch.get_num_threads(), int(w.int8_inputs)
    return _per_segment(x, w, bias, lambda *args: kernel(*args, int8, threads), "linear")


def _panels(x: Tensor, w: QuantWeight, bias: Tensor | None) -> Tensor:
    """Each thread decodes a column panel of the weight into cache and multiplies every row by it there
    (csrc/quant_panels.cpp): the decoded weight never goes to memory."""
    kernel, threads = load_library().mixserve_quant_panel_linear, torch.get_num_threads()
    return _per_segment(x, w, bias, lambda *args: kernel(*args, threads), "panel linear")


def _bf16_panels(x: Tensor, w: QuantWeight, bias: Tensor | None) -> Tensor:
    """x @ w.T + bias, the decoded panels rounded to bf16 pairs against bf16 x: float32 sums and out."""
    kernel, threads = load_library().mixserve_quant_panel_linear_bf16, torch.get_num_threads()
    return _per_segment(x, w, bias, lambda *args: kernel(*args, threads), "bf16 panel linear")


def _rows_contiguous(x: Tensor, k: int) -> Tensor:
    """x as the kernels read it: unit stride along a row, rows at least k apart."""
    return x if x.stride(1) == 1 and x.stride(0) >= k else x.contiguous()


def bf16_panels() -> bool:
    """Whether the loaded kernels multiply panels in bf16 pairs (built with AVX512-BF16)."""
    return "avx512_bf16" in kernel_isa()


def _tiles(x: Tensor, w: QuantWeight, bias: Tensor | None) -> Tensor:
    """Where the kernels have no panels (neither AVX-512 nor AVX2 with FMA): tiles of the weight decoded
    row-major into a scratch buffer, then torch's GEMM."""
    n, k = w.shape
    rows = max(1, _TILE_ELEMS // k)
    out = torch.empty((x.shape[0], n), dtype=torch.float32)
    col = 0
    for seg in w.segments:
        for start in range(0, seg.rows, rows):
            count = min(rows, seg.rows - start)
            tile = _scratch(count * k)[: count * k].view(count, k)
            _decode(seg, k, tile, first=start)
            b = None if bias is None else bias[col + start : col + start + count]
            out[:, col + start : col + start + count] = F.linear(x, tile, b)
        col += seg.rows
    return out


_SCRATCH: list[Tensor] = []  # one float32 buffer the tiles are decoded into, grown to the largest tile


def _scratch(elems: int) -> Tensor:
    if not _SCRATCH or _SCRATCH[0].numel() < elems:
        _SCRATCH[:] = [torch.empty(elems, dtype=torch.float32)]
    return _SCRATCH[0]
