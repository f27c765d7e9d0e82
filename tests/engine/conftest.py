"""Engine fixtures: one tiny random model loaded once, shared by engines of different settings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mixserve.config import EngineConfig
from mixserve.engine import LLMEngine
from mixserve.engine.llm import LLM

TINY_BLOCKS = 512
TINY_BLOCK_SIZE = 4


@pytest.fixture(scope="session")
def tiny_runner(tiny_model_dir: Path) -> Any:
    """A ModelRunner over the tiny random Llama, fp32 on the CPU, 512 blocks of 4 tokens."""
    from mixserve.runner.model_runner import ModelRunner

    return ModelRunner.from_pretrained(str(tiny_model_dir), num_blocks=TINY_BLOCKS,
                                       block_size=TINY_BLOCK_SIZE, device="cpu", dtype="float32",
                                       attention_backend="torch")


@pytest.fixture
def make_llm(tiny_runner: Any):
    """make_llm(**engine_options) -> an LLM over the shared tiny runner (num_blocks caps its cache)."""

    def make(**options: Any) -> LLM:
        options.setdefault("threads", 1)  # the machine is shared: no binding in tests
        return LLM.from_engine(LLMEngine(tiny_runner, EngineConfig(**options)))

    return make
