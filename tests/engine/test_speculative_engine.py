"""N-gram speculative decoding end to end on the tiny random Llama: every output equals the one without
speculation (greedy), with chunking, preemption, prefix caching, n > 1, logprobs and penalties (grammars:
test_grammar_drafts.py).

The tiny model's greedy text falls into loops of a token or two, so drafts are made and mostly accepted;
each comparison runs the same engine settings with speculative="" as its reference.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from mixserve import SamplingParams
from mixserve.core.draft_gate import DraftGate


@pytest.fixture(autouse=True)
def drafts_always_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests check what drafts do, not when the gate (timed, so not repeatable) lets them run."""
    monkeypatch.setattr(DraftGate, "allows", lambda self, num_decodes, chunks=False: True)


def repeating(n: int, seed: int = 0) -> list[list[int]]:
    """n prompts, each a short random run of tokens said four times: text that repeats."""
    rng = random.Random(seed)
    return [[rng.randrange(10, 300) for _ in range(rng.randint(3, 8))] * 4 for _ in range(n)]


def greedy(max_tokens: int = 40, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def both(make_llm, prompts: list, params: Any, **options: Any) -> tuple[list, list, Any]:
    """The outputs without and with speculation under the same settings, and the speculating LLM."""
    off = make_llm(**options).generate(prompts, params, use_tqdm=False)
    llm = make_llm(speculative="ngram", **options)
    on = llm.generate(prompts, params, use_tqdm=False)
    return off, on, llm


def same(off: list, on: list) -> None:
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert [o.text for o in on] == [o.text for o in off]
    assert [o.finish_reason for o in on] == [o.finish_reason for o in off]


def spec_counts(llm: Any) -> tuple[int, int]:
    s = llm.engine.stats().scheduler
    return s.spec_num_draft_tokens, s.spec_num_accepted_tokens


@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("chunk", [0, 16, 256])
def test_greedy_is_token_for_token_the_output_without_speculation(make_llm, chunk: int, caching: bool):
    off, on, llm = both(make_llm, repeating(6), greedy(), prefill_chunk=chunk, max_batch_tokens=64,
                        enable_prefix_caching=caching)
    same(off, on)
    assert all(len(o.token_ids) == 40 and o.finish_reason == "length" for o in on)
    drafted, accepted = spec_counts(llm)
    assert 0 < accepted < drafted  # drafts were kept, and some were rejected
    assert llm.engine.stats().scheduler.spec_num_drafts > 0
    assert llm.engine.stats().kv_cache_usage == 0  # every block, the drafts' too, given back
    assert llm.engine.stats().num_generation_tokens_total == 6 * 40


def test_unrepeating_text_and_eos_stops_too(make_llm):
    prompts = [[random.Random(i).randrange(10, 300) for _ in range(9 + i)] for i in range(6)]
    off, on, _ = both(make_llm, prompts, SamplingParams(max_tokens=40, temperature=0.0))
    same(off, on)


@pytest.mark.parametrize("caching", [False, True])
def test_preemption_gives_the_outputs_without_speculation(make_llm, caching: bool):
    # 24 blocks of 4 = 96 slots: one request (up to 32 + 40 tokens) fits, never all six at once
    opts = dict(num_blocks=24, prefill_chunk=8, max_batch_tokens=32, enable_prefix_caching=caching)
    off, on, llm = both(make_llm, repeating(6, seed=1), greedy(), **opts)
    same(off, on)
    assert llm.engine.stats().num_preemptions_total > 0
    assert spec_counts(llm)[1] > 0
    assert llm.engine.stats().kv_cache_usage == 0
    # and whole prompts, where a decode's drafts find no free block and are cut to the blocks it holds
    off, on, llm = both(make_llm, repeating(6, seed=1), greedy(), num_blocks=20, prefill_chunk=0,
                        enable_prefix_caching=caching)
    same(off, on)
    assert llm.engine.stats().num_preemptions_total > 0 and spec_counts(llm)[1] > 0


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 7, 13])
def test_max_tokens_is_exact(make_llm, max_tokens: int):
    off, on, llm = both(make_llm, repeating(6, seed=2), greedy(max_tokens))
    same(off, on)
    assert all(len(o.token_ids) == max_tokens and o.finish_reason == "length" for o in on)
    if max_tokens >= 7:  # drafts ran up to the last token and were cut there
        assert spec_counts(llm)[1] > 0


def test_n_2_greedy_choices_with_prefix_caching(make_llm):
    off, on, llm = both(make_llm, repeating(3, seed=3), greedy(30, n=2), enable_prefix_caching=True)
    for a, b in zip(off, on, strict=True):
        assert [c.token_ids for c in b.choices] == [c.token_ids for c in a.choices]
        assert [c.token_ids for c in b.choices] == [b.token_ids] * 2
    assert spec_counts(llm)[1] > 0


