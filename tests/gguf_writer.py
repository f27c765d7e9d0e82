"""Tiny random HF checkpoints of every family llama.cpp converts, and a GGUF writer that lays a checkpoint
out as llama.cpp's convert_hf_to_gguf.py does: gguf-py's tensor names, Q/K rows permuted for the llama
arch (Llama, Mistral, Mixtral), 1 added to Gemma's norms, Phi-3's fused q/k/v and gate/up kept fused, its
longrope factors as tensors, experts stacked in 3D; F32 or F16 tensors (1D ones and the router stay F32).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tests.tiny_model import (
    HIDDEN,
    INTERMEDIATE,
    KV_HEADS,
    MAX_POSITIONS,
    SPECIAL_TOKENS,
    _hf_tokenizer,
    _random_model,
)

LAYERS = 3
HEADS = 4
HEAD_DIM = 16  # = HIDDEN / HEADS, so llama.cpp's Gemma scale (head_dim) and the 27B's (hidden / heads) agree
ORIGINAL_CONTEXT = 64  # phi3-longrope: long factors from this position on
# HF architecture -> llama.cpp's arch (convert_hf_to_gguf registers Mistral and Mixtral as LlamaModel)
ARCHS = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "MixtralForCausalLM": "llama",
         "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3moe",
         "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3", "Phi3ForCausalLM": "phi3"}
FAMILIES = ["qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3", "phi3-longrope", "qwen3moe", "mixtral"]


def gguf_family_config(family: str, vocab: int):
    """A transformers config of `family` at a tiny shape, with only what a GGUF file can say (llama.cpp keeps
    no query_pre_attn_scalar, no Qwen/Mistral window, Gemma's fixed layer patterns)."""
    import transformers as tf

    c: dict[str, Any] = dict(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                             num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                             num_key_value_heads=KV_HEADS, max_position_embeddings=MAX_POSITIONS,
                             rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
    experts = dict(num_experts_per_tok=2, tie_word_embeddings=False)
    if family == "qwen2":
        return tf.Qwen2Config(**c, tie_word_embeddings=False)
    if family == "qwen3":  # head_dim apart from hidden / heads, as Qwen3's are
        return tf.Qwen3Config(**c, head_dim=24, tie_word_embeddings=True)
    if family == "mistral":
        return tf.MistralConfig(**c, head_dim=HEAD_DIM, sliding_window=None, tie_word_embeddings=False)
    if family == "gemma2":
        return tf.Gemma2Config(**c, head_dim=HEAD_DIM, query_pre_attn_scalar=HEAD_DIM, sliding_window=6,
                               attn_logit_softcapping=2.0, final_logit_softcapping=5.0)
    if family == "gemma3":  # six layers: five slide (RoPE base 1e4), the sixth sees all (base 1e6, linear x2)
        cfg = tf.Gemma3TextConfig(**{**c, "num_hidden_layers": 6}, head_dim=HEAD_DIM,
                                  query_pre_attn_scalar=HEAD_DIM, sliding_window=6,
                                  rope_parameters={"sliding_attention": {"rope_type": "default",
                                                                         "rope_theta": 10000.0},
                                                   "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                      "rope_theta": 1000000.0}})
        cfg.architectures = ["Gemma3ForCausalLM"]
        return cfg
    if family in ("phi3", "phi3-longrope"):
        rope = None
        if family == "phi3-longrope":
            g = torch.Generator().manual_seed(5)
            short = 1 + torch.rand(HEAD_DIM // 2, generator=g)
            long = 1 + 8 * torch.rand(HEAD_DIM // 2, generator=g)
            rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": short.tolist(),
                    "long_factor": long.tolist(), "original_max_position_embeddings": ORIGINAL_CONTEXT}
        extra = {"rope_parameters": rope, "original_max_position_embeddings": ORIGINAL_CONTEXT}
        return tf.Phi3Config(**c, sliding_window=7, tie_word_embeddings=False, pad_token_id=0,
                             **(extra if rope else {}))
    if family == "qwen3moe":  # every layer sparse and renormalised, as llama.cpp's qwen3moe graph runs it
        return tf.Qwen3MoeConfig(**c, head_dim=24, num_experts=4, moe_intermediate_size=32,
                                 norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], **experts)
    if family == "mixtral":
        return tf.MixtralConfig(**c, num_local_experts=4, sliding_window=None, **experts)
    raise ValueError(f"no tiny GGUF config for family {family!r}")


def make_hf_folder(path: Path, family: str, *, seed: int = 0, f16: bool = False) -> Path:
    """A tiny random `family` checkpoint (config.json, model.safetensors, tokenizer) in `path`; with `f16` the
    weights are rounded to float16 first, so an F16 GGUF of them holds the very same values."""
    path.mkdir(parents=True, exist_ok=True)
    tok = _hf_tokenizer()
    model = _random_model(gguf_family_config(family, len(tok)), seed)
    if f16:
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.half().float())
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    if family == "qwen3moe":  # transformers 5 saves num_local_experts; the hub's Qwen3-MoE has num_experts
        raw = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**raw, "num_experts": raw["num_local_experts"]}))
    return path


