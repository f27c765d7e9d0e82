"""Qwen3: Llama plus an RMSNorm over each head of q and k (before RoPE), and an explicit head_dim."""

from __future__ import annotations

from mixserve.model.families.base import Family, Raw
from mixserve.model.families.llama import qwen_windows


def qwen3_fields(raw: Raw, where: str) -> Raw:
    return {"qk_norm": True, "layer_windows": qwen_windows(raw)}


QWEN3 = Family("qwen3", ("Qwen3ForCausalLM",), ("qwen3",), hf_config=qwen3_fields)
