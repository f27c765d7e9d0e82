"""The mixture-of-experts families: Qwen3-MoE (Qwen3's attention, softmax router, top-k optionally
renormalised) and Mixtral (Mistral's attention, top-k of the router's logits then softmax: the same as
softmax, top-k, renormalise). Their expert weights load as mlp.gate.weight (the router) and
mlp.experts.N.{gate,up,down}_proj.weight."""

from __future__ import annotations

from mixserve.model.config import ModelConfig, MoeConfig
from mixserve.model.families.base import Family, Raw, StateDict, layer_windows
from mixserve.model.families.qwen3 import qwen3_fields


def _qwen3_moe(raw: Raw, where: str) -> Raw:
    n = int(raw["num_hidden_layers"])
    step = int(raw.get("decoder_sparse_step", 1))
    dense = set(raw.get("mlp_only_layers") or [])
    experts = int(raw["num_experts"])
    layers = tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(n))
    moe = MoeConfig(num_experts=experts, top_k=int(raw["num_experts_per_tok"]),
                    intermediate_size=int(raw["moe_intermediate_size"]),
                    norm_topk_prob=bool(raw.get("norm_topk_prob", False)), layers=layers)
    return {**qwen3_fields(raw, where), "moe": moe}


def _mixtral(raw: Raw, where: str) -> Raw:
    moe = MoeConfig(num_experts=int(raw["num_local_experts"]), top_k=int(raw["num_experts_per_tok"]),
                    intermediate_size=int(raw["intermediate_size"]), norm_topk_prob=True)
    return {"moe": moe, "layer_windows": layer_windows(raw, int(raw["num_hidden_layers"]))}


def _mixtral_names(sd: StateDict, cfg: ModelConfig) -> StateDict:
    """block_sparse_moe.{gate, experts.N.w1/w3/w2} -> mlp.{gate, experts.N.gate/up/down_proj}."""
    names = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
    out: StateDict = {}
    for name, t in sd.items():
        name = name.replace(".block_sparse_moe.", ".mlp.")
        parts = name.split(".")
        if len(parts) > 2 and parts[-2] in names and ".experts." in name:
            parts[-2] = names[parts[-2]]
        out[".".join(parts)] = t
    return out


QWEN3_MOE = Family("qwen3_moe", ("Qwen3MoeForCausalLM",), ("qwen3moe",), hf_config=_qwen3_moe)
MIXTRAL = Family("mixtral", ("MixtralForCausalLM",), (), hf_config=_mixtral, hf_names=_mixtral_names)
