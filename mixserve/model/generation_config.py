"""The checkpoint's own sampling defaults (generation_config.json, or a GGUF's general.sampling.* keys):
what a request that leaves temperature, top_p, top_k, min_p or repetition_penalty unset gets, as the
model's authors tuned it (vLLM's --generation-config auto does the same)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# generation_config.json key -> SamplingParams field
_HF_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
            "repetition_penalty": "repetition_penalty"}
_GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
              "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
              "general.sampling.penalty_repeat": "repetition_penalty"}


def sampling_defaults(path: Path | None) -> dict[str, Any]:
    """SamplingParams fields the checkpoint at `path` sets; {} when it sets none or cannot be read."""
    if path is None:
        return {}
    if path.is_dir():
        try:
            raw = json.loads((path / "generation_config.json").read_text())
        except (OSError, json.JSONDecodeError):
            return {}
        if not isinstance(raw, dict) or raw.get("do_sample") is False:
            return {}  # greedy by the authors' word: the server's own defaults hold
        keys = _HF_KEYS
    else:
        from mixserve.model.errors import ModelLoadError
        from mixserve.model.gguf_file import read_gguf

        try:
            raw, keys = read_gguf(path)[0], _GGUF_KEYS  # maps the file; reads only the metadata
        except ModelLoadError:
            return {}
    out: dict[str, Any] = {}
    for key, name in keys.items():
        value = raw.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[name] = int(value) if name == "top_k" else float(value)
    return out
