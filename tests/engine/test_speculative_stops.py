"""N-gram speculation, stepped: a stop inside a step's run of kept drafts ends the output where the run
without speculation ends; streamed updates add up to the output; aborts; sampling keeps its distribution.
The stops are found in each run's own output (nothing expected is written down)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import pytest

from mixserve import SamplingParams
from mixserve.config import EngineConfig
from mixserve.core.draft_gate import DraftGate
from mixserve.engine import LLMEngine


@pytest.fixture(autouse=True)
def drafts_always_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests check what drafts do, not when the gate (timed, so not repeatable) lets them run."""
    monkeypatch.setattr(DraftGate, "allows", lambda self, num_decodes, chunks=False: True)


def repeating(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 300) for _ in range(rng.randint(3, 8))] * 4 for _ in range(n)]


def drive(engine: LLMEngine, prompts: Sequence, params: SamplingParams) -> tuple[list, list]:
    """Step `engine` over `prompts`: each request's updates, and its scheduler record (kept past its end:
    it holds every token the scheduler appended, the ones after a stop too)."""
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    records = [engine.scheduler.request(f"r{i}") for i in range(len(prompts))]
    updates: dict[str, list] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for u in engine.step():
            updates[u.request_id].append(u)
    return [updates[f"r{i}"] for i in range(len(prompts))], records


def final(updates: list) -> Any:
    assert updates[-1].finished and all(not u.finished for u in updates[:-1])
    return updates[-1].output


def inside_runs(updates: list) -> list[int]:
    """Positions of the output tokens that a step produced with more after them (kept drafts)."""
    inside, pos = [], 0
    for u in updates:
        inside += range(pos, pos + len(u.new_token_ids) - 1)
        pos += len(u.new_token_ids)
    return inside


def stop_string_ending_at(tokenizer: Any, tokens: list[int], text: str, positions: list[int]
                          ) -> tuple[str, int] | None:
    """(s, i): a piece s of `text` whose first occurrence ends with the text of tokens[i], i in
    `positions`: a stop string that ends the output at token i."""
    for i in positions:
        upto = tokenizer.decode(tokens[: i + 1])
        if not text.startswith(upto) or len(upto) == len(tokenizer.decode(tokens[:i])):
            continue
        for width in range(1, min(12, len(upto)) + 1):
            piece = upto[-width:]
            if "\ufffd" not in piece and text.find(piece) + width == len(upto):
                return piece, i
    return None


def engines(runner: Any, **options: Any) -> tuple[LLMEngine, LLMEngine]:
    options.setdefault("threads", 1)
    return LLMEngine(runner, EngineConfig(**options)), LLMEngine(runner, EngineConfig(speculative="ngram",
                                                                                      **options))


def assert_same_ends(off: list, on: list) -> None:
    for a, b in zip(off, on, strict=True):
        x, y = final(a), final(b)
        assert (y.text, y.token_ids, y.finish_reason) == (x.text, x.token_ids, x.finish_reason)


def test_stop_string_inside_a_run_of_kept_drafts(tiny_runner):
    prompts = repeating(6)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain, spec = engines(tiny_runner)
    full, _ = drive(spec, prompts, params)
    found = [(k, hit) for k, ups in enumerate(full) if (hit := stop_string_ending_at(
        tiny_runner.tokenizer, final(ups).token_ids, final(ups).text, inside_runs(ups)))]
    assert len(found) >= 2, "no stop string ends inside a run of kept drafts"
    for k, (stop, i) in found:
        stopped = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop], logprobs=1)
        plain, spec = engines(tiny_runner)
        off, _ = drive(plain, [prompts[k]], stopped)
        on, records = drive(spec, [prompts[k]], stopped)
        assert_same_ends(off, on)
        out = final(on[0])
        assert out.finish_reason == "stop" and len(out.token_ids) == i + 1 and len(out.logprobs) == i + 1
        assert len(records[0].tokens) - records[0].prompt_len > i + 1  # the step had tokens after it
        text = final(full[k]).text
        assert "".join(u.new_text for u in on[0]) == out.text == text[: text.find(stop)]


@pytest.mark.parametrize("min_tokens", [0, 9])
def test_stop_token_ids_and_eos_with_speculation(tiny_runner, min_tokens: int):
    prompts = repeating(6, seed=1)
    plain, spec = engines(tiny_runner)
    first, _ = drive(plain, prompts, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    stop_ids = sorted({final(u).token_ids[12] for u in first})  # tokens the outputs do produce
    params = SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=stop_ids, min_tokens=min_tokens)
    plain, spec = engines(tiny_runner)
    off, _ = drive(plain, prompts, params)
    on, _ = drive(spec, prompts, params)
    assert_same_ends(off, on)
    assert sum(final(u).finish_reason == "stop" for u in on) >= 3
    assert spec.stats().scheduler.spec_num_accepted_tokens > 0


