"""Read a llama.cpp GGUF file into HF-named float tensors (dequantized) and a ModelConfig."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from mixserve.model.config import ModelConfig
from mixserve.model.errors import ModelLoadError
from mixserve.model.gguf_file import TensorInfo, read_gguf

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE pairs -> HF rotate-half halves)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


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
    # llama.cpp permutes Q/K for the llama family only (qwen2 uses NEOX-style RoPE, stored as HF has it).
    permuted = cfg.architecture in ("llama", "mistral")
    sd: dict[str, torch.Tensor] = {}
    inv_freq = None
    for name, t in tensors.items():
        if name == "rope_freqs.weight":
            # Llama 3 rope scaling, stored by llama.cpp as per-pair frequency divisors.
            base = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float()
                                             / cfg.head_dim))
            inv_freq = base / dequantize(t, path).flatten()
            continue
        if name in _GLOBAL_NAMES:
            sd[_GLOBAL_NAMES[name]] = dequantize(t, path)
            continue
        m = _LAYER_RE.fullmatch(name)
        if m is None or m.group(2) not in _LAYER_NAMES:
            continue  # tensors this architecture does not use
        w = dequantize(t, path)
        if permuted and m.group(2).startswith(("attn_q.", "attn_k.")):
            heads = cfg.num_heads if m.group(2).startswith("attn_q.") else cfg.num_kv_heads
            w = unpermute_qk(w, heads)
        sd[f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"] = w
    return cfg, sd, inv_freq
