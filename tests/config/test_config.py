"""runtime.toml, its JSON schema, and the shared command-line flags."""

from __future__ import annotations

import argparse
import dataclasses
import json
import tomllib
from pathlib import Path

import pytest

from mixserve.config import (
    ConfigError,
    EngineConfig,
    RuntimeConfig,
    ServerConfig,
    add_engine_flags,
    load_config,
    overrides_from_args,
    schema,
)

ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "runtime.toml"
    path.write_text(text)
    return str(path)


def test_defaults_are_those_of_the_design() -> None:
    cfg = load_config()
    assert cfg.engine == EngineConfig(
        model="", prefill_chunk=256, max_batch_tokens=512, max_num_seqs=64, block_size=16, num_blocks=0,
        cpu_kv_cache_gib=2, gpu_memory_utilization=0.9, max_model_len=0, step_trace="",
        attention_backend="auto", cuda_graphs=True, threads=0, seed=0, device="auto", dtype="auto",
    )
    assert cfg.server == ServerConfig(host="127.0.0.1", port=8000, api_key="", max_waiting=1024)


def test_repo_runtime_toml_schema_and_dataclasses_agree() -> None:
    """runtime.toml holds every key with its default; the schema's defaults and keys are the same."""
    data = tomllib.loads((ROOT / "runtime.toml").read_text())
    props = schema()["properties"]
    for name, cls in (("engine", EngineConfig), ("server", ServerConfig)):
        defaults = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
                    for f in dataclasses.fields(cls)}
        assert data[name] == defaults
        assert {k: v["default"] for k, v in props[name]["properties"].items()} == defaults
    assert load_config(str(ROOT / "runtime.toml")) == RuntimeConfig()


def test_repo_schema_is_the_packaged_schema() -> None:
    assert json.loads((ROOT / "config" / "runtime.schema.json").read_text()) == schema()


def test_file_values_and_overrides(tmp_path: Path) -> None:
    path = write(tmp_path, "[engine]\nprefill_chunk = 64\nthreads = 2\n[server]\nport = 9000\n")
    cfg = load_config(path, {"engine": {"prefill_chunk": 16, "seed": None}, "max_waiting": 5})
    assert cfg.engine.prefill_chunk == 16  # the override wins over the file
    assert cfg.engine.threads == 2
    assert cfg.engine.seed == 0  # None = not given
    assert (cfg.server.port, cfg.server.max_waiting) == (9000, 5)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("[engine]\nprefil_chunk = 4\n", "engine.prefil_chunk: unknown key"),
        ("[engnie]\n", "engnie: unknown key"),
        ("[engine]\nprefill_chunk = \"big\"\n", "engine.prefill_chunk: must be of type integer"),
        ("[engine]\nprefill_chunk = -1\n", "engine.prefill_chunk: must be >= 0"),
        ("[engine]\nmax_batch_tokens = 0\n", "engine.max_batch_tokens: must be >= 1"),
        ("[engine]\ngpu_memory_utilization = 1.5\n", "engine.gpu_memory_utilization: must be <= 1"),
        ("[engine]\ndtype = \"fp8\"\n", "engine.dtype: must be one of"),
        ("[engine]\nthreads = true\n", "engine.threads: must be of type integer"),
        ("[server]\nport = 70000\n", "server.port: must be <= 65535"),
        ("[engine\n", "not valid TOML"),
    ],
)
def test_bad_file_is_one_line_naming_key_and_rule(tmp_path: Path, text: str, needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, text))
    assert needle in str(err.value)
    assert "\n" not in str(err.value)


def test_missing_file_and_bad_override() -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        load_config("/nonexistent/runtime.toml")
    with pytest.raises(ConfigError, match="max_num_seqs: must be >= 1"):
        load_config(None, {"max_num_seqs": 0})
    with pytest.raises(ConfigError, match="nope: unknown configuration key"):
        load_config(None, {"nope": 1})
    assert issubclass(ConfigError, ValueError)


def test_flags_override_the_file(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    path = write(tmp_path, "[engine]\nprefill_chunk = 64\nblock_size = 32\n")
    args = parser.parse_args(["--config", path, "--prefill-chunk", "0", "--dtype", "bfloat16"])
    cfg = load_config(args.config, overrides_from_args(args))
    assert (cfg.engine.prefill_chunk, cfg.engine.block_size, cfg.engine.dtype) == (0, 32, "bfloat16")
    with pytest.raises(ConfigError, match="--max-num-seqs: must be an integer, got 'x'"):
        overrides_from_args(parser.parse_args(["--max-num-seqs", "x"]))
    off = overrides_from_args(parser.parse_args(["--cuda-graphs", "off"]))
    assert load_config(None, off).engine.cuda_graphs is False
    on = overrides_from_args(parser.parse_args(["--cuda-graphs", "ON"]))
    assert load_config(None, on).engine.cuda_graphs is True
    with pytest.raises(ConfigError, match="--cuda-graphs: must be on or off, got 'maybe'"):
        overrides_from_args(parser.parse_args(["--cuda-graphs", "maybe"]))
    with pytest.raises(ConfigError, match="engine.cuda_graphs: must be of type boolean, got 'yes'"):
        load_config(write(tmp_path, '[engine]\ncuda_graphs = "yes"\n'))
