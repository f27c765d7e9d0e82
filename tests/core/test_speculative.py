"""Speculative decoding's pure parts: the n-gram index, the adaptive draft length, the counters, and one
scheduled step at a time: what drafts a decode gets under the budget, max_tokens and the KV pool."""

from __future__ import annotations

import random

import pytest

from mixserve.core import Chunked, ScheduleOutput, Scheduler
from mixserve.core.request import Request
from mixserve.core.speculative import (
    MIN_GAIN,
    NGRAM_MAX,
    NGRAM_MIN,
    PRIOR_RATE,
    PRIOR_TESTED,
    PROBE_AFTER,
    NgramIndex,
    SpecCounts,
    SpecStats,
    Speculation,
)
from tests.core.fake_runner import FakeRunner, make_scheduler, reference, run_step


def brute_propose(tokens: list[int], k: int) -> list[int]:
    """NgramIndex.propose by exhaustive search: the longest suffix (NGRAM_MAX..NGRAM_MIN) with an earlier
    occurrence, the latest of those, and what followed it, repeated with period (size - its end)."""
    size = len(tokens)
    for n in range(min(NGRAM_MAX, size), NGRAM_MIN - 1, -1):
        ends = [e for e in range(n, size) if tokens[e - n : e] == tokens[size - n :]]
        if ends and k > 0:
            end = ends[-1]
            return [tokens[end + j % (size - end)] for j in range(k)]
    return []


# ---- NgramIndex ------------------------------------------------------------------------------------


def test_the_longest_suffix_wins_over_a_later_shorter_match():
    tokens = [1, 2, 3, 4, 9, 8, 3, 4, 7, 6, 1, 2, 3, 4]  # (1,2,3,4) ends at 4; (3,4) also at 8 and 14
    assert NgramIndex().propose(tokens, 3) == tokens[4:7]
    assert NgramIndex().propose(tokens[:-2] + [3, 4], 2) == [9, 8]  # still the 4-gram, not (3,4) at 8


def test_the_latest_earlier_occurrence_is_followed():
    tokens = [5, 6, 1, 5, 6, 2, 5, 6]
    # (5,6) ends at 2 and at 5: the latest one is followed by 2, then the loop 2,5,6 of period 3
    assert NgramIndex().propose(tokens, 5) == [2, 5, 6, 2, 5]


