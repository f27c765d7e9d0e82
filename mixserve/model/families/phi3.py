"""Phi-3/3.5/4: Llama with q/k/v and gate/up stored fused (qkv_proj, gate_up_proj), a sliding window on
some checkpoints and longrope scaling on the long-context ones (base.rope_scaling reads it)."""

from __future__ import annotations

from mixserve.model.config import ModelConfig
from mixserve.model.families.base import Family, Raw, StateDict, layer_windows


def _phi3(raw: Raw, where: str) -> Raw:
    return {"layer_windows": layer_windows(raw, int(raw["num_hidden_layers"]))}


def _split_fused(sd: StateDict, cfg: ModelConfig) -> StateDict:
    """qkv_proj -> q/k/v_proj and gate_up_proj -> gate/up_proj (views: the loader concatenates them again)."""
    q, kv, ffn = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    out: StateDict = {}
    for name, t in sd.items():
        if name.endswith("self_attn.qkv_proj.weight"):
            base = name.removesuffix("qkv_proj.weight")
            for part, w in zip("qkv", t.split([q, kv, kv]), strict=True):
                out[f"{base}{part}_proj.weight"] = w
        elif name.endswith("mlp.gate_up_proj.weight"):
            base = name.removesuffix("gate_up_proj.weight")
            out[base + "gate_proj.weight"], out[base + "up_proj.weight"] = t.split([ffn, ffn])
        else:
            out[name] = t
    return out


PHI3 = Family("phi3", ("Phi3ForCausalLM",), ("phi3",), hf_config=_phi3, hf_names=_split_fused)
