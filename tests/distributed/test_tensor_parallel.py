"""tensor_parallel_size=2 (gloo, two processes on the CPU) computes what one process computes."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from mixserve import LLM, ModelRunner, SamplingParams
from tests.distributed.conftest import mixed_steps

BLOCK = 4
OPTIONS = dict(num_blocks=64, block_size=BLOCK, prefill_chunk=8, max_batch_tokens=24, dtype="float32",
               enable_prefix_caching=False)  # the logits test writes blocks the engine does not know of
PROMPTS = [[5 + i for i in range(30)], [100, 101, 102], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tp2(uneven_model: Path):
    llm = LLM(str(uneven_model), tensor_parallel_size=2, **OPTIONS)
    yield llm
    llm.engine.runner.close()


def test_mixed_chunked_steps_match_one_process_within_2e3(uneven_model: Path, tp2: LLM):
    one = ModelRunner.from_pretrained(str(uneven_model), num_blocks=64, block_size=BLOCK, device="cpu")
    for step, batch in enumerate(mixed_steps(BLOCK)):
        want, got = one.forward(batch), tp2.engine.runner.forward(batch)
        assert got.shape == want.shape == (len(batch.seqs), one.config.vocab_size)
        assert (got - want).abs().max().item() < 2e-3, f"step {step}"
        assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_greedy_tokens_match_one_process(uneven_model: Path, tp2: LLM):
    want = [o.token_ids for o in LLM(str(uneven_model), **OPTIONS).generate(PROMPTS, GREEDY)]
    got = [o.token_ids for o in tp2.generate(PROMPTS, GREEDY)]
    assert got == want
    assert all(len(t) == GREEDY.max_tokens for t in got)


def test_replicated_kv_heads_match_one_process(one_group_model: Path):
    want = [o.token_ids for o in LLM(str(one_group_model), **OPTIONS).generate(PROMPTS, GREEDY)]
    llm = LLM(str(one_group_model), tensor_parallel_size=2, **OPTIONS)
    try:
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
    finally:
        llm.engine.runner.close()


def test_the_ranks_exit_when_the_llm_is_collected(uneven_model: Path):
    llm = LLM(str(uneven_model), tensor_parallel_size=2, **OPTIONS)
    procs = llm.engine.runner.processes
    assert [p.is_alive() for p in procs] == [True]
    del llm
    gc.collect()
    for p in procs:
        p.join(10)
        assert not p.is_alive()
