"""Every runtime.toml key can be overridden on the command line (README: flags override the file)."""

from __future__ import annotations

import argparse
from dataclasses import fields

from mixserve.config import EngineConfig, ServerConfig
from mixserve.config.flags import ENGINE_FLAGS, add_engine_flags, overrides_from_args


def test_every_engine_key_has_a_flag():
    assert sorted(key for key, _ in ENGINE_FLAGS.values()) == sorted(f.name for f in fields(EngineConfig))


def test_every_server_key_has_a_serve_flag():
    from mixserve.cli import serve

    subparsers = argparse.ArgumentParser().add_subparsers()
    serve.register(subparsers)
    dests = {action.dest for action in subparsers.choices["serve"]._actions}
    # [server] key -> the dest of its flag (the seconds keys drop their _s on the command line)
    flag_for = {f.name: f.name.removesuffix("_s") for f in fields(ServerConfig)}
    assert set(flag_for.values()) <= dests


def test_the_kv_sizing_flags_override_the_file():
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    args = parser.parse_args(["--cpu-kv-cache-gib", "0.5", "--gpu-memory-utilization", "0.8"])
    assert overrides_from_args(args)["engine"] == {"cpu_kv_cache_gib": 0.5, "gpu_memory_utilization": 0.8}
