"""Attention backends behind one interface; `get_backend(name, device)` picks one by name."""

from __future__ import annotations

import importlib
import logging

import torch

from mixserve.model.attention.base import AttentionBackend, AttentionMetadata, build_metadata

__all__ = ["AttentionBackend", "AttentionMetadata", "BACKENDS", "build_metadata", "get_backend"]

# name -> "module:Class", imported only when asked for (the GPU backend needs a recent torch on CUDA).
BACKENDS: dict[str, str] = {
    "torch": "mixserve.model.attention.torch_ref:TorchAttention",
    "gpu": "mixserve.model.attention.gpu:GpuAttention",
    "cpu": "mixserve.model.attention.cpu_paged:CpuPagedAttention",
}
# Older names users may have in a runtime.toml: "flex" was the GPU backend's name while FlexAttention was
# its only packed kernel.
ALIASES: dict[str, str] = {"flex": "gpu"}
log = logging.getLogger("mixserve")


def _load(name: str) -> type[AttentionBackend]:
    module, _, cls = BACKENDS[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def get_backend(name: str, device: torch.device | str, dtype: torch.dtype | None = None) -> AttentionBackend:
    """An attention backend by name: "auto", "torch", "gpu" (alias "flex") or "cpu".

    "auto" is gpu on CUDA (when it imports); on the CPU it is the C++ paged kernel ("cpu") for float32
    and bfloat16, built on first use — where it cannot be built (no compiler), torch with one warning."""
    device = torch.device(device)
    if name == "auto":
        if device.type == "cuda":
            try:
                return _load("gpu")()
            except ImportError:
                pass
        elif dtype in (None, torch.float32, torch.bfloat16):
            from mixserve.model.cpu.build import KernelBuildError

            try:
                return _load("cpu")()
            except KernelBuildError as e:
                log.warning("CPU attention kernel unavailable (%s): using the slower torch backend", e)
        return _load("torch")()
    name = ALIASES.get(name, name)
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of: auto, {', '.join(BACKENDS)}, "
                         f"{', '.join(ALIASES)}")
    try:
        return _load(name)()
    except ImportError as e:
        raise ValueError(f"attention backend {name!r} is not available here: {e}") from None
