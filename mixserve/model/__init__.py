"""The Llama-family model: config, module, attention backends, checkpoint loaders and tokenizer."""

from __future__ import annotations

from mixserve.model.config import ModelConfig
from mixserve.model.errors import ModelLoadError
from mixserve.model.llama import LlamaModel
from mixserve.model.loader import LoadedModel, default_model_path, load_model
from mixserve.model.tokenizer import Tokenizer

__all__ = ["LlamaModel", "LoadedModel", "ModelConfig", "ModelLoadError", "Tokenizer", "default_model_path",
           "load_model"]
