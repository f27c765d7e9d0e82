"""The model registry: one Family per module, chosen by config.json's `architectures` or GGUF's
`general.architecture`. To add a family: a module with its Family (what differs from Llama), listed below."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from mixserve.model.config import ModelConfig
from mixserve.model.errors import ModelLoadError
from mixserve.model.families.base import Family, StateDict, common_hf_fields
from mixserve.model.families.gemma import GEMMA2, GEMMA3, text_config
from mixserve.model.families.llama import LLAMA, MISTRAL, QWEN2
from mixserve.model.families.moe import MIXTRAL, QWEN3_MOE
from mixserve.model.families.phi3 import PHI3
from mixserve.model.families.qwen3 import QWEN3

FAMILIES: tuple[Family, ...] = (LLAMA, MISTRAL, QWEN2, QWEN3, GEMMA2, GEMMA3, PHI3, QWEN3_MOE, MIXTRAL)
_BY_HF = {arch: f for f in FAMILIES for arch in f.hf_architectures}
_BY_NAME = {f.name: f for f in FAMILIES}

__all__ = ["FAMILIES", "Family", "config_from_gguf", "config_from_hf", "family_of", "hf_names"]


def hf_architectures() -> list[str]:
    return list(_BY_HF)


def family_of(cfg: ModelConfig) -> Family:
    return _BY_NAME[cfg.family]


def config_from_hf(raw: dict[str, Any], where: str = "config.json") -> ModelConfig:
    """ModelConfig of a parsed config.json; a one-line ModelLoadError for an architecture not listed."""
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in _BY_HF), None)
    if arch is None:
        raise ModelLoadError(f"{where}: unsupported architecture {archs or raw.get('model_type')!r}; "
                             f"supported: {', '.join(_BY_HF)}")
    family = _BY_HF[arch]
    raw = text_config(raw)
    try:
        fields = {**common_hf_fields(raw, where, family, arch), **family.hf_config(raw, where)}
        return ModelConfig(**fields)
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, ModelLoadError):
            raise
        raise ModelLoadError(f"{where}: missing or bad key {e}") from None


def hf_names(sd: StateDict, cfg: ModelConfig) -> StateDict:
    """A loaded HF state dict under the names the decoder loads (Llama's, plus its extras)."""
    return family_of(cfg).hf_names(sd, cfg)


def config_from_gguf(meta: dict[str, Any], where: str, *, vocab_size: int, tied: bool) -> ModelConfig:
    """ModelConfig of GGUF key/values (`meta`); `where` names the file in errors."""
    from mixserve.model.families.gguf_config import gguf_fields

    arch = meta.get("general.architecture")
    family = next((f for f in FAMILIES if arch in f.gguf_architectures), None)
    if family is None:
        names = [a for f in FAMILIES for a in f.gguf_architectures]
        raise ModelLoadError(f"{where}: unsupported architecture {arch!r}; supported: {', '.join(names)}")
    fields = gguf_fields(meta, where, family, vocab_size=vocab_size, tied=tied)
    return replace(ModelConfig(**fields), **family.gguf_config(meta, where))
