"""Differential: greedy LLM.generate on the default model equals Hugging Face transformers' greedy tokens,
with several prompts in flight and prefill_chunk 0 (whole prompts), 4 and 16."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mixserve import SamplingParams
from mixserve.config import EngineConfig
from mixserve.engine import LLMEngine
from mixserve.engine.llm import LLM

NEW_TOKENS = 12
TEXTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Water boils at a temperature of 100 degrees Celsius at sea level. At the top of a high mountain,"
    " where the air pressure is lower, water boils at",
]


@pytest.fixture(scope="module")
def default_runner() -> Any:
    from mixserve.runner.model_runner import ModelRunner

    return ModelRunner.from_pretrained(None, num_blocks=256, block_size=16, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def hf_greedy(default_runner: Any) -> list[list[int]]:
    """HF's greedy continuation of each prompt (one at a time: no padding), up to EOS or NEW_TOKENS."""
    from transformers import AutoModelForCausalLM

    from mixserve.model.loader import default_model_path

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model.eval()
    chat = default_runner.tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}])
    out = []
    with torch.inference_mode():
        for ids in [*(default_runner.tokenizer.encode(t) for t in TEXTS), chat]:
            x = torch.tensor([ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS,
                               do_sample=False)
            out.append(y[0, len(ids) :].tolist())
    return out


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [0, 4, 16])
def test_greedy_equals_hf_transformers(default_runner: Any, hf_greedy: list[list[int]], chunk: int) -> None:
    # threads=1: binding would pin the test process's main thread (and its children) to one core
    cfg = EngineConfig(prefill_chunk=chunk, max_batch_tokens=64, threads=1)
    llm = LLM.from_engine(LLMEngine(default_runner, cfg))
    chat = llm.tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}])
    outs = llm.generate([*TEXTS, chat], SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
    eos = llm.engine.eos_token_ids
    for out, ref in zip(outs, hf_greedy, strict=True):
        # HF stops at EOS; we were told to go on, so compare up to there
        assert out.token_ids[: len(ref)] == ref
        assert len(ref) == NEW_TOKENS or ref[-1] in eos
    assert "Paris" in outs[0].text
