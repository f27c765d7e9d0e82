"""ModelConfig fields from GGUF metadata (llama.cpp's key names): those every family reads the same way, then
each family's own, keyed by family name, with what llama.cpp's loader assumes where the file says nothing
(src/llama-model.cpp). Whatever only the tensor table tells (longrope factors, which layers hold experts)
comes in `with_tensors`."""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from dataclasses import replace
from typing import Any

import torch

from mixserve.model.config import ModelConfig, MoeConfig, RopeScaling
from mixserve.model.errors import ModelLoadError
from mixserve.model.families.base import Family

Fields = dict[str, Any]
_REQUIRED = object()
# The texts llama.cpp's vocabulary marks as end-of-generation (llama-vocab.cpp); we take those the chat
# template writes, so a chat's turn end stops generation as the HF folder's generation_config makes it do.
EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>",
             "<|end_of_text|>")


class Meta:
    """GGUF key/values with `{arch}.` keys by their short name; a missing required key is a ModelLoadError."""

    def __init__(self, meta: dict[str, Any], where: str):
        self.raw, self.where, self.arch = meta, where, meta["general.architecture"]

    def get(self, key: str, default: Any = _REQUIRED) -> Any:
        value = self.raw.get(f"{self.arch}.{key}")
        if value is None:
            if default is _REQUIRED:
                raise ModelLoadError(f"{self.where}: GGUF metadata lacks {self.arch}.{key}")
            return default
        return value


def eos_ids(meta: dict[str, Any]) -> tuple[int, ...]:
    """tokenizer.ggml's eos, eot and eom ids, and the end-of-generation tokens the chat template writes."""
    ids = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    template = meta.get("tokenizer.chat_template")
    texts = {t for t in EOG_TEXTS if isinstance(template, str) and t in template}
    if texts:
        ids += [i for i, t in enumerate(meta.get("tokenizer.ggml.tokens") or ()) if t in texts]
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))


def _rope_scaling(m: Meta) -> RopeScaling:
    kind = m.get("rope.scaling.type", "none")
    if kind == "linear":
        return RopeScaling("linear", factor=float(m.get("rope.scaling.factor")),
                           original_max_position_embeddings=int(m.get("context_length")))
    if kind not in ("none", "longrope"):  # longrope: its factors are tensors (with_tensors)
        raise ModelLoadError(f"{m.where}: unsupported rope scaling type {kind!r}; supported: none, linear, "
                             "longrope")
    return RopeScaling()


def _windows(m: Meta, n: int, pattern: int, default_window: int = 0) -> tuple[int, ...]:
    """Per layer windows: `attention.sliding_window` on the layers llama.cpp's set_swa_pattern(pattern)
    slides (il % pattern < pattern - 1; 1 slides none, 0 all), unless the file lists them."""
    window = int(m.get("attention.sliding_window", default_window))
    listed = m.get("attention.sliding_window_pattern", pattern)
    if isinstance(listed, list):
        if len(listed) != n:
            raise ModelLoadError(f"{m.where}: sliding_window_pattern has {len(listed)} entries, {n} layers")
        sliding = [bool(s) for s in listed]
    else:
        p = int(listed)
        sliding = [p == 0 or i % p < p - 1 for i in range(n)]
    return tuple(window if s else 0 for s in sliding) if window and any(sliding) else ()


def _gemma(m: Meta, f: Fields, big_layers: int) -> Fields:
    """What Gemma 2 and 3 share. The file's norms already hold 1 + w (the converter adds 1), so no offset;
    llama.cpp stores no query_pre_attn_scalar: head_dim, but hidden / heads for the 27B (its layer count)."""
    per_head = f["hidden_size"] // f["num_heads"] if f["num_layers"] == big_layers else f["head_dim"]
    return {"norm_offset": 0.0, "embed_scale": math.sqrt(f["hidden_size"]), "activation": "gelu_tanh",
            "sandwich_norm": True, "attn_scale": float(per_head) ** -0.5}


def _gemma2(m: Meta, f: Fields) -> Fields:
    # llama.cpp's defaults: a 4096 window on even layers, softcaps 50 (scores) and 30 (logits)
    return {**_gemma(m, f, 46), "attn_softcap": float(m.get("attn_logit_softcapping", 50.0)),
            "final_softcap": float(m.get("final_logit_softcapping", 30.0)),
            "layer_windows": _windows(m, f["num_layers"], 2, 4096)}


def _gemma3(m: Meta, f: Fields) -> Fields:
    # five sliding layers in six, with their own unscaled RoPE base (llama.cpp: 10000, newer files store it)
    windows = _windows(m, f["num_layers"], 6)
    local = float(m.get("rope.freq_base_swa", 10000.0)) if windows else None
    return {**_gemma(m, f, 62), "qk_norm": True, "layer_windows": windows, "local_rope_theta": local,
            "final_softcap": float(m.get("final_logit_softcapping", 0.0))}