def test_streamed_updates_add_up_to_the_output(tiny_runner):
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=0)
    _, spec = engines(tiny_runner, prefill_chunk=8, max_batch_tokens=48)
    runs, _ = drive(spec, repeating(6, seed=2), params)
    for ups in runs:
        out = final(ups)
        assert [t for u in ups for t in u.new_token_ids] == out.token_ids and len(out.token_ids) == 40
        assert "".join(u.new_text for u in ups) == out.text
        assert [lp for u in ups for lp in u.logprobs] == out.logprobs
        assert all(len(u.token_times) == len(u.new_token_ids) for u in ups)
        assert list(out.metrics.token_times) == [t for u in ups for t in u.token_times]
    assert max(len(u.new_token_ids) for ups in runs for u in ups) > 2  # several tokens in one step
    assert spec.stats().num_generation_tokens_total == 6 * 40


def test_abort_while_speculating(tiny_runner):
    prompts = repeating(4, seed=3)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain, spec = engines(tiny_runner)
    off, _ = drive(plain, prompts[1:], params)
    for i, p in enumerate(prompts):
        spec.add_request(f"r{i}", p, params)
    outs: dict[str, Any] = {}
    for step in range(60):
        for u in spec.step():
            if u.finished:
                outs[u.request_id] = u.output
        if step == 4:  # r0 is in the middle of its loop: its drafts are booked every step
            spec.abort("r0")
        if not spec.has_unfinished():
            break
    assert spec.stats().scheduler.spec_num_accepted_tokens > 0 and "r0" not in outs
    assert [outs[f"r{i}"].token_ids for i in (1, 2, 3)] == [final(u).token_ids for u in off]
    assert spec.stats().kv_cache_usage == 0


def test_sampling_keeps_its_distribution(tiny_runner):
    # drafts are kept with the target's probability and the rest drawn from the residual: how often a
    # token repeats the one before (what n-gram drafts propose in a loop) stays as without speculation
    rng = random.Random(4)
    prompt = [rng.randrange(10, 300) for _ in range(5)] * 4
    params = [SamplingParams(max_tokens=8, temperature=0.3, seed=s, ignore_eos=True) for s in range(600)]
    rates = []
    for engine in engines(tiny_runner):
        for i, p in enumerate(params):
            engine.add_request(f"s{i}", prompt, p)
        outs = []
        while engine.has_unfinished():
            outs += [u.output for u in engine.step() if u.finished]
        rates.append(sum(o.token_ids[j] == o.token_ids[j - 1] for o in outs for j in range(1, 8)) / (600 * 7))
    assert engine.stats().scheduler.spec_num_draft_tokens > 300
    assert abs(rates[0] - rates[1]) < 0.03, rates


def test_default_model_stops_inside_kept_drafts(default_runner):
    prompts = ["The days of the week are Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday. "
               "Again: Monday, Tuesday,",
               "A B C D E F G H I J K L M N O P Q R S T U V W X Y Z. A B C D E F G"]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain, spec = engines(default_runner)
    off, _ = drive(plain, prompts, params)
    on, _ = drive(spec, prompts, params)
    assert_same_ends(off, on)  # real text: greedy, token for token
    assert spec.stats().scheduler.spec_num_accepted_tokens > 0
    for k, ups in enumerate(on):
        tokens = final(ups).token_ids
        # a token the output has not had before, kept as a draft (copied from the prompt) mid-step
        firsts = [i for i in inside_runs(ups) if i > 0 and tokens.index(tokens[i]) == i]
        assert firsts, f"prompt {k}: no new token inside a run of kept drafts"
        i = firsts[len(firsts) // 2]
        hit = stop_string_ending_at(default_runner.tokenizer, tokens, final(ups).text, inside_runs(ups))
        assert hit is not None
        for stop in (SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[tokens[i]]),
                     SamplingParams(max_tokens=24, temperature=0.0, stop=[hit[0]])):
            plain, spec = engines(default_runner)
            a, _ = drive(plain, [prompts[k]], stop)
            b, records = drive(spec, [prompts[k]], stop)
            assert_same_ends(a, b)
            end = i if stop.stop_token_ids else hit[1]
            assert final(b[0]).finish_reason == "stop" and len(final(b[0]).token_ids) == end + 1
            assert len(records[0].tokens) - records[0].prompt_len > end + 1
