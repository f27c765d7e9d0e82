"""The scheduler's contract beyond the seed: validation, arrival order, caps, finish/abort, stats."""

from __future__ import annotations

import pytest

from mixserve.core import Chunk, Chunked, SchedulerConfig, WholePrompt, plan
from tests.core.fake_runner import FakeRunner, drive, make_scheduler, reference, run_step


@pytest.mark.parametrize("field", ["max_batch_tokens", "max_num_seqs", "block_size", "num_blocks"])
@pytest.mark.parametrize("value", [0, -1, 2.0, True])
def test_config_rejects_non_positive_fields(field, value):
    kwargs = {"max_batch_tokens": 8, field: value}
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**kwargs)


def test_policies():
    assert WholePrompt().chunk_len(5, 8, alone=False) == 5
    assert WholePrompt().chunk_len(9, 8, alone=False) == 0
    assert WholePrompt().chunk_len(9, 8, alone=True) == 9
    assert Chunked(4).chunk_len(10, 8, alone=True) == 4
    assert Chunked(4).chunk_len(10, 3, alone=False) == 3
    assert Chunked(4).chunk_len(2, 8, alone=False) == 2
    for bad in (0, -3):
        with pytest.raises(ValueError, match="chunk"):
            Chunked(bad)


def test_add_request_refuses_bad_requests():
    s = make_scheduler(8, block_size=4, num_blocks=4)  # 16 positions
    with pytest.raises(ValueError, match="empty"):
        s.add_request("a", [], 1)
    with pytest.raises(ValueError, match="max_tokens"):
        s.add_request("a", [1], 0)
    with pytest.raises(ValueError, match="KV cache"):
        s.add_request("a", [1] * 10, 7)
    s.add_request("a", [1] * 10, 6)  # exactly fits
    with pytest.raises(ValueError, match="already in use"):
        s.add_request("a", [1], 1)
    assert s.stats().num_requests_waiting == 1


def test_whole_prompt_keeps_arrival_order():
    """A long prompt waiting for a step of its own holds back the short ones behind it: it cannot starve."""
    s = make_scheduler(8, WholePrompt())
    arrivals = {0: [("A", [1], 4)], 1: [("W", list(range(10)), 1)], 2: [("S", [7, 7], 1)]}
    steps = drive(s, arrivals).steps
    first = {
        rid: min(i for i, o in enumerate(steps) if any(c.request_id == rid for c in o.chunks))
        for rid in "AWS"
    }
    assert first["A"] < first["W"] < first["S"]
    assert steps[first["W"]].chunks == [Chunk("W", 0, 10, True)]
    assert steps[first["W"]].decodes == []


def test_max_num_seqs_caps_running_requests():
    s = make_scheduler(64, Chunked(16), max_num_seqs=2)
    arrivals = {0: [(f"r{i}", [i, i + 1, i + 2], 3) for i in range(5)]}

    def check(s, out):
        assert len(out.decodes) + len(out.chunks) <= 2
        assert s.stats().num_requests_running <= 2

    trace = drive(s, arrivals, check_step=check)
    assert trace.outputs == {f"r{i}": reference([i, i + 1, i + 2], 3) for i in range(5)}


def test_decodes_beyond_the_budget_wait_their_turn():
    s = make_scheduler(3, Chunked(3), max_num_seqs=5)
    arrivals = {0: [(f"r{i}", [i], 4) for i in range(5)]}
    trace = drive(s, arrivals, check_step=lambda s, out: out.num_tokens <= 3 or pytest.fail(str(out)))
    assert trace.outputs == {f"r{i}": reference([i], 4) for i in range(5)}


