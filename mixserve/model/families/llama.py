"""Llama and the families that differ from it only in config: Mistral (sliding window), Qwen2 (q/k/v bias)."""

from __future__ import annotations

from mixserve.model.families.base import Family, Raw, layer_windows


def _mistral(raw: Raw, where: str) -> Raw:
    return {"layer_windows": layer_windows(raw, int(raw["num_hidden_layers"]))}


def qwen_windows(raw: Raw) -> tuple[int, ...]:
    """Qwen2/Qwen3: layers from max_window_layers on slide, and only with use_sliding_window."""
    n = int(raw["num_hidden_layers"])
    start = int(raw.get("max_window_layers", n))
    return layer_windows(raw, n, [bool(raw.get("use_sliding_window")) and i >= start for i in range(n)])


def _qwen2(raw: Raw, where: str) -> Raw:
    return {"qkv_bias": True, "layer_windows": qwen_windows(raw)}


LLAMA = Family("llama", ("LlamaForCausalLM",), ("llama",))
MISTRAL = Family("mistral", ("MistralForCausalLM",), ("mistral",), hf_config=_mistral)
QWEN2 = Family("qwen2", ("Qwen2ForCausalLM",), ("qwen2",), hf_config=_qwen2)
