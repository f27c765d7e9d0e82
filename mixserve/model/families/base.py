"""What a model family is to the loader: the architectures it answers to, the config fields past Llama's,
and how its checkpoint names map onto Llama's. The common parsing of config.json lives here too."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mixserve.model.config import ModelConfig, RopeScaling
from mixserve.model.errors import ModelLoadError

Raw = dict[str, Any]  # a parsed config.json
StateDict = dict[str, torch.Tensor]
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")


def _no_extras(raw: Raw, where: str) -> Raw:
    return {}


def _same_names(sd: StateDict, cfg: ModelConfig) -> StateDict:
    return sd


@dataclass(frozen=True)
class Family:
    """One model family. `hf_config` returns the ModelConfig fields the family sets beyond the common ones
    (common_hf_fields); `hf_names` renames a loaded HF state dict to Llama's names plus the extras the
    decoder knows (self_attn.q_norm, pre_feedforward_layernorm, mlp.gate, mlp.experts.N.*_proj)."""

    name: str
    hf_architectures: tuple[str, ...]
    gguf_architectures: tuple[str, ...] = ()
    hf_config: Callable[[Raw, str], Raw] = _no_extras
    hf_names: Callable[[StateDict, ModelConfig], StateDict] = _same_names
    gguf_config: Callable[[Raw, str], Raw] = _no_extras  # the same as hf_config, from GGUF metadata


def layer_windows(raw: Raw, num_layers: int, default: list[bool] | None = None) -> tuple[int, ...]:
    """Per layer sliding windows from config.json: `layer_types` where the file has it, else `default`
    (which layers slide), each sliding layer seeing `sliding_window` tokens; () when none slides."""
    window = raw.get("sliding_window")
    types = raw.get("layer_types")
    if types is not None:
        if len(types) != num_layers:
            raise ModelLoadError(f"layer_types has {len(types)} entries for {num_layers} layers")
        sliding = [t == "sliding_attention" for t in types]
    else:
        sliding = default if default is not None else [bool(window)] * num_layers
    if not window or not any(sliding):
        return ()
    return tuple(int(window) if s else 0 for s in sliding)


def rope_params(raw: Raw, layer_type: str = "full_attention") -> Raw:
    """The rope parameters of config.json (transformers 5's rope_parameters, per layer type where the family
    has several, or the older rope_scaling + rope_theta)."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if layer_type in params and isinstance(params[layer_type], dict):
        params = params[layer_type]
    return dict(params)


def rope_theta(raw: Raw, params: Raw, default: float = 10000.0) -> float:
    return float(params.get("rope_theta", raw.get("rope_theta", default)))


def rope_scaling(raw: Raw, params: Raw, where: str, head_dim: int) -> RopeScaling:
    """RopeScaling of one layer type's parameters."""
    kind = params.get("rope_type", params.get("type", "default"))
    kind = "longrope" if kind == "su" else kind  # Phi-3's first configs call longrope "su"
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"{where}: unsupported rope scaling type {kind!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if kind == "default":
        return RopeScaling()
    max_pos = int(raw.get("max_position_embeddings", 8192))
    original = int(params.get("original_max_position_embeddings",
                              raw.get("original_max_position_embeddings", max_pos)))
    if kind == "longrope":
        short, long = tuple(map(float, params["short_factor"])), tuple(map(float, params["long_factor"]))
        if len(short) != head_dim // 2 or len(long) != head_dim // 2:
            raise ModelLoadError(f"{where}: longrope factors must have head_dim/2 = {head_dim // 2} entries")
        factor = float(params.get("factor") or max_pos / original)
        attention = params.get("attention_factor")
        if attention is None:  # HF's default (the LongRoPE paper's)
            attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        return RopeScaling("longrope", factor=factor, original_max_position_embeddings=original,
                           short_factor=short, long_factor=long, attention_factor=float(attention))
    return RopeScaling(kind, factor=float(params["factor"]),
                       low_freq_factor=float(params.get("low_freq_factor", 1.0)),
                       high_freq_factor=float(params.get("high_freq_factor", 4.0)),
                       original_max_position_embeddings=original)


def eos_ids(raw: Raw) -> tuple[int, ...]:
    eos = raw.get("eos_token_id")
    return tuple(int(e) for e in eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))


def common_hf_fields(raw: Raw, where: str, family: Family, architecture: str) -> Raw:
    """The ModelConfig fields every family reads the same way."""
    if float(raw.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ModelLoadError(f"{where}: partial rotary embeddings (partial_rotary_factor "
                             f"{raw['partial_rotary_factor']}) are not supported")
    hidden = int(raw["hidden_size"])
    heads = int(raw["num_attention_heads"])
    head_dim = int(raw.get("head_dim") or hidden // heads)
    params = rope_params(raw)
    return dict(
        vocab_size=int(raw["vocab_size"]), hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]), num_layers=int(raw["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads), head_dim=head_dim,
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), rope_theta=rope_theta(raw, params),
        rope_scaling=rope_scaling(raw, params, where, head_dim),
        qkv_bias=bool(raw.get("attention_bias", False)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)), architecture=architecture,
        bos_token_id=raw.get("bos_token_id"), eos_token_ids=eos_ids(raw), family=family.name)
