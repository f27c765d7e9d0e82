"""Shared fixtures: tiny random checkpoints written once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tiny_model import make_tiny_llama


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama as a Hugging Face folder (config.json, model.safetensors, tokenizer files)."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def tiny_gguf_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same kind of tiny random Llama as one GGUF file (F32 tensors, tokenizer in the metadata)."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_gguf"), fmt="gguf")