def test_preemption_recomputes_the_newest_request():
    # 4 blocks of 2: A and B (3-token prompts, 4 tokens each) fit one at a time, not together.
    s = make_scheduler(16, Chunked(8), block_size=2, num_blocks=4)
    runner = FakeRunner(4, 2)
    s.add_request("A", [1, 2, 3], 4)
    s.add_request("B", [4, 5, 6], 4)
    out, _ = run_step(s, runner)
    assert [c.request_id for c in out.chunks] == ["A", "B"] and s.blocks.num_free() == 0
    out, _ = run_step(s, runner)  # both decode at position 3, still in their second block
    assert out.decodes == ["A", "B"]
    out, _ = run_step(s, runner)  # A needs a third block: B, admitted last, gives its blocks back
    assert (out.decodes, out.preempted) == (["A"], ["B"])
    assert s.block_table("B") == [] and s.stats().num_requests_waiting == 1
    assert s.output("B") == reference([4, 5, 6], 2)[:2]  # kept: recomputed, not regenerated
    while s.has_unfinished():
        out, _ = run_step(s, runner)
        if any(c.request_id == "B" for c in out.chunks):
            # prompt + generated recomputed as one chunk, its end sampled
            assert Chunk("B", 0, 5, True) in out.chunks
    assert s.output("A") == reference([1, 2, 3], 4)
    assert s.output("B") == reference([4, 5, 6], 4)
    assert s.stats().num_preemptions == 1
    assert s.blocks.num_free() == 4


def test_finish_ends_a_request_early_and_keeps_its_output():
    s = make_scheduler(8, Chunked(4))
    runner = FakeRunner(s.cfg.num_blocks, s.cfg.block_size)
    s.add_request("A", [1, 2, 3], 10)
    run_step(s, runner)
    assert s.blocks.num_free() == s.cfg.num_blocks - 1
    s.finish("A")
    s.finish("A")  # twice (EOS on the max_tokens step): no-op
    assert s.output("A") == reference([1, 2, 3], 1)
    assert s.tokens("A") == [1, 2, 3, *reference([1, 2, 3], 1)]
    assert not s.has_unfinished() and s.blocks.num_free() == s.cfg.num_blocks
    with pytest.raises(KeyError):
        s.finish("nobody")


def test_abort_frees_blocks_and_a_step_in_flight_ignores_it():
    s = make_scheduler(8, Chunked(4))
    s.add_request("A", [1, 2, 3], 5)
    s.add_request("B", [4], 5)
    out = s.schedule()
    p = plan(s, out)
    s.abort("A")  # between schedule and update: the client went away
    assert s.update(out, {rid: 0 for _, rid in p.sample}) == []
    assert s.output("B") == [0]
    with pytest.raises(KeyError):
        s.output("A")
    with pytest.raises(KeyError):
        s.abort("A")
    s.abort("B")
    assert not s.has_unfinished() and s.blocks.num_free() == s.cfg.num_blocks


def test_abort_forgets_a_finished_request():
    s = make_scheduler(8)
    s.add_request("A", [1], 1)
    out = s.schedule()
    assert s.update(out, {"A": 5}) == ["A"]
    assert s.output("A") == [5]
    s.abort("A")
    with pytest.raises(KeyError):
        s.output("A")
    s.add_request("A", [1], 1)  # the id is free again


def test_update_refuses_tokens_for_unsampled_rows():
    s = make_scheduler(8, Chunked(2))
    s.add_request("A", [1, 2, 3], 2)
    out = s.schedule()  # A 0..2: a middle chunk, nothing to sample
    assert plan(s, out).sample == []
    with pytest.raises(ValueError, match="no sampled row"):
        s.update(out, {"A": 9})
    out = s.schedule()
    with pytest.raises(ValueError, match="no sampled token"):
        s.update(out, {})


def test_stats_describe_the_last_step():
    s = make_scheduler(8, Chunked(4), block_size=4, num_blocks=8)
    runner = FakeRunner(8, 4)
    s.add_request("A", [1, 2], 3)
    s.add_request("B", list(range(10)), 1)
    s.add_request("C", [1], 1)
    run_step(s, runner)  # A 0..2, B 0..4, C 0..1 (done)
    run_step(s, runner)  # A decodes; B 4..8
    st = s.stats()
    assert (st.step_decode_tokens, st.step_prefill_tokens, st.step_tokens) == (1, 4, 5)
    assert (st.num_requests_running, st.num_requests_waiting) == (2, 0)
    held = len(s.block_table("A")) + len(s.block_table("B"))
    assert st.num_free_blocks == 8 - held
    assert st.kv_cache_usage == pytest.approx(held / 8)
    assert st.num_preemptions == 0
