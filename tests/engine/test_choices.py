"""n > 1 offline: the choices share the prompt, greedy choices agree, seeded ones differ and repeat."""

from __future__ import annotations

import pytest

from mixserve.engine.sampling_params import SamplingParams

PROMPT = list(range(3, 40))  # 37 tokens: 9 full blocks of 4 and one partial


def test_greedy_choices_are_identical_and_equal_to_n_1(make_llm):
    llm = make_llm(enable_prefix_caching=True)
    one = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0))[0]
    out = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0, n=3))[0]
    assert [c.token_ids for c in out.choices] == [one.token_ids] * 3
    assert [c.index for c in out.choices] == [0, 1, 2] and out.token_ids == one.token_ids


def test_seeded_choices_differ_and_a_rerun_repeats_them(make_llm):
    llm = make_llm()
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=7, n=4)
    first = [c.token_ids for c in llm.generate([PROMPT], params)[0].choices]
    again = [c.token_ids for c in llm.generate([PROMPT], params)[0].choices]
    assert first == again and len({tuple(t) for t in first}) == 4
    # choice i is the request with seed + i
    single = llm.generate([PROMPT], SamplingParams(max_tokens=12, temperature=1.0, seed=9))[0]
    assert first[2] == single.token_ids


@pytest.mark.parametrize("caching", [True, False])
def test_later_choices_compute_only_the_prompt_tail_with_caching(make_llm, caching):
    llm = make_llm(enable_prefix_caching=caching, prefill_chunk=0)
    llm.generate([PROMPT], SamplingParams(max_tokens=4, temperature=0, n=3))
    stats = llm.engine.stats().scheduler
    hits = stats.prefix_cache_hits
    if caching:  # choices 1 and 2 each found the 9 full blocks (36 tokens) computed by choice 0
        assert hits >= 2 * 36
    else:
        assert hits == 0


def test_aborting_a_request_aborts_every_choice(make_llm):
    llm = make_llm()
    engine = llm.engine
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=50, temperature=0, n=3, ignore_eos=True))
    for _ in range(6):
        engine.step()
    assert engine.stats().scheduler.num_requests_running == 3
    engine.abort("r")
    assert not engine.has_unfinished() and engine.stats().scheduler.kv_cache_usage == 0
