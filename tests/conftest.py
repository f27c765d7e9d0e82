"""Shared fixtures: tiny random checkpoints written once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Without CUDA, Triton kernels (mixserve/kernels) run on CPU tensors through Triton's interpreter; it is
# read when a kernel is decorated, so it must be set before any kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.tiny_model import make_tiny_llama


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama as a Hugging Face folder (config.json, model.safetensors, tokenizer files)."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def tiny_gguf_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same kind of tiny random Llama as one GGUF file (F32 tensors, tokenizer in the metadata)."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_gguf"), fmt="gguf")


@pytest.fixture(scope="session")
def default_runner():
    """The default model (SmolLM2-135M-Instruct Q4_1) in a ModelRunner: fp32 on the CPU, 4-token blocks."""
    from mixserve import ModelRunner

    return ModelRunner.from_pretrained(None, num_blocks=512, block_size=4, device="cpu")


@pytest.fixture(scope="session")
def hf_default_model():
    """HF transformers' own model on the default GGUF (the slow part of the default-model tests)."""
    from transformers import AutoModelForCausalLM

    from mixserve.model.loader import default_model_path

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.eval()
