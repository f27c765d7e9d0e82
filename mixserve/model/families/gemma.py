"""Gemma 2 and Gemma 3 (text): scaled embedding, (1 + w) norms, GeGLU, a norm after attention and around
the MLP, query_pre_attn_scalar, interleaved sliding-window layers; Gemma 2 softcaps scores and logits,
Gemma 3 norms q and k per head and gives its sliding layers their own RoPE base."""

from __future__ import annotations

import math

from mixserve.model.config import ModelConfig
from mixserve.model.errors import ModelLoadError
from mixserve.model.families.base import Family, Raw, StateDict, layer_windows, rope_params, rope_theta

_ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh", "gelu": "gelu_tanh"}


def _shared(raw: Raw, where: str) -> Raw:
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in _ACTIVATIONS:
        raise ModelLoadError(f"{where}: unsupported Gemma activation {act!r}")
    return {"norm_offset": 1.0, "embed_scale": math.sqrt(int(raw["hidden_size"])), "activation": "gelu_tanh",
            "sandwich_norm": True, "attn_scale": float(raw.get("query_pre_attn_scalar", 256)) ** -0.5,
            "tie_word_embeddings": bool(raw.get("tie_word_embeddings", True))}


def _gemma2(raw: Raw, where: str) -> Raw:
    n = int(raw["num_hidden_layers"])
    raw = {"sliding_window": 4096, **raw}
    return {**_shared(raw, where), "attn_softcap": float(raw.get("attn_logit_softcapping") or 0.0),
            "final_softcap": float(raw.get("final_logit_softcapping") or 0.0),
            "layer_windows": layer_windows(raw, n, [i % 2 == 0 for i in range(n)])}


def text_config(raw: Raw) -> Raw:
    """Gemma 3's multimodal checkpoints (Gemma3ForConditionalGeneration) nest the text model's config."""
    return {**raw["text_config"], "architectures": raw.get("architectures")} if "text_config" in raw else raw


def _gemma3(raw: Raw, where: str) -> Raw:
    n = int(raw["num_hidden_layers"])
    pattern = int(raw.get("sliding_window_pattern", 6))
    raw = {"sliding_window": 4096, **raw}
    local = rope_params(raw, "sliding_attention")
    full = rope_params(raw, "full_attention")
    return {**_shared(raw, where), "qk_norm": True,
            "attn_softcap": float(raw.get("attn_logit_softcapping") or 0.0),
            "final_softcap": float(raw.get("final_logit_softcapping") or 0.0),
            "layer_windows": layer_windows(raw, n, [(i + 1) % pattern != 0 for i in range(n)]),
            "rope_theta": rope_theta(raw, full, 1_000_000.0),
            "local_rope_theta": float(local.get("rope_theta", raw.get("rope_local_base_freq", 10000.0)))}


def _gemma3_names(sd: StateDict, cfg: ModelConfig) -> StateDict:
    """The multimodal checkpoint's language model under Llama's names; the vision tower is dropped."""
    prefix = "model.language_model."
    if not any(k.startswith(prefix) for k in sd):
        return sd
    return {"model." + k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}


GEMMA2 = Family("gemma2", ("Gemma2ForCausalLM",), ("gemma2",), hf_config=_gemma2)
GEMMA3 = Family("gemma3", ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"), ("gemma3",),
                hf_config=_gemma3, hf_names=_gemma3_names)
