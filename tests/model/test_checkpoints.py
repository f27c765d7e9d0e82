"""Checkpoint formats: sharded safetensors, GGUF vs safetensors of the same weights, tokenizer, names."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from mixserve import ModelRunner
from mixserve.core.batch import ForwardBatch, ForwardSeq
from mixserve.model.gguf_loader import unpermute_qk
from mixserve.model.loader import model_name
from tests.tiny_model import _permute, make_tiny_llama

BATCH = ForwardBatch([ForwardSeq("a", list(range(3, 40)), 0, list(range(10))),
                      ForwardSeq("b", list(range(50, 55)), 0, list(range(10, 20)))])


def test_sharded_safetensors_equal_single_file(tiny_model_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "sharded"
    folder.mkdir()
    for f in tiny_model_dir.iterdir():
        if f.name != "model.safetensors":
            (folder / f.name).write_bytes(f.read_bytes())
    sd = load_file(str(tiny_model_dir / "model.safetensors"))
    names = sorted(sd)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for shard, keys in shards.items():
        save_file({k: sd[k] for k in keys}, str(folder / shard))
        weight_map.update(dict.fromkeys(keys, shard))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    a = ModelRunner.from_pretrained(str(tiny_model_dir), num_blocks=32).forward(BATCH)
    b = ModelRunner.from_pretrained(str(folder), num_blocks=32).forward(BATCH)
    assert torch.equal(a, b)


def test_gguf_and_safetensors_of_the_same_weights_agree(tmp_path: Path) -> None:
    st = make_tiny_llama(tmp_path / "st", seed=7)
    gg = make_tiny_llama(tmp_path / "gg", fmt="gguf", seed=7)
    a = ModelRunner.from_pretrained(str(st), num_blocks=32).forward(BATCH)
    b = ModelRunner.from_pretrained(str(gg), num_blocks=32).forward(BATCH)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    w = torch.randn(4 * 16, 24)
    assert torch.equal(unpermute_qk(torch.from_numpy(_permute(w.numpy(), 4)), 4), w)


def test_gguf_tokenizer_equals_folder_tokenizer(tiny_model_dir: Path, tiny_gguf_path: Path) -> None:
    a = ModelRunner.from_pretrained(str(tiny_model_dir), num_blocks=1).tokenizer
    b = ModelRunner.from_pretrained(str(tiny_gguf_path), num_blocks=1).tokenizer
    text = "Hello, world! The capital of France is Paris."
    assert a.encode(text) == b.encode(text)
    chat = [{"role": "user", "content": "Hello"}]
    assert a.apply_chat_template(chat) == b.apply_chat_template(chat)
    assert a.eos_token_ids == b.eos_token_ids


def test_tokenizer_round_trip_and_chat_template(tiny_model_dir: Path) -> None:
    tok = ModelRunner.from_pretrained(str(tiny_model_dir), num_blocks=1).tokenizer
    text = "the quick brown fox, 42 times!"
    assert tok.decode(tok.encode(text)) == text
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert tok.decode(ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    no_prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=False)
    assert ids[: len(no_prompt)] == no_prompt and len(ids) > len(no_prompt)
    assert tok.eos_token_ids == {tok.hf.convert_tokens_to_ids("<|im_end|>")}


def test_model_names() -> None:
    assert model_name(Path("/x/SmolLM2-135M-Instruct.Q4_1.gguf")) == "SmolLM2-135M-Instruct"
    assert model_name(Path("/x/Llama-3.2-1B-Instruct-Q8_0.gguf")) == "Llama-3.2-1B-Instruct"
    assert model_name(Path("/x/tiny.gguf")) == "tiny"


def test_generation_config_eos_ids_count_as_eos(tiny_model_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    for f in tiny_model_dir.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    tok = ModelRunner.from_pretrained(str(folder), num_blocks=1).tokenizer
    assert tok.eos_token_ids == {0, 2}
