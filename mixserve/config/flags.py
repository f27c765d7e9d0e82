"""The engine flags every subcommand shares (`--prefill-chunk`, ...): they override runtime.toml."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from mixserve.config.loader import ConfigError, load_config
from mixserve.config.runtime_config import RuntimeConfig


def on_off(raw: str) -> bool:
    """A boolean flag value: on/off, true/false, yes/no or 1/0."""
    value = {"on": True, "true": True, "yes": True, "1": True,
             "off": False, "false": False, "no": False, "0": False}.get(raw.strip().lower())
    if value is None:
        raise ValueError(raw)
    return value

# flag -> ([engine] key, parser of the raw string). Values are parsed here, not by argparse, so a bad
# value becomes one ConfigError line (exit code 2) instead of argparse's usage block.
ENGINE_FLAGS: dict[str, tuple[str, Callable[[str], Any]]] = {
    "--model": ("model", str),
    "--prefill-chunk": ("prefill_chunk", int),
    "--max-batch-tokens": ("max_batch_tokens", int),
    "--max-num-seqs": ("max_num_seqs", int),
    "--block-size": ("block_size", int),
    "--num-blocks": ("num_blocks", int),
    "--cpu-kv-cache-gib": ("cpu_kv_cache_gib", float),
    "--gpu-memory-utilization": ("gpu_memory_utilization", float),
    "--max-model-len": ("max_model_len", int),
    "--enable-prefix-caching": ("enable_prefix_caching", on_off),
    "--step-trace": ("step_trace", str),
    "--tpot-target-ms": ("tpot_target_ms", float),
    "--waiting-share": ("waiting_share", float),
    "--slo-ttft-ms": ("slo_ttft_ms", float),
    "--slo-tpot-ms": ("slo_tpot_ms", float),
    "--max-partial-prefills": ("max_partial_prefills", int),
    "--long-prefill-threshold": ("long_prefill_threshold", int),
    "--max-long-partial-prefills": ("max_long_partial_prefills", int),
    "--cost-model": ("cost_model", str),
    "--attention-backend": ("attention_backend", str),
    "--cuda-graphs": ("cuda_graphs", on_off),
    "--threads": ("threads", int),
    "--tensor-parallel-size": ("tensor_parallel_size", int),
    "--device": ("device", str),
    "--dtype": ("dtype", str),
    "--quantization": ("quantization", str),
    "--int8-activations": ("int8_activations", on_off),
    "--speculative": ("speculative", str),
    "--num-speculative-tokens": ("num_speculative_tokens", int),
    "--seed": ("seed", int),
}


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """Add `--config FILE` and one flag per [engine] key; unset flags keep the file's values."""
    parser.add_argument("--config", metavar="FILE", default=None, help="runtime.toml to read")
    group = parser.add_argument_group("engine (override the [engine] table of --config)")
    for flag, (key, kind) in ENGINE_FLAGS.items():
        metavar = {int: "INT", float: "NUMBER", on_off: "on|off"}.get(kind, "STR")
        group.add_argument(flag, dest=f"engine_{key}", metavar=metavar,
                           default=None, help=f"[engine].{key}")


def overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The nested overrides (`{"engine": {...}}`) given on the command line; raises ConfigError."""
    engine: dict[str, Any] = {}
    for flag, (key, kind) in ENGINE_FLAGS.items():
        raw = getattr(args, f"engine_{key}", None)
        if raw is None:
            continue
        try:
            engine[key] = kind(raw)
        except ValueError:
            expected = {on_off: "on or off", float: "a number"}.get(kind, "an integer")
            raise ConfigError(f"{flag}: must be {expected}, got {raw!r}") from None
    return {"engine": engine}


def config_from_args(args: argparse.Namespace) -> RuntimeConfig:
    """`load_config(args.config, overrides_from_args(args))`: what a subcommand starts from."""
    return load_config(getattr(args, "config", None), overrides_from_args(args))
