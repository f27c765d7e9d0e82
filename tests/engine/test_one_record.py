"""One record of a request's tokens: the scheduler's. What the engine hands out (streamed deltas, the
final output of every choice, however it stopped) is exactly what the scheduler recorded."""

from __future__ import annotations

from typing import Any

import pytest

from mixserve import SamplingParams
from mixserve.engine.choices import SEPARATOR

PROMPT = list(range(3, 40))


def record_at_retire(engine: Any) -> dict[str, list[int]]:
    """The scheduler's tokens (prompt + generated) of each request as the engine retires it; fails on a
    second retire of one request, or on the engine calling finish (one retire path: abort, once)."""
    seen: dict[str, list[int]] = {}
    abort = engine.scheduler.abort

    def snapshot_then_abort(request_id: str) -> None:
        assert request_id not in seen, f"{request_id} retired twice"
        seen[request_id] = engine.scheduler.tokens(request_id)
        abort(request_id)

    def no_finish(request_id: str) -> None:
        raise AssertionError(f"the engine called finish({request_id!r}): it retires through abort only")

    engine.scheduler.abort = snapshot_then_abort
    engine.scheduler.finish = no_finish
    return seen


def run(engine: Any, requests: dict[str, SamplingParams]) -> tuple[dict[str, Any], dict[tuple, list]]:
    """Step until done; returns each request's output and its streamed token ids per choice."""
    for rid, params in requests.items():
        engine.add_request(rid, PROMPT, params)
    outputs, streamed = {}, {}
    while engine.has_unfinished():
        for u in engine.step():
            streamed.setdefault((u.request_id, u.index), []).extend(u.new_token_ids)
            if u.request_done:
                outputs[u.request_id] = u.output
    return outputs, streamed


def test_every_choice_and_stop_hands_out_the_schedulers_record(make_llm):
    engine = make_llm(enable_prefix_caching=True).engine
    first = run(engine, {"probe": SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)})[0]["probe"]
    third = first.token_ids[2]
    text = first.text
    seen = record_at_retire(engine)
    outputs, streamed = run(engine, {
        "n3": SamplingParams(max_tokens=8, temperature=1.0, seed=5, n=3, ignore_eos=True),
        "stop_id": SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[third]),
        "stop_str": SamplingParams(max_tokens=8, temperature=0, stop=[text[-2:]] if len(text) > 2 else None),
        "length": SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
    })
    assert outputs["stop_id"].finish_reason == "stop" and outputs["stop_id"].token_ids[-1] == third
    assert outputs["length"].finish_reason == "length"
    for rid, out in outputs.items():
        for choice in out.choices:
            internal = rid if choice.index == 0 else f"{rid}{SEPARATOR}{choice.index}"
            assert choice.prompt_token_ids + choice.token_ids == seen[internal], internal
            assert streamed[(rid, choice.index)] == choice.token_ids, internal
    assert len(outputs["n3"].choices) == 3 and len(seen) == 6  # every choice retired once, by one path


def test_a_retired_request_leaves_no_record_behind(make_llm):
    engine = make_llm().engine
    run(engine, {"a": SamplingParams(max_tokens=4, temperature=0, n=2, ignore_eos=True)})
    for internal in ("a", f"a{SEPARATOR}1"):
        with pytest.raises(KeyError):
            engine.scheduler.request(internal)
    assert not engine._requests and not engine.has_unfinished()


def test_an_abort_retires_every_choice_once_and_a_late_abort_is_a_no_op(make_llm):
    engine = make_llm().engine
    seen = record_at_retire(engine)
    engine.add_request("a", PROMPT, SamplingParams(max_tokens=20, temperature=0, n=2, ignore_eos=True))
    while not any(u.index == 1 for u in engine.step()):  # until choice 1 has joined and sampled
        pass
    engine.abort("a")
    engine.abort("a")
    assert sorted(seen) == ["a", f"a{SEPARATOR}1"] and not engine.has_unfinished()
