"""The one error a model load raises for bad input: a ValueError whose message is one line."""

from __future__ import annotations


class ModelLoadError(ValueError):
    """A checkpoint cannot be loaded: missing file, unsupported architecture or quant type, corrupt file."""
