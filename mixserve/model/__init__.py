"""The model: config, the decoder every family runs (model/families), attention, loaders, tokenizer."""

from __future__ import annotations

from mixserve.model.config import ModelConfig
from mixserve.model.decoder import DecoderModel, LlamaModel
from mixserve.model.errors import ModelLoadError
from mixserve.model.loader import LoadedModel, default_model_path, load_model
from mixserve.model.tokenizer import Tokenizer

__all__ = ["DecoderModel", "LlamaModel", "LoadedModel", "ModelConfig", "ModelLoadError", "Tokenizer",
           "default_model_path", "load_model"]
