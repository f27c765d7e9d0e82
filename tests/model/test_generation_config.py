"""The checkpoint's sampling defaults: read from generation_config.json or GGUF metadata, and applied by the
server only to the fields a request leaves unset."""

from __future__ import annotations

import json
from pathlib import Path

from mixserve.engine.served_model import ServedModel
from mixserve.model.generation_config import sampling_defaults
from mixserve.server.preprocess import sampling_params
from mixserve.server.protocol import ChatCompletionRequest

QWEN3_STYLE = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "eos_token_id": [2, 3]}


def test_a_folder_gives_its_generation_config(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps(QWEN3_STYLE))
    assert sampling_defaults(tmp_path) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}


def test_greedy_or_missing_generation_config_sets_nothing(tmp_path: Path) -> None:
    assert sampling_defaults(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({**QWEN3_STYLE, "do_sample": False}))
    assert sampling_defaults(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text("{not json")
    assert sampling_defaults(tmp_path) == {}


def test_a_gguf_file_gives_its_sampling_keys(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_float32("general.sampling.temp", 0.7)
    writer.add_int32("general.sampling.top_k", 40)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    got = sampling_defaults(path)
    assert set(got) == {"temperature", "top_k"}
    assert got["top_k"] == 40 and abs(got["temperature"] - 0.7) < 1e-6


def _served(defaults: dict) -> ServedModel:
    return ServedModel("m", None, 1000, lambda ids, p: None, defaults)


def test_the_server_fills_only_what_the_request_leaves_unset() -> None:
    model = _served({"temperature": 0.6, "top_k": 20})
    unset = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    p = sampling_params(model, unset, 5, max_tokens=None, default_max_tokens=None, num_logprobs=None)
    assert (p.temperature, p.top_k) == (0.6, 20)
    greedy = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], temperature=0)
    p = sampling_params(model, greedy, 5, max_tokens=None, default_max_tokens=None, num_logprobs=None)
    assert (p.temperature, p.top_k) == (0.0, 20)
    plain = sampling_params(_served({}), unset, 5, max_tokens=None, default_max_tokens=None,
                            num_logprobs=None)
    assert plain.temperature == 1.0 and plain.top_k == 0