def _moe(m: Meta, f: Fields) -> Fields:
    """Router softmax, top expert_used_count, renormalised (llama.cpp's llama and qwen3moe graphs do)."""
    gating = int(m.get("expert_gating_func", 1))
    if gating not in (0, 1):  # llama.cpp's none (the arch's default) and softmax
        raise ModelLoadError(f"{m.where}: expert gating function {gating} not supported; only softmax (1)")
    moe = MoeConfig(num_experts=int(m.get("expert_count")), top_k=int(m.get("expert_used_count")),
                    intermediate_size=int(m.get("expert_feed_forward_length", f["intermediate_size"])),
                    norm_topk_prob=bool(m.get("expert_weights_norm", True)),
                    weights_in_model_dtype=f["family"] == "qwen3_moe")
    return {"moe": moe}


_FAMILY_FIELDS: dict[str, Callable[[Meta, Fields], Fields]] = {
    "qwen3": lambda m, f: {"qk_norm": True},
    "qwen3_moe": lambda m, f: {"qk_norm": True, **_moe(m, f)},
    "mixtral": _moe,
    "gemma2": _gemma2,
    "gemma3": _gemma3,
    "phi3": lambda m, f: {"layer_windows": _windows(m, f["num_layers"], 0)},  # every layer, if any window
}


def family_name(meta: dict[str, Any], family: Family) -> str:
    """The family a file's architecture means: llama.cpp writes Mixtral as "llama" with experts."""
    if family.name == "llama" and meta.get(f"{meta['general.architecture']}.expert_count"):
        return "mixtral"
    return family.name


def gguf_fields(meta: dict[str, Any], where: str, family: Family, *, vocab_size: int, tied: bool) -> Fields:
    """ModelConfig's fields of GGUF metadata `meta` (of `family`'s architecture); errors name `where`."""
    m = Meta(meta, where)
    name = family_name(meta, family)
    try:
        hidden, heads = int(m.get("embedding_length")), int(m.get("attention.head_count"))
        f: Fields = dict(
            vocab_size=vocab_size, hidden_size=hidden, intermediate_size=int(m.get("feed_forward_length")),
            num_layers=int(m.get("block_count")), num_heads=heads,
            num_kv_heads=int(m.get("attention.head_count_kv", heads)),
            head_dim=int(m.get("attention.key_length", hidden // heads)),
            max_position_embeddings=int(m.get("context_length")),
            rms_norm_eps=float(m.get("attention.layer_norm_rms_epsilon")),
            rope_theta=float(m.get("rope.freq_base", 10000.0)), rope_scaling=_rope_scaling(m),
            tie_word_embeddings=tied, architecture=m.arch, family=name,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"), eos_token_ids=eos_ids(meta))
        hook = _FAMILY_FIELDS.get(name)
        return {**f, **hook(m, f)} if hook else f
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"{where}: bad GGUF metadata value ({' '.join(str(e).split())})") from None


def with_tensors(cfg: ModelConfig, meta: dict[str, Any], where: str, names: Collection[str],
                 rope_factors: dict[str, torch.Tensor]) -> ModelConfig:
    """cfg with what the tensor table says: q/k/v biases (Qwen2), Phi-3's longrope factors (the
    rope_factors_short/_long tensors, the scale from rope.scaling.*), which layers hold experts."""
    m = Meta(meta, where)
    cfg = replace(cfg, qkv_bias="blk.0.attn_q.bias" in names)
    if rope_factors:
        short, long = (rope_factors.get(f"rope_factors_{k}.weight") for k in ("short", "long"))
        half = cfg.head_dim // 2
        if short is None or long is None or short.numel() != half or long.numel() != half:
            raise ModelLoadError(f"{where}: longrope needs rope_factors_short and rope_factors_long tensors "
                                 f"of head_dim/2 = {half} entries")
        original = int(m.get("rope.scaling.original_context_length"))
        factor = cfg.max_position_embeddings / original
        default = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1.0 else 1.0
        cfg = replace(cfg, rope_scaling=RopeScaling(
            "longrope", factor=factor, original_max_position_embeddings=original,
            short_factor=tuple(short.flatten().tolist()), long_factor=tuple(long.flatten().tolist()),
            attention_factor=float(m.get("rope.scaling.attn_factor", default))))
    elif cfg.rope_scaling.rope_type == "default" and m.get("rope.scaling.type", "none") == "longrope":
        raise ModelLoadError(f"{where}: longrope scaling without rope_factors_short/long tensors")
    if cfg.moe is not None:
        sparse = tuple(f"blk.{i}.ffn_gate_inp.weight" in names for i in range(cfg.num_layers))
        cfg = replace(cfg, moe=replace(cfg.moe, layers=() if all(sparse) else sparse))
    return cfg
