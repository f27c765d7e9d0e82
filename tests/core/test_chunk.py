"""The seed chapter's tests (chunked prefill), under its names."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from mixserve.core import Chunk, Chunked, WholePrompt, plan, split
from tests.core.fake_runner import FakeRunner, drive, make_scheduler, reference, run_step


def hand_example(policy):
    """DESIGN.md section 1: beta=8, blocks of 4; A: 2-token prompt, 3 tokens; B: 10-token prompt, 1 token."""
    s = make_scheduler(8, policy, block_size=4)
    s.add_request("A", [1, 2], 3)
    s.add_request("B", list(range(10, 20)), 1)
    return s


def test_hand_example_chunk_plan():
    s = hand_example(Chunked(4))
    runner = FakeRunner(s.cfg.num_blocks, s.cfg.block_size)
    expected = [
        ([], [Chunk("A", 0, 2, True), Chunk("B", 0, 4, False)], 6, ["A"]),
        (["A"], [Chunk("B", 4, 4, False)], 5, ["A"]),
        (["A"], [Chunk("B", 8, 2, True)], 3, ["A", "B"]),
    ]
    for step, (decodes, chunks, num_tokens, sampled) in enumerate(expected, start=1):
        out = s.schedule()
        assert (out.decodes, out.chunks, out.num_tokens) == (decodes, chunks, num_tokens), f"step {step}"
        p = plan(s, out)
        assert [rid for _, rid in p.sample] == sampled, f"step {step}"
        rows = runner.forward(p.batch)
        finished = s.update(out, {rid: rows[i] for i, rid in p.sample})
    assert sorted(finished) == ["A", "B"]
    assert not s.has_unfinished()
    assert s.output("A") == reference([1, 2], 3)
    assert s.output("B") == reference(list(range(10, 20)), 1)


def test_whole_prompt_waits_for_a_step_of_its_own():
    s = hand_example(WholePrompt())
    runner = FakeRunner(s.cfg.num_blocks, s.cfg.block_size)
    steps = []
    while s.has_unfinished():
        out, finished = run_step(s, runner)
        steps.append((out.decodes, out.chunks, out.num_tokens, finished))
    assert steps == [
        ([], [Chunk("A", 0, 2, True)], 2, []),  # B (10 > 8) cannot share the step
        (["A"], [], 1, []),
        (["A"], [], 1, ["A"]),
        ([], [Chunk("B", 0, 10, True)], 10, ["B"]),  # alone: past the budget
    ]


def test_split_hand_example():
    assert split(10, 4) == [(0, 4), (4, 4), (8, 2)]
    assert split(8, 4) == [(0, 4), (4, 4)]
    assert split(3, 10) == [(0, 3)]
    assert split(3, 0) == [(0, 1), (1, 1), (2, 1)]  # a chunk of 0 means 1
    assert split(0, 4) == []
    for n in range(0, 30):
        for chunk in range(0, 12):
            pieces = split(n, chunk)
            # every token once, in order, nothing past the end
            assert [p for start, length in pieces for p in range(start, start + length)] == list(range(n))
            assert all(1 <= length <= max(chunk, 1) for _, length in pieces)


def test_plan_samples_only_sequence_ends():
    s = make_scheduler(16, Chunked(4), block_size=4)
    runner = FakeRunner(s.cfg.num_blocks, s.cfg.block_size)
    s.add_request("A", [5, 6, 7], 4)
    s.add_request("B", list(range(100, 110)), 2)
    run_step(s, runner)  # A 0..3 (last, sampled), B 0..4
    s.add_request("C", [8, 9], 2)

    out = s.schedule()
    assert out.decodes == ["A"]
    assert out.chunks == [Chunk("B", 4, 4, False), Chunk("C", 0, 2, True)]
    p = plan(s, out)
    a_tokens = s.tokens("A")
    assert len(a_tokens) == 4
    decode, middle, end = p.batch.seqs
    # the decode: A's newest token at position n - 1 = 3, through A's own blocks
    assert (decode.request_id, list(decode.tokens), decode.start) == ("A", [a_tokens[3]], 3)
    assert list(decode.block_table) == s.block_table("A")
    assert (middle.request_id, list(middle.tokens), middle.start) == ("B", list(range(104, 108)), 4)
    assert list(middle.block_table) == s.block_table("B")
    assert (end.request_id, list(end.tokens), end.start) == ("C", [8, 9], 0)
    assert p.batch.num_tokens == out.num_tokens == 7
    # B's row predicts a prompt token it already has: computed, never sampled
    assert p.sample == [(0, "A"), (2, "C")]
    rows = runner.forward(p.batch)
    s.update(out, {rid: rows[i] for i, rid in p.sample})
    assert s.output("A") == reference([5, 6, 7], 4)[:2]
    assert s.output("B") == []


def within_budget(out, beta: int, policy) -> bool:
    # The one exception: a WholePrompt prompt longer than the budget, running alone.
    alone = isinstance(policy, WholePrompt) and not out.decodes and len(out.chunks) == 1
    return out.num_tokens <= beta or alone


workloads = st.integers(2, 16).flatmap(
    lambda beta: st.tuples(
        st.just(beta),
        st.one_of(st.just(WholePrompt()), st.integers(1, 2 * beta).map(Chunked)),
        st.lists(
            st.tuples(
                st.integers(0, 6),  # arrival step
                st.lists(st.integers(0, 999), min_size=1, max_size=4 * beta),  # prompt
                st.integers(1, 6),  # max_tokens
            ),
            min_size=1,
            max_size=8,
        ),
    )
)


@settings(max_examples=150, deadline=None)
@given(workloads)
def test_token_budget_never_exceeded(workload):
    beta, policy, requests = workload
    s = make_scheduler(beta, policy, block_size=4)
    arrivals: dict[int, list] = {}
    for i, (at, prompt, max_tokens) in enumerate(requests):
        arrivals.setdefault(at, []).append((f"r{i}", prompt, max_tokens))

    def check(_s, out):
        assert within_budget(out, beta, policy), f"{out.num_tokens} tokens > budget {beta}: {out}"

    trace = drive(s, arrivals, check_step=check)
    for i, (_, prompt, max_tokens) in enumerate(requests):
        assert trace.outputs[f"r{i}"] == reference(prompt, max_tokens)


def long_prompt_beside_decodes(beta: int, policy):
    """Three requests decoding (40 tokens each), then a 40-token prompt L arrives: when do L's chunks run?"""
    s = make_scheduler(beta, policy, block_size=4)
    arrivals = {0: [(f"d{i}", [i + 1], 40) for i in range(3)], 2: [("L", list(range(40)), 1)]}
    return drive(s, arrivals).steps


