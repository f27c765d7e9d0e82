"""Attention backends behind one interface; `get_backend(name, device)` picks one by name."""

from __future__ import annotations

import importlib

import torch

from mixserve.model.attention.base import AttentionBackend, AttentionMetadata, build_metadata

__all__ = ["AttentionBackend", "AttentionMetadata", "BACKENDS", "build_metadata", "get_backend"]

# name -> "module:Class", imported only when asked for (the GPU backend needs a recent torch on CUDA).
BACKENDS: dict[str, str] = {
    "torch": "mixserve.model.attention.torch_ref:TorchAttention",
    "flex": "mixserve.model.attention.flex:FlexAttentionBackend",
}


def _load(name: str) -> type[AttentionBackend]:
    module, _, cls = BACKENDS[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def get_backend(name: str, device: torch.device | str) -> AttentionBackend:
    """An attention backend by name: "auto" (flex on CUDA when it imports, else torch), "torch", "flex"."""
    device = torch.device(device)
    if name == "auto":
        if device.type == "cuda":
            try:
                return _load("flex")()
            except ImportError:
                pass
        return _load("torch")()
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of: auto, {', '.join(BACKENDS)}")
    try:
        return _load(name)()
    except ImportError as e:
        raise ValueError(f"attention backend {name!r} is not available here: {e}") from None
