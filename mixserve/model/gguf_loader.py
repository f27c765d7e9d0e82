"""Read a llama.cpp GGUF file into HF-named float tensors (dequantized) and a ModelConfig; the per-family
names and layouts are in families/gguf_names.py, the metadata in families/gguf_config.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from mixserve.model.config import ModelConfig
from mixserve.model.errors import ModelLoadError
from mixserve.model.families.gguf_config import with_tensors
from mixserve.model.families.gguf_names import GLOBAL_NAMES, LAYER_RE, hf_tensors, unpermute_qk
from mixserve.model.gguf_file import TensorInfo, read_gguf

__all__ = ["dequantize", "load_gguf", "unpermute_qk"]
_ROPE_FACTORS = ("rope_factors_short.weight", "rope_factors_long.weight")


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


def load_gguf(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], torch.Tensor | None]:
    """(config, HF-named float32 state dict, inv_freq override or None) of a GGUF file."""
    meta, tensors = read_gguf(path)
    if "token_embd.weight" not in tensors:
        raise ModelLoadError(f"{path}: GGUF file has no token_embd.weight tensor")
    vocab = int(tensors["token_embd.weight"].shape[0])
    cfg = ModelConfig.from_gguf(meta, str(path), vocab_size=vocab, tied="output.weight" not in tensors)
    factors = {n: dequantize(tensors[n], path) for n in _ROPE_FACTORS if n in tensors}
    cfg = with_tensors(cfg, meta, str(path), tensors.keys(), factors)
    sd: dict[str, torch.Tensor] = {}
    inv_freq = None
    for name, t in tensors.items():
        if name == "rope_freqs.weight":
            # Llama 3 rope scaling, stored by llama.cpp as per-pair frequency divisors.
            base = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float()
                                             / cfg.head_dim))
            inv_freq = base / dequantize(t, path).flatten()
        elif name in GLOBAL_NAMES:
            sd[GLOBAL_NAMES[name]] = dequantize(t, path)
        elif (m := LAYER_RE.fullmatch(name)) is not None:
            for hf, w in hf_tensors(m.group(2), dequantize(t, path), cfg):
                sd[f"model.layers.{m.group(1)}.{hf}"] = w
    return cfg, sd, inv_freq