def _rope(cfg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(full-attention, sliding-attention) rope parameters, as the converter's rope_parameters reads them."""
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    full = dict(rope.get("full_attention", rope))
    full.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    return full, dict(rope.get("sliding_attention", {}))


def _write_params(w, arch: str, cfg: dict[str, Any]) -> None:
    """The key/values each converter class writes (TextModel's, or the class's own set_gguf_parameters)."""
    import gguf

    n, heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    full, sliding = _rope(cfg)
    w.add_block_count(n)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(cfg.get("num_key_value_heads") or heads)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if arch == "phi3":  # Phi3MiniModel writes its own set, longrope as tensors plus these
        w.add_rope_dimension_count(head_dim)
        w.add_rope_freq_base(full["rope_theta"])
        w.add_sliding_window(cfg.get("sliding_window") or 0)
        original = full.get("original_max_position_embeddings", cfg["max_position_embeddings"])
        w.add_rope_scaling_orig_ctx_len(original)
        if full.get("long_factor"):
            scale = cfg["max_position_embeddings"] / original
            w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
        return
    if arch != "gemma2":  # Gemma2Model writes no RoPE keys (llama.cpp's base 10000)
        if full.get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(full["factor"])
        w.add_rope_freq_base(full["rope_theta"])
        if "rope_theta" in sliding:
            w.add_rope_freq_base_swa(sliding["rope_theta"])
    if cfg.get("head_dim"):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if (experts := cfg.get("num_local_experts") or cfg.get("num_experts")) is not None:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
    if arch == "qwen3moe":
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if arch == "llama":
        w.add_vocab_size(cfg["vocab_size"])
        w.add_rope_dimension_count(head_dim)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        w.add_sliding_window(cfg["sliding_window"])
    if arch == "gemma3":
        if cfg.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        w.add_sliding_window(cfg["sliding_window"])


def _write_vocab(w, folder: Path, eos_token: str | None) -> None:
    """GPT-2 BPE vocabulary in id order, special tokens as CONTROL; bos/eos/chat template by gguf.SpecialVocab
    from the folder's tokenizer files, as the converter takes them; `eos_token` overrides the eos id."""
    import gguf
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    vocab = tok.backend_tokenizer.get_vocab(with_added_tokens=True)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in SPECIAL_TOKENS else gguf.TokenType.NORMAL
                       for t in tokens])
    special = gguf.SpecialVocab(folder, load_merges=True)
    if eos_token is not None:
        special.special_token_ids["eos"] = tok.convert_tokens_to_ids(eos_token)
    special.add_to_gguf(w, quiet=True)


def _converted(arch: str, cfg: dict[str, Any], sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF tensors as the converter's modify_tensors hands them on: permuted, +1, experts stacked."""
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for name, t in sd.items():
        t = t.float()
        if arch.startswith("gemma"):
            if name == "lm_head.weight":
                continue  # Gemma's converter skips it: the embedding is the head
            if name.endswith("norm.weight"):
                t = t + 1  # Gemma's RMSNorm scales by (1 + w)
        if arch == "llama" and (".self_attn.q_proj." in name or ".self_attn.k_proj." in name):
            n = heads if ".q_proj." in name else kv
            t = t.reshape(n, 2, t.shape[0] // n // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)
        if ".experts." in name:  # ...experts.E.w1.weight / ...experts.E.gate_proj.weight
            head, _, rest = name.partition(".experts.")
            e, _, kind = rest.partition(".")
            stacked = f"{head}.experts.{kind}".replace(".block_sparse_moe.", ".mlp.")
            experts.setdefault(stacked, {})[int(e)] = t
            continue
        out[name] = t
    renames = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
    for name, by_expert in experts.items():
        for old, new in renames.items():
            name = name.replace(f".experts.{old}.", f".experts.{new}.")
        out[name] = torch.stack([by_expert[e] for e in sorted(by_expert)])
    return out


def write_gguf(folder: Path, out: Path, *, f16: bool = False, eos_token: str | None = None) -> Path:
    """Write the HF checkpoint in `folder` to the GGUF file `out` as convert_hf_to_gguf.py would."""
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((folder / "config.json").read_text())
    arch = ARCHS[cfg["architectures"][0]]
    model_arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(model_arch, cfg["num_hidden_layers"])
    out.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name("tiny-" + arch)
    _write_params(w, arch, cfg)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if f16 else gguf.LlamaFileType.ALL_F32)
    _write_vocab(w, folder, eos_token)
    tensors = _converted(arch, cfg, load_file(str(folder / "model.safetensors")))
    full, _ = _rope(cfg)
    if full.get("long_factor"):
        tensors["rope_factors_long.weight"] = torch.tensor(full["long_factor"])
        tensors["rope_factors_short.weight"] = torch.tensor(full["short_factor"])
    for name, t in tensors.items():
        new = name if name.startswith("rope_factors") else names.get_name(name, (".weight", ".bias"))
        if new is None:
            raise ValueError(f"no GGUF name for {name}")
        keep_f32 = not f16 or t.ndim < 2 or new.endswith("ffn_gate_inp.weight")  # as the converter keeps them
        w.add_tensor(new, np.ascontiguousarray(t.numpy().astype(np.float32 if keep_f32 else np.float16)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
