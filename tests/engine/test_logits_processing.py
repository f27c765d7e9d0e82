"""min_tokens, logit_bias and penalties through the engine, on the tiny model."""

from __future__ import annotations

from mixserve.engine.sampling_params import SamplingParams


def greedy(llm, prompt: list[int], **params):
    return llm.generate([prompt], SamplingParams(temperature=0.0, **params))[0]


def test_min_tokens_hides_the_stop_token_until_then(make_llm):
    llm = make_llm()
    prompt = [5, 6, 7]
    first = greedy(llm, prompt, max_tokens=8).token_ids[0]
    stopped = greedy(llm, prompt, max_tokens=8, stop_token_ids=[first])
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"
    held = greedy(llm, prompt, max_tokens=8, stop_token_ids=[first], min_tokens=5)
    assert len(held.token_ids) >= 5 and first not in held.token_ids[:5]


def test_logit_bias_bans_the_greedy_token(make_llm):
    llm = make_llm()
    plain = greedy(llm, [9, 10], max_tokens=4)
    banned = greedy(llm, [9, 10], max_tokens=4, logit_bias={plain.token_ids[0]: -100.0})
    assert banned.token_ids[0] != plain.token_ids[0]


def test_a_strong_presence_penalty_never_repeats_a_token(make_llm):
    llm = make_llm()
    out = greedy(llm, [3, 4], max_tokens=24, ignore_eos=True, presence_penalty=2.0, frequency_penalty=2.0)
    plain = greedy(llm, [3, 4], max_tokens=24, ignore_eos=True)
    assert len(set(out.token_ids)) > len(set(plain.token_ids))  # the tiny model loops without a penalty
