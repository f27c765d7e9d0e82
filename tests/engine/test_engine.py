"""The engine end to end on the tiny random Llama: batching, chunking, preemption, seeds, stops, errors."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from mixserve import SamplingParams
from mixserve.engine import RequestError

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def prompts(n: int, seed: int = 0, low: int = 3, high: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 300) for _ in range(rng.randint(low, high))] for _ in range(n)]


@pytest.fixture
def reference(make_llm) -> dict[tuple[int, ...], list[int]]:
    """Greedy tokens of each prompt of prompts(6) run alone, whole, in an ample cache."""
    llm = make_llm(prefill_chunk=0, max_num_seqs=1)
    return {tuple(p): llm.generate([p], GREEDY)[0].token_ids for p in prompts(6)}


@pytest.mark.parametrize("chunk", [0, 4, 16])
def test_batched_and_chunked_greedy_equals_one_at_a_time(make_llm, reference, chunk: int) -> None:
    outs = make_llm(prefill_chunk=chunk, max_batch_tokens=32).generate(prompts(6), GREEDY)
    assert [o.token_ids for o in outs] == [reference[tuple(p)] for p in prompts(6)]
    assert [o.prompt_token_ids for o in outs] == prompts(6)
    assert all(o.finish_reason == "length" and len(o.token_ids) == 12 for o in outs)


def test_forced_preemption_gives_exactly_the_ample_outputs(make_llm, reference) -> None:
    # 16 blocks of 4 = 64 slots: the biggest request (40 + 12) fits alone, never all six at once
    llm = make_llm(prefill_chunk=8, max_batch_tokens=32, num_blocks=16)
    outs = llm.generate(prompts(6), GREEDY)
    assert llm.engine.stats().num_preemptions_total > 0
    assert [o.token_ids for o in outs] == [reference[tuple(p)] for p in prompts(6)]

    seeded = [SamplingParams(max_tokens=12, temperature=1.0, seed=i, ignore_eos=True) for i in range(6)]
    tight = [o.token_ids for o in llm.generate(prompts(6), seeded)]
    ample = [o.token_ids for o in make_llm(prefill_chunk=8).generate(prompts(6), seeded)]
    assert tight == ample


def test_seeded_request_is_independent_of_the_rest_of_the_batch(make_llm) -> None:
    target = prompts(1, seed=5)[0]
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = make_llm().generate([target], params)[0].token_ids
    others = SamplingParams(max_tokens=10, temperature=1.2, ignore_eos=True)
    for seed in (1, 2):
        llm = make_llm(seed=seed, prefill_chunk=4, max_batch_tokens=24)
        outs = llm.generate([*prompts(3, seed=seed), target], [others] * 3 + [params])
        assert outs[-1].token_ids == alone
    other_seed = make_llm().generate([target], SamplingParams(max_tokens=16, seed=99, ignore_eos=True))
    assert other_seed[0].token_ids != alone


def test_stop_string_and_stop_token_end_the_request(make_llm) -> None:
    llm = make_llm()
    p = prompts(1, seed=3)[0]
    full = llm.generate([p], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))[0]
    text = full.text
    assert len(text) >= 6, text
    stop = text[3:6]
    cut = text.find(stop)
    out = llm.generate([p], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.text == text[:cut]
    assert out.token_ids == full.token_ids[: len(out.token_ids)]

    token = full.token_ids[5]
    first = full.token_ids.index(token)
    out = llm.generate([p], SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[token]))[0]
    assert out.finish_reason == "stop" and out.token_ids == full.token_ids[: first + 1]


def test_eos_ends_a_request_unless_ignore_eos(make_llm) -> None:
    llm = make_llm()
    p = prompts(1, seed=4)[0]
    full = llm.generate([p], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0].token_ids
    llm.engine.eos_token_ids = frozenset({full[3]})  # pretend the fourth greedy token is the model's EOS
    out = llm.generate([p], SamplingParams(max_tokens=10, temperature=0.0))[0]
    assert out.finish_reason == "stop" and out.token_ids == full[: full.index(full[3]) + 1]
    out = llm.generate([p], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0]
    assert out.finish_reason == "length" and out.token_ids == full


def test_logprobs_sanity(make_llm) -> None:
    out = make_llm().generate(prompts(1)[0], SamplingParams(max_tokens=6, temperature=0.0, logprobs=5))[0]
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    for token, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert lp.token_id == token and len(lp.top) == 5
        assert lp.top[0] == (token, pytest.approx(lp.logprob))  # greedy = the most likely
        assert sum(math.exp(v) for _, v in lp.top) <= 1.0 + 1e-5
        assert all(a[1] >= b[1] for a, b in zip(lp.top, lp.top[1:], strict=False))


def test_refuses_requests_that_cannot_run(make_llm) -> None:
    llm = make_llm(max_model_len=32, num_blocks=16)
    engine = llm.engine
    with pytest.raises(RequestError, match="exceeds max_model_len") as err:
        engine.add_request("a", list(range(10, 30)), SamplingParams(max_tokens=13))
    assert err.value.param == "max_tokens"
    with pytest.raises(RequestError) as err:
        engine.validate(list(range(10, 50)), SamplingParams(max_tokens=1))
    assert err.value.param == "prompt"
    with pytest.raises(RequestError, match="outside the vocabulary"):
        llm.generate([[5, 100000]], GREEDY)
    with pytest.raises(RequestError, match="empty"):
        engine.validate([], GREEDY)
    small = make_llm(num_blocks=4)  # 16 slots
    with pytest.raises(RequestError, match="exceeds the KV cache"):
        small.engine.validate(list(range(10, 20)), SamplingParams(max_tokens=7))
    engine.add_request("dup", [5, 6], GREEDY)
    with pytest.raises(RequestError, match="already in use"):
        engine.add_request("dup", [5, 6], GREEDY)
    engine.abort("dup")
    engine.abort("never-added")  # no-op
    assert not engine.has_unfinished()


def test_abort_frees_blocks_mid_generation(make_llm) -> None:
    engine = make_llm(num_blocks=32).engine
    engine.add_request("a", prompts(1)[0], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.stats().scheduler.num_free_blocks < 32
    engine.abort("a")
    assert engine.stats().scheduler.num_free_blocks == 32 and not engine.has_unfinished()


def test_step_trace_and_counters(make_llm, tmp_path: Path) -> None:
    trace = tmp_path / "steps.jsonl"
    llm = make_llm(step_trace=str(trace), prefill_chunk=8, max_batch_tokens=16)
    ps = prompts(4)
    outs = llm.generate(ps, GREEDY)
    llm.engine.close()
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert [s["step"] for s in lines] == list(range(1, len(lines) + 1))
    assert all(set(s) == {"step", "time", "decode_tokens", "prefill_tokens", "num_seqs", "duration_s", "gc_s"}
               for s in lines)
    assert all(s["decode_tokens"] + s["prefill_tokens"] <= 16 for s in lines)
    assert sum(s["prefill_tokens"] for s in lines) == sum(map(len, ps))  # no preemption: each once
    assert sum(s["decode_tokens"] for s in lines) == sum(len(o.token_ids) - 1 for o in outs)
    stats = llm.engine.stats()
    assert stats.num_steps == len(lines)
    assert stats.num_generation_tokens_total == sum(len(o.token_ids) for o in outs)
    assert stats.num_prompt_tokens_total == sum(map(len, ps))
    llm.generate(ps[:1], SamplingParams(max_tokens=2, temperature=0, n=3, ignore_eos=True))  # counted once
    after = llm.engine.stats()
    assert after.num_prompt_tokens_total - stats.num_prompt_tokens_total == len(ps[0])
    assert after.num_generation_tokens_total - stats.num_generation_tokens_total == 3 * 2
    for o in outs:
        m = o.metrics
        assert m.arrival <= m.first_token <= m.finished and len(m.token_times) == len(o.token_ids)
        assert list(m.token_times) == sorted(m.token_times)


def test_generate_keeps_prompt_order_and_takes_text_and_per_prompt_params(make_llm) -> None:
    llm = make_llm(prefill_chunk=4, max_batch_tokens=8)
    texts = ["the cat sat on the mat " * 3, "hi", "a dog"]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (2, 7, 4)]
    outs = llm.generate(texts, params)
    assert [len(o.token_ids) for o in outs] == [2, 7, 4]
    assert [o.prompt_token_ids for o in outs] == [llm.tokenizer.encode(t) for t in texts]
    assert [o.text for o in outs] == [llm.tokenizer.decode(o.token_ids) for o in outs]  # incremental = whole
    with pytest.raises(ValueError, match="params"):
        llm.generate(texts, params[:2])