@settings(max_examples=40, deadline=None)
@given(st.integers(4, 16), st.integers(1, 16))
def test_long_prompt_progresses_beside_decodes(beta, chunk):
    steps = long_prompt_beside_decodes(beta, Chunked(chunk))
    with_l = [i for i, out in enumerate(steps) if any(c.request_id == "L" for c in out.chunks)]
    assert with_l[0] <= 2 + 3, "L starts within 4 steps of its arrival"
    # L advances every step until its prefill is done, beside the three decodes, which never stall
    assert with_l == list(range(with_l[0], with_l[-1] + 1))
    assert len(with_l) <= math.ceil(40 / min(chunk, beta - 3))
    decoders_done = max(i for i, out in enumerate(steps) if out.decodes)
    assert decoders_done == 39  # one prefill step, then 39 decodes: L never held them back
    for i in with_l:
        if i <= decoders_done:
            assert sorted(steps[i].decodes) == ["d0", "d1", "d2"]
        assert steps[i].num_tokens <= beta

    # Without chunks, L (40 > beta) waits for a step of its own: until every decode has finished.
    steps = long_prompt_beside_decodes(beta, WholePrompt())
    (l_step,) = [i for i, out in enumerate(steps) if any(c.request_id == "L" for c in out.chunks)]
    last_decode = max(i for i, out in enumerate(steps) if out.decodes)
    assert l_step > last_decode == 39
    assert steps[l_step].num_tokens == 40
