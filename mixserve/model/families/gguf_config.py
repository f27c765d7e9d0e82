"""The ModelConfig fields every family reads the same way from GGUF metadata (llama.cpp's key names)."""

from __future__ import annotations

from typing import Any

from mixserve.model.config import RopeScaling
from mixserve.model.errors import ModelLoadError
from mixserve.model.families.base import Family


def gguf_fields(meta: dict[str, Any], where: str, family: Family, *, vocab_size: int, tied: bool,
                ) -> dict[str, Any]:
    arch = meta["general.architecture"]

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"{where}: GGUF metadata lacks {arch}.{key}")
        return value

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    scaling = RopeScaling()
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if kind == "linear":
        scaling = RopeScaling("linear", factor=float(get("rope.scaling.factor")))
    elif kind not in ("none", None):
        raise ModelLoadError(f"{where}: unsupported rope scaling type {kind!r}")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return dict(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")), num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(meta.get(f"{arch}.attention.key_length", hidden // heads)),
        max_position_embeddings=int(get("context_length")),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_theta=float(get("rope.freq_base", 10000.0)), rope_scaling=scaling,
        qkv_bias=family.name == "qwen2", tie_word_embeddings=tied, architecture=arch,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),), family=family.name)
