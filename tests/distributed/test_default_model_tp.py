"""The default model (9 query heads in 3 KV groups: 6 + 3 over two ranks) at tensor_parallel_size=2."""

from __future__ import annotations

import pytest
import torch

from mixserve import LLM, SamplingParams
from tests.distributed.conftest import mixed_steps

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tp2():
    llm = LLM(None, tensor_parallel_size=2, num_blocks=512, block_size=4, prefill_chunk=16, dtype="float32",
              enable_prefix_caching=False)
    yield llm
    llm.engine.runner.close()


def test_default_model_mixed_steps_match_one_process_within_2e3(default_runner, tp2: LLM):
    for step, batch in enumerate(mixed_steps(4)):
        want, got = default_runner.forward(batch), tp2.engine.runner.forward(batch)
        assert (got - want).abs().max().item() < 2e-3, f"step {step}"
        assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_default_model_greedy_answers_match_one_process(tp2: LLM):
    prompts = ["What is the capital of France?", "Write a haiku about the sea. " * 4]
    params = SamplingParams(max_tokens=16, temperature=0)
    one = LLM(None, num_blocks=512, block_size=4, prefill_chunk=16, dtype="float32")
    assert [o.token_ids for o in tp2.generate(prompts, params)] == [o.token_ids for o in one.generate(prompts,
                                                                                                       params)]
