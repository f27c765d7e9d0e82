"""The mixture-of-experts families: Qwen3-MoE (Qwen3's attention, softmax router, top-k optionally
renormalised) and Mixtral (Mistral's attention, top-k of the router's logits then softmax: the same as
softmax, top-k, renormalise). Their expert weights load as mlp.gate.weight (the router) and
mlp.experts.N.{gate,up,down}_proj.weight: the names of the Hub's checkpoints and of transformers'
save_pretrained; its save_pretrained(save_original_format=False) writes each layer's experts fused
instead (mlp.experts.gate_up_proj (E, 2I, H), gate rows then up rows, and mlp.experts.down_proj (E, H, I)),
split here."""

from __future__ import annotations

from mixserve.model.config import ModelConfig, MoeConfig
from mixserve.model.errors import ModelLoadError
from mixserve.model.families.base import Family, Raw, StateDict, layer_windows
from mixserve.model.families.qwen3 import qwen3_fields


def _qwen3_moe(raw: Raw, where: str) -> Raw:
    n = int(raw["num_hidden_layers"])
    step = int(raw.get("decoder_sparse_step", 1))
    dense = set(raw.get("mlp_only_layers") or [])
    # the Hub's configs say num_experts; transformers 5 writes its own name for it, num_local_experts
    experts = int(raw["num_experts"] if "num_experts" in raw else raw["num_local_experts"])
    layers = tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(n))
    moe = MoeConfig(num_experts=experts, top_k=int(raw["num_experts_per_tok"]),
                    intermediate_size=int(raw["moe_intermediate_size"]),
                    norm_topk_prob=bool(raw.get("norm_topk_prob", False)), layers=layers,
                    weights_in_model_dtype=True)
    return {**qwen3_fields(raw, where), "moe": moe if any(layers) else None}  # no sparse layer: dense


def _mixtral(raw: Raw, where: str) -> Raw:
    moe = MoeConfig(num_experts=int(raw["num_local_experts"]), top_k=int(raw["num_experts_per_tok"]),
                    intermediate_size=int(raw["intermediate_size"]), norm_topk_prob=True)
    return {"moe": moe, "layer_windows": layer_windows(raw, int(raw["num_hidden_layers"]))}


def _split_fused_experts(sd: StateDict, cfg: ModelConfig) -> StateDict:
    """mlp.experts.gate_up_proj / down_proj (transformers' fused layout) -> mlp.experts.N.*_proj.weight
    (views, no copy); a state dict without them comes back as it is."""
    moe = cfg.moe
    if moe is None or not any(n.endswith(".experts.gate_up_proj") for n in sd):
        return sd
    shapes = {"gate_up_proj": (moe.num_experts, 2 * moe.intermediate_size, cfg.hidden_size),
              "down_proj": (moe.num_experts, cfg.hidden_size, moe.intermediate_size)}
    out: StateDict = {}
    for name, t in sd.items():
        kind = name.rsplit(".", 1)[-1]
        if not name.endswith(f".experts.{kind}") or kind not in shapes:
            out[name] = t
            continue
        if tuple(t.shape) != shapes[kind]:
            raise ModelLoadError(f"fused expert weight {name} has shape {tuple(t.shape)}, "
                                 f"expected {shapes[kind]}")
        prefix = name[: -len(kind)]
        for j, w in enumerate(t.unbind(0)):
            if kind == "down_proj":
                out[f"{prefix}{j}.down_proj.weight"] = w
            else:
                gate, up = w.chunk(2, dim=0)
                out[f"{prefix}{j}.gate_proj.weight"], out[f"{prefix}{j}.up_proj.weight"] = gate, up
    return out


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
    return _split_fused_experts(out, cfg)


QWEN3_MOE = Family("qwen3_moe", ("Qwen3MoeForCausalLM",), ("qwen3moe",), hf_config=_qwen3_moe,
                   hf_names=_split_fused_experts)
MIXTRAL = Family("mixtral", ("MixtralForCausalLM",), (), hf_config=_mixtral, hf_names=_mixtral_names)
