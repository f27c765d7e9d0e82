"""llama.cpp's GGUF tensor names -> the HF names the decoder loads, per family, and the tensors a GGUF file
stores differently from HF: Q/K rows permuted (llama), q/k/v and gate/up fused (Phi-3), experts stacked in
3D (Mixtral, Qwen3-MoE). Names as convert_hf_to_gguf.py writes them (gguf-py's tensor_mapping.py)."""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch

from mixserve.model.config import ModelConfig

GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",  # Qwen3, Gemma 3
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",  # the MoE router
}
# Gemma 2/3: llama.cpp's ffn_norm is HF's pre_feedforward_layernorm; HF's post_attention_layernorm (the norm
# of attention's output) is post_attention_norm there.
SANDWICH_NAMES = {
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
EXPERT_NAMES = {"ffn_gate_exps.weight": "gate_proj.weight", "ffn_up_exps.weight": "up_proj.weight",
                "ffn_down_exps.weight": "down_proj.weight"}
FUSED_QKV = "attn_qkv.weight"  # Phi-3: rows q, k, v
PERMUTED_ARCHS = ("llama", "mistral")  # llama.cpp permutes Q/K for its llama RoPE (others use NEOX order)
LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE pairs -> HF rotate-half halves)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def layer_names(cfg: ModelConfig) -> dict[str, str]:
    """GGUF layer tensor (the part after `blk.N.`) -> HF name (after `model.layers.N.`) for cfg's family."""
    return {**LAYER_NAMES, **SANDWICH_NAMES} if cfg.sandwich_norm else LAYER_NAMES


def hf_tensors(key: str, w: torch.Tensor, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name after `model.layers.N.`, tensor) pairs for one GGUF layer tensor `key` (after `blk.N.`);
    nothing for a tensor the decoder does not use."""
    d = cfg.head_dim
    if key == FUSED_QKV:
        q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
        for part, t in zip("qkv", w.split([q, kv, kv]), strict=True):
            yield f"self_attn.{part}_proj.weight", t
        return
    if key == "ffn_up.weight" and w.shape[0] == 2 * cfg.intermediate_size and cfg.family == "phi3":
        gate, up = w.split(cfg.intermediate_size)  # Phi-3's gate_up_proj: gate rows first
        yield "mlp.gate_proj.weight", gate
        yield "mlp.up_proj.weight", up
        return
    if key in EXPERT_NAMES:  # (num_experts, out, in): one 2D weight per expert (views)
        for e, t in enumerate(w.unbind(0)):
            yield f"mlp.experts.{e}.{EXPERT_NAMES[key]}", t
        return
    name = layer_names(cfg).get(key)
    if name is None:
        return
    if cfg.architecture in PERMUTED_ARCHS and key.startswith(("attn_q.", "attn_k.")):
        w = unpermute_qk(w, cfg.num_heads if key.startswith("attn_q.") else cfg.num_kv_heads)
    yield name, w