def test_n_2_seeded_choices_repeat_and_keep_their_length(make_llm):
    # a low temperature: the sampled text still loops, so drafts are tested (kept or rejected) by sampling
    params = SamplingParams(max_tokens=30, temperature=0.2, seed=11, n=2, ignore_eos=True)
    runs = []
    for _ in range(2):
        llm = make_llm(speculative="ngram")
        runs.append([[c.token_ids for c in o.choices] for o in llm.generate(repeating(3, 4), params,
                                                                            use_tqdm=False)])
        drafted, accepted = spec_counts(llm)
        assert 0 < accepted < drafted
    assert runs[0] == runs[1]
    assert all(len(t) == 30 for choices in runs[0] for t in choices)


def test_shared_long_prompt_with_prefix_caching(make_llm):
    shared = repeating(1, seed=5)[0] * 3  # 5 * 12 tokens: many full blocks
    prompts = [[shared + [7, 8, 9]], [shared + [10, 11], shared + [12]]]  # the first, then two more
    outs = {}
    for spec in ("", "ngram"):
        llm = make_llm(speculative=spec, enable_prefix_caching=True, prefill_chunk=16)
        outs[spec] = [o for batch in prompts for o in llm.generate(batch, greedy(), use_tqdm=False)]
    same(outs[""], outs["ngram"])
    assert llm.engine.stats().scheduler.prefix_cache_hits >= 2 * (len(shared) // 4 * 4)
    assert spec_counts(llm)[1] > 0


def test_blocks_filled_by_speculating_decodes_are_cached_with_the_right_kv(make_llm):
    # a second prompt that goes on from the first's output finds the blocks its decodes filled (with
    # drafts kept, and rejected ones overwritten) in the cache: what it computes on them must be right
    first = repeating(1, seed=6)[0]
    llm = make_llm(speculative="ngram", enable_prefix_caching=True)
    out = llm.generate([first], greedy(), use_tqdm=False)[0]
    assert spec_counts(llm)[1] > 0
    hits = llm.engine.stats().scheduler.prefix_cache_hits
    second = first + out.token_ids[:33] + [5, 6]
    cached = llm.generate([second], greedy(20), use_tqdm=False)[0]
    assert llm.engine.stats().scheduler.prefix_cache_hits - hits >= len(first) + 28
    plain = make_llm(enable_prefix_caching=False).generate([second], greedy(20), use_tqdm=False)[0]
    assert cached.token_ids == plain.token_ids


def test_logprobs_of_every_token_equal_those_without_speculation(make_llm):
    off, on, llm = both(make_llm, repeating(6, seed=7), greedy(logprobs=2))
    same(off, on)
    assert spec_counts(llm)[1] > 0
    for a, b in zip(off, on, strict=True):
        assert len(b.logprobs) == len(b.token_ids) == 40
        for x, y, t in zip(a.logprobs, b.logprobs, b.token_ids, strict=True):
            assert y.token_id == t and len(y.top) == 2
            assert abs(x.logprob - y.logprob) < 1e-4
            assert [i for i, _ in y.top] == [i for i, _ in x.top]
            assert all(abs(u - v) < 1e-4 for (_, u), (_, v) in zip(x.top, y.top, strict=True))


PENALTIES = [dict(repetition_penalty=1.3, frequency_penalty=0.5), dict(repetition_penalty=1.3),
             dict(frequency_penalty=0.2), dict(presence_penalty=0.5), dict(repetition_penalty=1.05,
             frequency_penalty=0.1, min_tokens=12)]


def test_penalties_see_the_earlier_drafts_as_generated(make_llm):
    accepted = 0
    for kw in PENALTIES:
        off, on, llm = both(make_llm, repeating(6), greedy(60, logprobs=1, **kw))
        same(off, on)
        for a, b in zip(off, on, strict=True):  # the model's own logprobs, before the penalties
            assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4
        accepted += spec_counts(llm)[1]
    assert accepted > 100  # the penalised rows verified many drafts


def test_with_a_tpot_target(make_llm):  # the target's budget bounds each decode's drafts
    off, on, llm = both(make_llm, repeating(6, seed=8), greedy(), tpot_target_ms=30.0)
    same(off, on)
    assert spec_counts(llm)[1] > 0


def test_bad_speculative_settings_raise_naming_the_key(make_llm):
    with pytest.raises(ValueError, match=r"^speculative: [^\n]*bogus[^\n]*$"):
        make_llm(speculative="bogus")
    with pytest.raises(ValueError, match=r"^num_speculative_tokens\b[^\n]*0$"):
        make_llm(speculative="ngram", num_speculative_tokens=0)
