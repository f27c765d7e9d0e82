"""The runner: ForwardBatch -> tensors -> model -> logits, over a paged KV cache."""

from __future__ import annotations

__all__ = ["ModelRunner"]


def __getattr__(name: str):
    # Lazy, so importing mixserve.runner.sampler does not load transformers.
    if name == "ModelRunner":
        from mixserve.runner.model_runner import ModelRunner

        return ModelRunner
    raise AttributeError(f"module 'mixserve.runner' has no attribute {name!r}")
