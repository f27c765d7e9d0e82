"""Read a llama.cpp GGUF file into HF-named tensors and a ModelConfig: float tensors (dequantized), or with
`keep_blocks` the linears, token table and head as quantized weights over the file's memory map where a
kernel reads their format (cpu/quant_linear.py). The per-family names and layouts are in
families/gguf_names.py, the metadata in families/gguf_config.py."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mixserve.model.config import ModelConfig
from mixserve.model.cpu import quant_linear
from mixserve.model.errors import ModelLoadError
from mixserve.model.families.gguf_config import with_tensors
from mixserve.model.families.gguf_names import EXPERT_NAMES, GLOBAL_NAMES, LAYER_RE, hf_tensors, unpermute_qk
from mixserve.model.gguf_file import TensorInfo, read_gguf

__all__ = ["dequantize", "load_gguf", "unpermute_qk"]
_ROPE_FACTORS = ("rope_factors_short.weight", "rope_factors_long.weight")
_FLOAT_TYPES = (0, 1, 30)  # F32, F16, BF16: loaded as float tensors, as before
log = logging.getLogger("mixserve")


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def dequantize(t: TensorInfo, path: Path) -> torch.Tensor:
    """A tensor of the file as float32 in torch order, dequantized with the gguf package."""
    import gguf

    qtype = gguf.GGMLQuantizationType(t.ggml_type)
    if qtype == gguf.GGMLQuantizationType.F32:
        arr = t.data.view(np.float32)
    elif qtype == gguf.GGMLQuantizationType.F16:
        arr = t.data.view(np.float16).astype(np.float32)
    else:
        rows = int(np.prod(t.shape[:-1], dtype=np.int64))
        try:
            arr = gguf.quants.dequantize(t.data.reshape(rows, -1), qtype)
        except NotImplementedError:
            msg = f"{path}: tensor {t.name} has unsupported quantization type {qtype.name}"
            raise ModelLoadError(msg) from None
        except Exception as e:
            raise ModelLoadError(f"{path}: tensor {t.name} cannot be dequantized ({_one_line(e)})") from None
    try:
        # copy: the map is read-only and torch wants writable memory
        return torch.from_numpy(np.array(arr, dtype=np.float32).reshape(t.shape))
    except ValueError as e:
        raise ModelLoadError(f"{path}: tensor {t.name} is corrupt ({_one_line(e)})") from None


def _blocks(t: TensorInfo) -> torch.Tensor:
    """The tensor's bytes as (rows, row bytes) uint8, a view of the read-only map (never written)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch warns that the map is not writable
        return torch.from_numpy(t.data).view(*t.shape[:-1], -1)  # experts: (E, rows, row bytes)


class _Kept:
    """Which tensors stay in their blocks, and the formats dequantized instead (said once each)."""

    def __init__(self, on: bool, path: Path):
        self.on, self.path = on, path
        self.said: set[int] = set()

    def __call__(self, t: TensorInfo, key: str) -> bool:
        if not self.on or t.ggml_type in _FLOAT_TYPES or len(t.shape) != (3 if key in EXPERT_NAMES else 2):
            return False
        if quant_linear.format_name(t.ggml_type) is None:
            if t.ggml_type not in self.said:
                import gguf

                self.said.add(t.ggml_type)
                log.warning("%s: tensors of type %s have no quantized kernel: dequantized", self.path,
                            gguf.GGMLQuantizationType(t.ggml_type).name)
            return False
        return True


def load_gguf(path: Path, keep_blocks: bool = False
              ) -> tuple[ModelConfig, dict[str, Any], torch.Tensor | None]:
    """(config, HF-named state dict, inv_freq override or None) of a GGUF file: float32 tensors, and with
    `keep_blocks` quantized weights (QuantWeight) where the kernels read the format."""
    meta, tensors = read_gguf(path)
    if "token_embd.weight" not in tensors:
        raise ModelLoadError(f"{path}: GGUF file has no token_embd.weight tensor")
    vocab = int(tensors["token_embd.weight"].shape[0])
    cfg = ModelConfig.from_gguf(meta, str(path), vocab_size=vocab, tied="output.weight" not in tensors)
    factors = {n: dequantize(tensors[n], path) for n in _ROPE_FACTORS if n in tensors}
    cfg = with_tensors(cfg, meta, str(path), tensors.keys(), factors)
    sd: dict[str, Any] = {}
    inv_freq = None
    kept = _Kept(keep_blocks, path)
    for name, t in tensors.items():
        if name == "rope_freqs.weight":
            # Llama 3 rope scaling, stored by llama.cpp as per-pair frequency divisors.
            base = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float()
                                             / cfg.head_dim))
            inv_freq = base / dequantize(t, path).flatten()
        elif name in GLOBAL_NAMES:
            blocks = kept(t, name)
            sd[GLOBAL_NAMES[name]] = (quant_linear.from_blocks(t.ggml_type, _blocks(t), t.shape[-1]) if blocks
                                      else dequantize(t, path))
        elif (m := LAYER_RE.fullmatch(name)) is not None:
            if kept(t, m.group(2)):  # the same row splits and permutations, on rows of blocks
                for hf, rows in hf_tensors(m.group(2), _blocks(t), cfg):
                    w = quant_linear.from_blocks(t.ggml_type, rows.contiguous(), t.shape[-1])
                    sd[f"model.layers.{m.group(1)}.{hf}"] = w
            else:
                for hf, w in hf_tensors(m.group(2), dequantize(t, path), cfg):
                    sd[f"model.layers.{m.group(1)}.{hf}"] = w
    return cfg, sd, inv_freq
