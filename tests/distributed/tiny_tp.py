"""Tiny random Llamas whose heads do not split evenly over 2 ranks (tests/tiny_model.py fixes 4 heads in 2
groups): the tokenizer and weight initialisation are tiny_model's, only the shape differs."""

from __future__ import annotations

from pathlib import Path

from tests import tiny_model


def make_tiny_tp_llama(path: Path, *, heads: int, kv_heads: int, head_dim: int = 16, intermediate: int = 99,
                       tie: bool = True, seed: int = 0) -> Path:
    """A Hugging Face folder: `heads` query heads in `kv_heads` groups; an odd `intermediate` (and the
    tokenizer's vocabulary) split unevenly too."""
    from transformers import LlamaConfig

    path.mkdir(parents=True, exist_ok=True)
    tok = tiny_model._hf_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=heads * head_dim, intermediate_size=intermediate,
                      num_hidden_layers=tiny_model.LAYERS, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, head_dim=head_dim,
                      max_position_embeddings=tiny_model.MAX_POSITIONS, rms_norm_eps=tiny_model.RMS_EPS,
                      tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2,
                      rope_parameters={"rope_type": "default", "rope_theta": tiny_model.ROPE_THETA},
                      attention_bias=False, mlp_bias=False)
    model = tiny_model._random_model(cfg, seed)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path