@pytest.mark.parametrize("loop", [[7], [1, 2], [1, 2, 3], [4, 5, 6, 7, 8]])
def test_a_loop_continues_periodically_past_the_present(loop):
    tokens = loop * (2 + NGRAM_MAX // len(loop))
    assert NgramIndex().propose(tokens, 9) == [loop[j % len(loop)] for j in range(9)]


def test_nothing_without_a_match():
    assert NgramIndex().propose([1, 2, 3, 4, 5], 4) == []
    assert NgramIndex().propose([1, 2, 9, 1], 4) == []  # a one-token match is below NGRAM_MIN
    assert NgramIndex().propose([1, 2, 1, 2], 0) == []
    assert NgramIndex().propose([], 4) == [] and NgramIndex().propose([3], 4) == []


def test_the_suffix_never_matches_itself():
    for tokens in ([1, 2], [1, 2, 3], [4, 5, 6, 7], [4, 5, 6, 7, 8]):
        assert NgramIndex().propose(tokens, 4) == []
    index = NgramIndex()
    assert index.propose([1, 2], 4) == []  # indexed, but never offered to itself
    assert index.propose([1, 2, 3], 4) == []
    assert index.propose([1, 2, 3, 1, 2], 4) == [3, 1, 2, 3]


@pytest.mark.parametrize("seed", range(20))
def test_an_incremental_index_answers_like_a_fresh_one(seed):
    rng = random.Random(seed)
    tokens = [rng.randrange(rng.choice([2, 3, 6])) for _ in range(80)]
    index = NgramIndex()
    for size in range(1, len(tokens) + 1):
        k = rng.randint(0, 6)  # k = 0 still indexes
        got = index.propose(tokens[:size], k)
        assert got == NgramIndex().propose(tokens[:size], k) == brute_propose(tokens[:size], k), size


# ---- SpecStats ---------------------------------------------------------------------------------------


def prior_len(k: int) -> int:
    return max((n for n in range(k + 1) if PRIOR_RATE**n >= MIN_GAIN), default=0)


def test_a_fresh_request_drafts_what_the_prior_allows():
    for k in range(1, 10):
        assert SpecStats().draft_len(k) == prior_len(k)


def rejected_lengths(steps: int) -> list[int]:
    st = SpecStats()
    lengths = []
    for _ in range(steps):
        n = st.draft_len(4)
        lengths.append(n)
        if n:
            st.record(n, 0)
    return lengths


def test_rejections_shrink_the_draft_length():
    lengths = rejected_lengths(40)
    assert lengths[0] == prior_len(4)
    assert all(a >= b for a, b in zip(lengths, lengths[1:], strict=False)) and lengths[-1] < lengths[0]


def test_rejections_turn_drafting_off():
    assert 0 in rejected_lengths(200)


def test_after_probe_after_idle_steps_drafting_is_tried_again():
    # counts whose rate is under MIN_GAIN, and above it once halved
    threshold = PRIOR_RATE * PRIOR_TESTED / MIN_GAIN - PRIOR_TESTED
    st = SpecStats(accepted=0.0, tested=1.5 * threshold)
    assert [st.draft_len(4) for _ in range(PROBE_AFTER)] == [0] * PROBE_AFTER
    assert st.idle_steps == 0 and st.tested == pytest.approx(0.75 * threshold)
    assert st.draft_len(4) >= 1


def test_an_accepted_draft_resets_the_idle_count():
    threshold = PRIOR_RATE * PRIOR_TESTED / MIN_GAIN - PRIOR_TESTED
    st = SpecStats(accepted=0.0, tested=1.5 * threshold)
    for _ in range(PROBE_AFTER - 1):
        st.draft_len(4)
    st.record(1, 0)
    assert st.idle_steps == PROBE_AFTER - 1  # nothing accepted: still counting
    st.record(1, 1)
    assert st.idle_steps == 0


def test_drafts_are_cut_where_the_request_allows():
    seen = []

    def allowed(draft):  # a grammar's place: two more tokens of what was proposed
        seen.append(list(draft))
        return 2

    r = Request("a", [1, 2, 1, 2, 1, 2], 6, 8, spec=SpecStats(allowed=allowed))
    assert Speculation(4).propose(r, 4) == [1, 2]
    assert seen == [[1, 2, 1, 2]]
    r.spec.allowed = lambda draft: 0
    assert Speculation(4).propose(r, 4) == []
    assert Speculation(4).propose(Request("b", [1, 2, 1, 2, 1, 2], 6, 8), 4) == [1, 2, 1, 2]


def test_record_counts_the_first_rejected_draft_as_tested():
    st = SpecStats()
    st.record(4, 2)
    assert (st.accepted, st.tested) == (2.0, 3.0)
    st.record(2, 2)  # all kept: none rejected, none more tested
    assert (st.accepted, st.tested) == pytest.approx((0.9 * 2 + 2, 0.9 * 3 + 2))
    prior = PRIOR_TESTED * 0.9 ** 2  # the prior's weight decays with the counts
    assert st.prior_weight == pytest.approx(prior)
    assert st.rate == pytest.approx((st.accepted + PRIOR_RATE * prior) / (st.tested + prior))


def test_speculation_settings_and_limit():
    with pytest.raises(ValueError, match="method"):
        Speculation(4, "eagle")
    for bad in (0, -1, 2.0):
        with pytest.raises(ValueError, match="num_speculative_tokens"):
            Speculation(bad)
    r = Request("a", [1, 2, 3] * 3, 9, 20)
    assert Speculation(4).propose(r, 2) == [1, 2]
    assert Speculation(2).propose(r, 9) == [1, 2]
    assert Speculation(4).propose(r, 0) == []


def test_spec_counts_add():
    c = SpecCounts()
    for drafted, accepted in [(3, 1), (2, 2), (4, 0), (1, 1)]:
        c.add(drafted, accepted)
    assert (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens) == (4, 10, 4)
    assert c.accepted_per_pos == [3, 1, 0, 0]
    assert c.stats()["spec_accepted_per_pos"] == (3, 1, 0, 0)


# ---- one step of the scheduler ------------------------------------------------------------------------


def looped(rids: list[str], s: Scheduler, runner: FakeRunner) -> ScheduleOutput:
    """Run steps until every request of `rids` decodes in the same step; returns that step."""
    for _ in range(100):
        out, _ = run_step(s, runner)
        if sorted(out.decodes) == sorted(rids):
            return out
    raise AssertionError("the requests never decoded together")


def period3(prefix: list[int]) -> int:
    return prefix[-3] if len(prefix) >= 3 else 0  # every draft of a 3-loop is right


@pytest.mark.parametrize("budget", range(3, 18))
def test_a_tight_budget_leaves_drafts_what_every_decode_leaves(budget):
    s = make_scheduler(budget, Chunked(budget))
    runner = FakeRunner(s.cfg.num_blocks, s.cfg.block_size, period3)
    rids = [f"r{i}" for i in range(3)]
    for i, rid in enumerate(rids):
        s.add_request(rid, [10 * i + 1, 10 * i + 2, 10 * i + 3] * 2, 100)
    looped(rids, s, runner)
    s.with_speculation(Speculation(4))
    out, _ = run_step(s, runner)
    assert out.decodes == rids and out.chunks == []  # every decode first, whatever the drafts
    left, expected = budget - len(rids), {}
    for rid in rids:
        if (take := min(4, left)) > 0:
            expected[rid] = take
        left -= take
    assert {rid: len(d) for rid, d in out.drafts.items()} == expected
    assert out.num_tokens == min(budget, 5 * len(rids))
    for rid in rids:
        assert s.output(rid) == reference(s.tokens(rid)[:6], len(s.output(rid)), model=period3)


@pytest.mark.parametrize("max_tokens", range(1, 12))
@pytest.mark.parametrize("k", [1, 3, 4])
def test_drafts_never_take_a_decode_past_max_tokens(max_tokens, k):
    s = make_scheduler(64, speculation=Speculation(k))
    runner = FakeRunner(s.cfg.num_blocks, s.cfg.block_size, period3)
    s.add_request("a", [1, 2, 3] * 2, max_tokens)
    for _ in range(4 * max_tokens):  # bounded: a lost draft or row must not loop forever
        if not s.has_unfinished():
            break
        generated = len(s.output("a"))
        out, _ = run_step(s, runner)
        draft = out.drafts.get("a", ())
        assert generated + len(draft) + 1 <= max_tokens
        # all kept: a draft as long as k and max_tokens allow
        assert not out.decodes or len(draft) == min(k, max_tokens - generated - 1)
    assert s.output("a") == reference([1, 2, 3] * 2, max_tokens, model=period3)


def test_short_of_blocks_a_draft_is_cut_to_the_slots_held_and_preempts_nobody():
    # block_size 4: a's newest token at position 5 leaves slots 6, 7; b at 9 leaves 10, 11; no block free
    s = make_scheduler(64, Chunked(64), block_size=4, num_blocks=5)
    runner = FakeRunner(5, 4, period3)
    s.add_request("a", [1, 2, 3, 1, 2], 10)
    s.add_request("b", [4, 5, 6] * 3, 10)
    run_step(s, runner)  # both prefilled: a holds 2 blocks, b 3; they sample 3 and 4
    assert s.blocks.num_free() == 0
    s.with_speculation(Speculation(4))
    out, _ = run_step(s, runner)
    assert (out.decodes, out.preempted) == (["a", "b"], [])
    assert out.drafts == {"a": (1, 2), "b": (5, 6)}
    assert s.stats().num_preemptions == 0 and s.blocks.num_free() == 0


def prefill_then_decode(spec: Speculation | None) -> ScheduleOutput:
    """a decodes with a 4-token draft that needs a fifth block, b's next chunk needs one too: one is free."""
    s = make_scheduler(64, Chunked(4), block_size=4, num_blocks=5, speculation=spec)
    s.add_request("a", [1, 2, 3, 4, 1, 2, 3], 8)
    s.add_request("b", list(range(100, 112)), 1)
    s.update(s.schedule(), {})  # a 0..4, b 0..4
    s.update(s.schedule(), {"a": 4})  # a 4..7 (last: its 8th token), b 4..8
    return s.schedule()


def test_a_draft_never_causes_a_preemption():
    without = prefill_then_decode(None)
    assert without.preempted == [] and [c.request_id for c in without.chunks] == ["b"]
    spec = prefill_then_decode(Speculation(4))
    assert spec.preempted == without.preempted and spec.chunks == without.chunks
