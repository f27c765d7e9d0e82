"""Tiny random checkpoints of every dense family, written by transformers itself at test time (no hub).

Each family's config sets what makes it differ from Llama at a size where a broken switch would show:
windows shorter than the test prompts, a query_pre_attn_scalar other than head_dim, softcaps that bite.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.tiny_model import HIDDEN, INTERMEDIATE, KV_HEADS, MAX_POSITIONS, _hf_tokenizer, _random_model

HEADS = 4
LAYERS = 3
HEAD_DIM = 16


def _common(vocab: int) -> dict[str, Any]:
    return dict(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                max_position_embeddings=MAX_POSITIONS, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)


def family_config(family: str, vocab: int, **overrides: Any):
    """A transformers config of `family` at the tiny shape."""
    import transformers as tf

    c = _common(vocab)
    if family == "qwen3":  # head_dim set apart from hidden / heads, as Qwen3's are
        cfg = tf.Qwen3Config(**c, head_dim=24, tie_word_embeddings=True, **overrides)
    elif family == "qwen2-window":  # layers from max_window_layers on slide
        cfg = tf.Qwen2Config(**c, use_sliding_window=True, sliding_window=6, max_window_layers=1,
                             tie_word_embeddings=False, **overrides)
    elif family == "mistral":
        cfg = tf.MistralConfig(**c, sliding_window=5, head_dim=HEAD_DIM, tie_word_embeddings=False,
                               **overrides)
    elif family == "gemma2":
        cfg = tf.Gemma2Config(**c, head_dim=HEAD_DIM, query_pre_attn_scalar=24, sliding_window=6,
                              attn_logit_softcapping=2.0, final_logit_softcapping=5.0, **overrides)
    elif family == "gemma3":
        cfg = tf.Gemma3TextConfig(**c, head_dim=HEAD_DIM, query_pre_attn_scalar=24, sliding_window=6,
                                  layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                  rope_parameters={"sliding_attention": {"rope_type": "default",
                                                                         "rope_theta": 10000.0},
                                                   "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                      "rope_theta": 1000000.0}},
                                  **overrides)
    elif family == "phi3":
        cfg = tf.Phi3Config(**c, sliding_window=7, tie_word_embeddings=False, pad_token_id=0, **overrides)
    else:
        raise ValueError(f"no tiny config for family {family!r}")
    if family == "gemma3":
        cfg.architectures = ["Gemma3ForCausalLM"]
    return cfg


def hf_models_of(checkpoints: dict[str, Path]) -> dict:
    """transformers' own fp32 model of each checkpoint folder, by the same keys (the tests' reference)."""
    from transformers import AutoModelForCausalLM

    return {k: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval()
            for k, p in checkpoints.items()}


def make_tiny_family(path: str | Path, family: str, *, seed: int = 0, **overrides: Any) -> Path:
    """Write a tiny random `family` checkpoint (config.json, model.safetensors, tokenizer) to `path`."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = _hf_tokenizer()
    model = _random_model(family_config(family, len(tok), **overrides), seed)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path
