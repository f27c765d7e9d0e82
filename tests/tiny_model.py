"""Tiny random Llama-family checkpoints written at test time, with a small working tokenizer.

`make_tiny_llama(path)` writes a Hugging Face folder (config.json + safetensors + tokenizer files) or a
GGUF file laid out as llama.cpp writes one (Q/K rows permuted for its RoPE layout, tokenizer in the
metadata), so tests can run the whole stack end to end in well under a second per forward.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

HIDDEN = 64
LAYERS = 2
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS
INTERMEDIATE = 128
VOCAB = 320
MAX_POSITIONS = 1024
ROPE_THETA = 10000.0
RMS_EPS = 1e-5

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_TOKEN = "<|im_end|>"
BOS_TOKEN = "<|im_start|>"

# ChatML, as SmolLM2 uses; no system prompt injected so token counts stay predictable.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "Hello, world! How are you today? I am fine, thank you.",
    "Chunked prefill splits a long prompt into pieces and mixes them with decodes.",
    "the quick brown fox jumps over the lazy dog 0123456789",
    "A tiny model for tests: it knows nothing, but it runs fast and deterministically.",
    "user assistant system message content role",
]


def _train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer)
    return tok


def _hf_tokenizer():
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=_train_tokenizer(),
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=None,
        pad_token=SPECIAL_TOKENS[0],
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _hf_config(vocab: int, bias: bool, rope_scaling: dict | None, tie: bool):
    from transformers import LlamaConfig, Qwen2Config

    common: dict[str, Any] = dict(
        vocab_size=vocab,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=RMS_EPS,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
    )
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": ROPE_THETA}
    if rope_scaling:
        rope = {**rope_scaling, "rope_theta": ROPE_THETA}
        rope.setdefault("rope_type", rope.get("type", "default"))
    if bias:
        cfg = Qwen2Config(**common, rope_parameters=rope, use_sliding_window=False)
    else:
        cfg = LlamaConfig(**common, rope_parameters=rope, attention_bias=False, mlp_bias=False)
    return cfg


def _random_model(cfg, seed: int):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    # Larger-than-default weights so logits are far from uniform and errors would show.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    return model.eval()


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of Q/K rows (HF rotate-half -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(path: Path, model, tok, *, bias: bool, tie: bool) -> None:
    import gguf

    arch = "qwen2" if bias else "llama"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny-" + arch)
    writer.add_context_length(MAX_POSITIONS)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(ROPE_THETA)
    writer.add_layer_norm_rms_eps(RMS_EPS)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)

    vocab = tok.backend_tokenizer.get_vocab(with_added_tokens=True)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    state = json.loads(tok.backend_tokenizer.to_str())
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["model"]["merges"]]
    types = [gguf.TokenType.CONTROL if t in SPECIAL_TOKENS else gguf.TokenType.NORMAL for t in tokens]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tok.convert_tokens_to_ids(BOS_TOKEN))
    writer.add_eos_token_id(tok.convert_tokens_to_ids(EOS_TOKEN))
    writer.add_pad_token_id(tok.convert_tokens_to_ids(SPECIAL_TOKENS[0]))
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    permute = arch == "llama"  # llama.cpp permutes Q/K for llama only (qwen2 uses NEOX-style RoPE)
    writer.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", sd["model.norm.weight"])
    if not tie:
        writer.add_tensor("output.weight", sd["lm_head.weight"])
    names = {
        "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "self_attn.o_proj.weight": "attn_output.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
        "self_attn.v_proj.weight": "attn_v.weight",
        "self_attn.v_proj.bias": "attn_v.bias",
    }
    for i in range(LAYERS):
        pre = f"model.layers.{i}."
        for hf, gg in names.items():
            if pre + hf in sd:
                writer.add_tensor(f"blk.{i}.{gg}", sd[pre + hf])
        for proj, heads in (("q", HEADS), ("k", KV_HEADS)):
            for kind in ("weight", "bias"):
                key = f"{pre}self_attn.{proj}_proj.{kind}"
                if key in sd:
                    w = _permute(sd[key], heads) if permute else sd[key]
                    writer.add_tensor(f"blk.{i}.attn_{proj}.{kind}", np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def make_tiny_llama(
    path: str | Path,
    *,
    fmt: str = "safetensors",
    bias: bool = False,
    rope_scaling: dict | None = None,
    seed: int = 0,
    tie_word_embeddings: bool = True,
) -> Path:
    """Write a tiny random Llama (Qwen2-style with `bias`) to `path`; returns the folder or the .gguf file.

    fmt="safetensors": `path` is a folder with config.json, model.safetensors and tokenizer files.
    fmt="gguf": writes `path`/tiny.gguf (tokenizer in its metadata) and returns that file.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = _hf_tokenizer()
    cfg = _hf_config(len(tok), bias, rope_scaling, tie_word_embeddings)
    model = _random_model(cfg, seed)
    if fmt == "safetensors":
        model.save_pretrained(path, safe_serialization=True)
        tok.save_pretrained(path)
        return path
    if fmt == "gguf":
        if rope_scaling:
            raise ValueError("rope_scaling is only written to safetensors checkpoints")
        out = path / "tiny.gguf"
        _write_gguf(out, model, tok, bias=bias, tie=tie_word_embeddings)
        return out
    raise ValueError(f"unknown fmt {fmt!r}: expected 'safetensors' or 'gguf'")
