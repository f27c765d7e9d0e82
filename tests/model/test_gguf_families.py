"""GGUF files of every family llama.cpp converts, laid out as its convert_hf_to_gguf.py writes them
(tests/gguf_writer.py): the same config and logits as the HF folder they came from, and transformers' own
forward on that folder; the tokenizer, chat template and EOS ids from the metadata."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from mixserve import ModelRunner
from mixserve.core.batch import ForwardBatch, ForwardSeq
from mixserve.model.config import ModelConfig
from mixserve.model.errors import ModelLoadError
from mixserve.model.gguf_file import read_gguf
from mixserve.model.loader import load_weights
from tests.gguf_writer import FAMILIES, ORIGINAL_CONTEXT, make_hf_folder, write_gguf

TOL_HF = 2e-3  # of the largest |logit| per row, as the other HF comparisons take it
# the family a GGUF file loads as (llama.cpp writes Mistral as plain llama); else the same name
FAMILY_OF = {"mistral": "llama", "phi3-longrope": "phi3", "qwen3moe": "qwen3_moe"}
# what a GGUF file must say as its HF folder does (norm_offset differs: the file's norms hold 1 + w)
SAME_FIELDS = ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
               "rope_theta", "qkv_bias", "tie_word_embeddings", "qk_norm", "embed_scale", "activation",
               "sandwich_norm", "attn_scale", "attn_softcap", "final_softcap", "layer_windows",
               "local_rope_theta")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """family -> (HF folder, the GGUF file llama.cpp's converter would write of it)."""
    root = tmp_path_factory.mktemp("gguf_families")
    out = {}
    for i, family in enumerate(FAMILIES):
        folder = make_hf_folder(root / family / "hf", family, seed=i + 31)
        out[family] = folder, write_gguf(folder, root / family / "gguf" / "model.gguf")
    return out


def prefixes(prompt: list[int], lengths: tuple[int, ...]) -> ForwardBatch:
    """One sequence per prefix length, each in its own blocks: the logits after each prefix."""
    return ForwardBatch([ForwardSeq(f"p{n}", prompt[:n], 0, list(range(32 * i, 32 * i + 32)))
                         for i, n in enumerate(lengths)])


def logits(path: Path, batch: ForwardBatch) -> tuple[ModelConfig, torch.Tensor]:
    runner = ModelRunner.from_pretrained(str(path), num_blocks=32 * len(batch.seqs), block_size=4)
    return runner.config, runner.forward(batch)


def prompt_of(n: int, vocab: int, seed: int = 2) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_the_gguf_config_says_what_the_hf_config_says(checkpoints, family: str) -> None:
    hf, gg = (load_weights(p)[0] for p in checkpoints[family])
    assert gg.family == FAMILY_OF.get(family, family)
    assert {f: getattr(gg, f) for f in SAME_FIELDS} == {f: getattr(hf, f) for f in SAME_FIELDS}
    assert gg.rms_norm_eps == pytest.approx(hf.rms_norm_eps)
    assert [gg.sparse(i) for i in range(gg.num_layers)] == [hf.sparse(i) for i in range(hf.num_layers)]
    if hf.moe is not None:
        assert (gg.moe.num_experts, gg.moe.top_k, gg.moe.intermediate_size, gg.moe.norm_topk_prob) == (
            hf.moe.num_experts, hf.moe.top_k, hf.moe.intermediate_size, hf.moe.norm_topk_prob)
    s, t = gg.rope_scaling, hf.rope_scaling
    assert (s.rope_type, s.factor, s.short_factor, s.long_factor) == (t.rope_type, t.factor, t.short_factor,
                                                                      t.long_factor)
    assert s.attention_factor == pytest.approx(t.attention_factor)


@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_logits_equal_the_hf_folder_and_transformers(checkpoints, family: str) -> None:
    from transformers import AutoModelForCausalLM

    folder, gguf_file = checkpoints[family]
    cfg, ours = logits(gguf_file, prefixes(prompt := prompt_of(20, 320), lengths := (5, 11, 16, 20)))
    _, from_folder = logits(folder, prefixes(prompt, lengths))
    torch.testing.assert_close(ours, from_folder, atol=1e-4, rtol=0)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    for row, n in zip(ours, lengths, strict=True):
        assert float((row - ref[n - 1]).abs().max() / ref[n - 1].abs().max()) < TOL_HF, n


def test_phi3_long_factors_past_the_original_context(checkpoints) -> None:
    # transformers switches the whole forward to the long factors past the original context, mixserve (as
    # vLLM) switches per position: there the GGUF file and its folder must agree with each other.
    folder, gguf_file = checkpoints["phi3-longrope"]
    batch = prefixes(prompt_of(80, 320), (ORIGINAL_CONTEXT - 10, ORIGINAL_CONTEXT + 5, 80))
    torch.testing.assert_close(logits(gguf_file, batch)[1], logits(folder, batch)[1], atol=1e-4, rtol=0)


def test_f16_tensors_as_the_converter_writes_them(tmp_path: Path) -> None:
    folder = make_hf_folder(tmp_path / "hf", "gemma3", seed=5, f16=True)
    gguf_file = write_gguf(folder, tmp_path / "gguf" / "model-f16.gguf", f16=True)
    _, tensors = read_gguf(gguf_file)
    assert tensors["blk.0.attn_q.weight"].ggml_type == 1 and tensors["token_embd.weight"].ggml_type == 1
    assert tensors["blk.0.attn_q_norm.weight"].ggml_type == 0  # 1D tensors stay F32
    batch = prefixes(prompt_of(20, 320), (7, 20))
    torch.testing.assert_close(logits(gguf_file, batch)[1], logits(folder, batch)[1], atol=1e-4, rtol=0)


def test_the_tokenizer_chat_template_and_eos_come_from_the_metadata(checkpoints, tmp_path: Path) -> None:
    folder, gguf_file = checkpoints["qwen3"]
    a = ModelRunner.from_pretrained(str(folder), num_blocks=1).tokenizer
    b = ModelRunner.from_pretrained(str(gguf_file), num_blocks=1).tokenizer
    chat = [{"role": "user", "content": "Hello, world!"}]
    assert b.render_chat(chat) == a.render_chat(chat)
    assert b.apply_chat_template(chat) == a.apply_chat_template(chat)
    assert b.encode("The capital of France is Paris.") == a.encode("The capital of France is Paris.")
    assert b.eos_token_ids == a.eos_token_ids == {b.hf.convert_tokens_to_ids("<|im_end|>")}
    # A base model's eos (<|endoftext|>): the turn end its chat template writes stops generation too.
    base = write_gguf(folder, tmp_path / "base" / "model.gguf", eos_token="<|endoftext|>")
    tok = ModelRunner.from_pretrained(str(base), num_blocks=1).tokenizer
    assert tok.eos_token_ids == {tok.hf.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>")}


def test_an_unsupported_gguf_architecture_names_the_supported_ones(tmp_path: Path) -> None:
    import gguf
    import numpy as np

    path = tmp_path / "falcon.gguf"
    w = gguf.GGUFWriter(str(path), "falcon")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError) as e:
        load_weights(path)
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg
    supported = "llama, mistral, qwen2, qwen3, gemma2, gemma3, phi3, qwen3moe"
    assert f"unsupported architecture 'falcon'; supported: {supported}" in msg


def gemma_meta(arch: str, layers: int, **keys: object) -> dict[str, object]:
    """GGUF metadata of a Gemma with head_dim 256 apart from hidden / heads (3072 / 16 = 192)."""
    base = {"embedding_length": 3072, "feed_forward_length": 8192, "block_count": layers,
            "context_length": 8192, "attention.head_count": 16, "attention.head_count_kv": 8,
            "attention.key_length": 256, "attention.layer_norm_rms_epsilon": 1e-6}
    return {"general.architecture": arch, **{f"{arch}.{k}": v for k, v in {**base, **keys}.items()}}


def test_gemma_without_the_keys_takes_what_llama_cpp_assumes() -> None:
    g2 = ModelConfig.from_gguf(gemma_meta("gemma2", 42), "x.gguf", vocab_size=256, tied=True)
    assert (g2.attn_softcap, g2.final_softcap, g2.norm_offset) == (50.0, 30.0, 0.0)
    assert g2.layer_windows == tuple(4096 if i % 2 == 0 else 0 for i in range(42))
    assert g2.attn_scale == 256 ** -0.5 and g2.embed_scale == math.sqrt(3072)
    big = ModelConfig.from_gguf(gemma_meta("gemma2", 46), "x.gguf", vocab_size=256, tied=True)
    assert big.attn_scale == 192 ** -0.5  # the 27B's query_pre_attn_scalar is hidden / heads
    g3 = ModelConfig.from_gguf(gemma_meta("gemma3", 12, **{"attention.sliding_window": 512}), "x.gguf",
                               vocab_size=256, tied=True)
    assert g3.layer_windows == tuple(0 if i % 6 == 5 else 512 for i in range(12))
    assert (g3.local_rope_theta, g3.final_softcap, g3.attn_softcap, g3.qk_norm) == (10000.0, 0.0, 0.0, True)
    full = ModelConfig.from_gguf(gemma_meta("gemma3", 12), "x.gguf", vocab_size=256, tied=True)
    assert full.layer_windows == () and full.local_rope_theta is None
