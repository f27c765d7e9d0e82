"""A bad checkpoint is one clear line naming the path and the problem, never a traceback."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest

from mixserve import ModelRunner
from mixserve.model.errors import ModelLoadError
from mixserve.model.loader import load_weights, resolve_model_path


def load(path: Path | str) -> None:
    ModelRunner.from_pretrained(str(path), num_blocks=4)


def assert_one_line(err: pytest.ExceptionInfo, *fragments: str) -> None:
    msg = str(err.value)
    assert "\n" not in msg
    for f in fragments:
        assert f in msg, msg


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError) as e:
        load(tmp_path / "nope.gguf")
    assert_one_line(e, str(tmp_path / "nope.gguf"), "no such file")


def test_folder_without_a_model(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError) as e:
        load(tmp_path)
    assert_one_line(e, str(tmp_path), "config.json")


def test_not_a_gguf_file(tmp_path: Path) -> None:
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x" * 100)
    with pytest.raises(ModelLoadError) as e:
        load(f)
    assert_one_line(e, str(f), ".gguf")


def test_corrupt_gguf_garbage(tmp_path: Path) -> None:
    f = tmp_path / "garbage.gguf"
    f.write_bytes(b"\x00\x01garbage" * 50)
    with pytest.raises(ModelLoadError) as e:
        load(f)
    assert_one_line(e, str(f), "not a valid GGUF file")


def test_truncated_gguf(tiny_gguf_path: Path, tmp_path: Path) -> None:
    f = tmp_path / "cut.gguf"
    f.write_bytes(tiny_gguf_path.read_bytes()[: tiny_gguf_path.stat().st_size // 2])
    with pytest.raises(ModelLoadError) as e:
        load(f)
    assert_one_line(e, str(f), "not a valid GGUF file")


def _retype_tensor(src: Path, dst: Path, name: str, ggml_type: int) -> None:
    """Copy a GGUF, rewriting the ggml type id in one tensor's header entry."""
    blob = bytearray(src.read_bytes())
    key = struct.pack("<Q", len(name)) + name.encode()
    at = blob.index(key) + len(key)
    (ndims,) = struct.unpack_from("<I", blob, at)
    struct.pack_into("<I", blob, at + 4 + 8 * ndims, ggml_type)
    dst.write_bytes(bytes(blob))


def test_unsupported_quant_type(tiny_gguf_path: Path, tmp_path: Path) -> None:
    f = tmp_path / "q81.gguf"
    _retype_tensor(tiny_gguf_path, f, "blk.0.ffn_up.weight", 9)  # Q8_1: gguf cannot dequantize it
    with pytest.raises(ModelLoadError) as e:
        load_weights(f)
    assert_one_line(e, str(f), "blk.0.ffn_up.weight", "unsupported quantization type Q8_1")


def test_unknown_ggml_type(tiny_gguf_path: Path, tmp_path: Path) -> None:
    f = tmp_path / "q999.gguf"
    _retype_tensor(tiny_gguf_path, f, "blk.0.ffn_up.weight", 999)
    with pytest.raises(ModelLoadError) as e:
        load_weights(f)
    assert_one_line(e, str(f), "unknown ggml type 999")


def _copy_with_config(tiny_model_dir: Path, tmp_path: Path, **changes) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_unsupported_architecture(tiny_model_dir: Path, tmp_path: Path) -> None:
    folder = _copy_with_config(tiny_model_dir, tmp_path, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ModelLoadError) as e:
        load(folder)
    assert_one_line(e, str(folder / "config.json"), "unsupported architecture", "GPT2LMHeadModel")


def test_unsupported_rope_scaling(tiny_model_dir: Path, tmp_path: Path) -> None:
    folder = _copy_with_config(
        tiny_model_dir, tmp_path, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}
    )
    with pytest.raises(ModelLoadError) as e:
        load(folder)
    assert_one_line(e, "unsupported rope scaling type 'yarn'")


def test_shape_mismatch_names_the_weight(tiny_model_dir: Path, tmp_path: Path) -> None:
    folder = _copy_with_config(tiny_model_dir, tmp_path, intermediate_size=96)
    with pytest.raises(ModelLoadError) as e:
        load(folder)
    assert_one_line(e, str(folder), "gate_up_proj.weight", "shape")


def test_no_weights_in_folder(tiny_model_dir: Path, tmp_path: Path) -> None:
    folder = _copy_with_config(tiny_model_dir, tmp_path)
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError) as e:
        load(folder)
    assert_one_line(e, str(folder), "no *.safetensors")


def test_folder_with_one_gguf_resolves_to_it(tiny_gguf_path: Path) -> None:
    assert resolve_model_path(tiny_gguf_path.parent) == tiny_gguf_path


def test_model_load_error_is_a_value_error() -> None:
    assert issubclass(ModelLoadError, ValueError)
