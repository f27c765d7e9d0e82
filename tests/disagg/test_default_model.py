"""The default model (SmolLM2-135M) through a prefill engine plus a decode engine: greedy answers equal one
`both` engine's, a prompt chunked on the prefill side and one prefilled whole."""

from __future__ import annotations

import pytest

from mixserve.engine.llm_engine import LLMEngine
from mixserve.engine.sampling_params import SamplingParams
from tests.disagg.conftest import options, run_both, run_pair, tiny_runner

pytestmark = pytest.mark.slow

QUESTIONS = [
    "The capital of France is",
    "Write a short poem about the sea. The sea is wide and the waves are tall, and the wind sings over it "
    "all day long while the gulls cry and the boats sail home before the evening comes.",
]


@pytest.mark.parametrize("chunk", [16, 0], ids=["chunked", "whole"])
def test_default_model_greedy_answers_equal_one_both_engine(make_pair, chunk: int):
    cfg = options(num_blocks=128, prefill_chunk=chunk, max_batch_tokens=256)
    params = SamplingParams(max_tokens=12, temperature=0)
    both_engine = LLMEngine(tiny_runner(None, 128), cfg)
    prompts = [both_engine.tokenizer.encode(q, add_special_tokens=True) for q in QUESTIONS]
    assert max(len(p) for p in prompts) > 2 * 16  # the long one is chunked at 16 on the prefill side
    both = run_both(both_engine, prompts, params)
    prefill, decode = make_pair(cfg, cfg, default_model=True)
    assert run_pair(prefill, decode, prompts, params) == both
    assert decode.num_imported == prefill.num_shipped == 2
