"""Read a Hugging Face model folder: config.json and safetensors weights (one file or sharded)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mixserve.model.config import ModelConfig
from mixserve.model.errors import ModelLoadError


def read_config(folder: Path) -> ModelConfig:
    """ModelConfig of folder/config.json."""
    path = folder / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"{path}: file not found") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: cannot be read as JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return ModelConfig.from_hf(raw, str(path))


def generation_eos_ids(folder: Path) -> tuple[int, ...]:
    """End-of-sequence ids from generation_config.json (Llama 3 lists several), or () if none."""
    try:
        eos = json.loads((folder / "generation_config.json").read_text()).get("eos_token_id")
    except (OSError, json.JSONDecodeError, AttributeError):
        return ()
    if isinstance(eos, int):
        return (eos,)
    return tuple(int(e) for e in eos) if isinstance(eos, list) else ()


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files holding the weights: the index's shards, or every *.safetensors."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, json.JSONDecodeError, KeyError, AttributeError) as e:
            raise ModelLoadError(f"{index}: not a valid safetensors index ({e})") from None
        files = [folder / s for s in shards]
        for f in files:
            if not f.exists():
                raise ModelLoadError(f"{f}: shard named in {index.name} not found")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no *.safetensors weights in the folder")
    return files


def load_hf_folder(folder: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(config, HF-named state dict) of a model folder; tensors keep their stored dtype."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    cfg = read_config(folder)
    sd: dict[str, torch.Tensor] = {}
    for f in weight_files(folder):
        try:
            sd.update(load_file(str(f)))
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"{f}: not a readable safetensors file ({e})") from None
    from mixserve.model.families import hf_names

    sd = hf_names(sd, cfg)
    # Checkpoints that tie embeddings may still ship lm_head; ones that don't tie must ship it.
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    return cfg, sd
