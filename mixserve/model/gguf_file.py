"""A small, fast GGUF reader: metadata and the tensor table parsed straight from a memory map.

gguf.GGUFReader builds numpy views for every token string of the vocabulary (seconds on a 49k vocab);
this reader walks those arrays with struct and keeps only what the loader needs.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mixserve.model.errors import ModelLoadError

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
            12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8",
          12: "<f8"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file: its torch-order shape, ggml type id and raw bytes (a view of the map)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    data: np.ndarray  # uint8 bytes of the tensor


class _Cursor:
    def __init__(self, buf: memoryview):
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        if self.pos + n > len(self.buf):
            raise ValueError("string runs past the end of the file")
        s = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.unpack("<I"), self.unpack("<Q")
            if etype in _NUMPY:
                dt = np.dtype(_NUMPY[etype])
                arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos)
                self.pos += dt.itemsize * count
                return arr.tolist()
            return [self.value(etype) for _ in range(count)]
        raise ValueError(f"unknown metadata value type {vtype}")


def read_gguf(path: Path) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
    """(metadata, tensors by name) of a GGUF file; raises ModelLoadError naming the path if it is bad."""
    import gguf

    try:
        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: cannot be read ({e})") from None
    buf = memoryview(mm)
    try:
        if bytes(buf[:4]) != b"GGUF":
            raise ValueError("missing GGUF magic bytes")
        cur = _Cursor(buf)
        cur.pos = 4
        version = cur.unpack("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} not supported (2 or 3)")
        n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            meta[key] = cur.value(cur.unpack("<I"))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            dims = [cur.unpack("<Q") for _ in range(cur.unpack("<I"))]
            infos.append((name, tuple(reversed(dims)), cur.unpack("<I"), cur.unpack("<Q")))
        align = int(meta.get("general.alignment", 32))
        start = -(-cur.pos // align) * align
        data = np.frombuffer(mm, dtype=np.uint8)
        tensors: dict[str, TensorInfo] = {}
        for name, shape, gtype, offset in infos:
            try:
                qtype = gguf.GGMLQuantizationType(gtype)
            except ValueError:
                raise ModelLoadError(f"{path}: tensor {name} has unknown ggml type {gtype}") from None
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            n = int(np.prod(shape))
            nbytes = n // block * type_size
            lo = start + offset
            if lo + nbytes > len(data):
                raise ValueError(f"tensor {name} runs past the end of the file (truncated?)")
            tensors[name] = TensorInfo(name, shape, gtype, data[lo : lo + nbytes])
    except (ValueError, struct.error, UnicodeDecodeError, OverflowError, MemoryError) as e:
        if isinstance(e, ModelLoadError):
            raise
        raise ModelLoadError(f"{path}: not a valid GGUF file ({' '.join(str(e).split())})") from None
    return meta, tensors
