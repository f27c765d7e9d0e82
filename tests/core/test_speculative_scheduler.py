"""Speculation through the scheduler and the fake runner, end to end: greedy outputs equal the unbatched
reference token for token, whatever the budget, the policy, the KV pressure or the prefix cache; every
step keeps to its budget and max_tokens; rejected drafts' slots are never read as valid (the runner
checks every slot it reads) and their blocks come back; the counters add up; update() takes back only
the kept drafts then one token."""

from __future__ import annotations

import math
import random

import pytest

from mixserve.core import Chunked, PrefixCachingPool, ScheduleOutput, Scheduler, WholePrompt
from mixserve.core.request import Status
from mixserve.core.speculative import SpecStats, Speculation
from tests.core.fake_runner import Trace, drive, looping_token, make_scheduler, next_token, reference

MODELS = {"looping": looping_token, "hash": next_token}  # drafts often right / almost never right


def repeating(i: int, length: int) -> list[int]:
    loop = [100 + 7 * i + j for j in range(3 + i % 3)]
    return [loop[j % len(loop)] for j in range(length)]


def distinct(i: int, length: int) -> list[int]:
    rng = random.Random(i)
    return [rng.randrange(1000) for _ in range(length)]


class Checker:
    """Per step: the budget, max_tokens, exactly the blocks the kept tokens need after a rejection, and
    the pool against the block tables (no block leaked or held twice)."""

    def __init__(self, rids: list[str]) -> None:
        self.rids = rids
        self.before: dict[str, int] = {}  # each request's token count when the step was scheduled
        self.rejections = 0  # speculating decodes that kept fewer than all their drafts

    def __call__(self, s: Scheduler, out: ScheduleOutput) -> None:
        alone = not out.decodes and len(out.chunks) == 1  # only a prompt alone may exceed the budget
        assert out.num_tokens <= s.cfg.max_batch_tokens or alone, out
        assert set(out.drafts) <= set(out.decodes) and all(out.drafts.values())
        assert s.stats().step_decode_tokens == len(out.decodes) + out.num_draft_tokens
        bs = s.cfg.block_size
        for rid, draft in out.drafts.items():
            r = s.request(rid)
            n = self.before[rid]
            assert n - r.prompt_len + len(draft) + 1 <= r.max_tokens, (rid, n, draft)
            kept = len(r.tokens) - n - 1
            assert 0 <= kept <= len(draft) and r.tokens[n : n + kept] == list(draft[:kept])
            if kept < len(draft):
                self.rejections += 1
                if r.status is Status.RUNNING:
                    assert len(r.block_table) == math.ceil(len(r.tokens) / bs), (rid, r.block_table)
        live = [s.request(rid) for rid in self.rids if self._known(s, rid)]
        for r in live:
            if r.status is Status.RUNNING:
                assert len(r.block_table) <= math.ceil(len(r.tokens) / bs)
            else:
                assert r.block_table == []
        pool = s.blocks
        pool.check()
        if isinstance(pool, PrefixCachingPool):
            counts: dict[int, int] = {}
            for b in (b for r in live for b in r.block_table):
                counts[b] = counts.get(b, 0) + 1
            assert all(pool.refs(b) == counts.get(b, 0) for b in range(pool.num_blocks))
        else:
            held = [b for r in live for b in r.block_table]
            assert len(held) == len(set(held)) == pool.num_held()
        self.before = {r.request_id: len(r.tokens) for r in live}

    @staticmethod
    def _known(s: Scheduler, rid: str) -> bool:
        try:
            s.request(rid)
        except KeyError:
            return False  # not arrived yet, or aborted
        return True


SPEC = Speculation(4)


def run(s: Scheduler, arrivals: dict, model, spec: Speculation | None = SPEC, aborts=None,
        rids: list[str] | None = None) -> tuple[Trace, Checker]:
    check = Checker(rids or [rid for reqs in arrivals.values() for rid, _, _ in reqs])
    trace = drive(s, arrivals, aborts, check_step=check, speculation=spec, model=model)
    assert s.stats().num_free_blocks == s.cfg.num_blocks and s.stats().kv_cache_usage == 0.0
    return trace, check


def expected(arrivals: dict, model, skip=()) -> dict[str, list[int]]:
    return {rid: reference(p, m, model=model) for reqs in arrivals.values() for rid, p, m in reqs
            if rid not in skip}


def check_counts(s: Scheduler, trace: Trace, k: int) -> None:
    """The SchedulerStats speculation counters against the trace (no aborts: every draft was verified)."""
    st = s.stats()
    per_pos = st.spec_accepted_per_pos
    assert st.spec_num_drafts == sum(len(o.drafts) for o in trace.steps)
    assert st.spec_num_draft_tokens == sum(o.num_draft_tokens for o in trace.steps)
    assert 0 <= st.spec_num_accepted_tokens <= st.spec_num_draft_tokens
    assert len(per_pos) <= k and all(a >= b for a, b in zip(per_pos, per_pos[1:], strict=False))
    assert sum(per_pos) == st.spec_num_accepted_tokens
    # every token generated was sampled on a row (a decode's, a last chunk's) or is a kept draft
    rows = sum(len(o.decodes) + sum(c.last for c in o.chunks) for o in trace.steps)
    assert sum(len(out) for out in trace.outputs.values()) == rows + st.spec_num_accepted_tokens


POLICIES = {"whole": WholePrompt(), "chunk16": Chunked(16), "chunk256": Chunked(256)}


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("budget", [6, 24, 300])
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("prompts", [repeating, distinct])
def test_outputs_equal_the_reference(policy, budget, model, prompts):
    arrivals = {i: [(f"r{i}", prompts(i, 5 + 9 * i), 12 + 5 * i)] for i in range(6)}
    s = make_scheduler(budget, POLICIES[policy], block_size=4)
    trace, check = run(s, arrivals, MODELS[model])
    assert trace.outputs == expected(arrivals, MODELS[model])
    check_counts(s, trace, 4)
    if model == "looping":  # drafts are accepted and rejected, and (budget to spare) save steps
        assert s.stats().spec_num_accepted_tokens > 0 and check.rejections > 0
        no_spec = drive(make_scheduler(budget, POLICIES[policy], block_size=4), arrivals, model=looping_token)
        assert no_spec.outputs == trace.outputs
        if budget >= 24:
            assert len(trace.steps) < len(no_spec.steps)


@pytest.mark.parametrize("k", [1, 2, 7])
def test_any_number_of_drafts_gives_the_reference(k):
    arrivals = {0: [(f"r{i}", repeating(i, 4 + 3 * i), 30) for i in range(4)]}
    s = make_scheduler(16, Chunked(8), block_size=2)
    trace, check = run(s, arrivals, looping_token, Speculation(k))
    assert trace.outputs == expected(arrivals, looping_token)
    assert max(len(d) for o in trace.steps for d in o.drafts.values()) == k
    check_counts(s, trace, k)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("model", MODELS)
def test_kv_pressure_preempts_and_still_gives_the_reference(policy, model):
    arrivals: dict[int, list] = {}
    for i in range(12):
        arrivals.setdefault(i // 3, []).append((f"r{i}", repeating(i, 6 + 2 * i), 24))
    need = max(len(p) + m for reqs in arrivals.values() for _, p, m in reqs)
    s = make_scheduler(32, POLICIES[policy], block_size=4, num_blocks=math.ceil(need / 4) + 3)
    trace, check = run(s, arrivals, MODELS[model])
    assert trace.outputs == expected(arrivals, MODELS[model])
    assert s.stats().num_preemptions > 0
    assert check.rejections > 0 or model == "hash"  # the hash model's text seldom repeats: few drafts
    check_counts(s, trace, 4)


@pytest.mark.parametrize("seed", range(40))
def test_random_workloads_with_aborts_give_the_reference(seed):
    rng = random.Random(seed)
    beta = rng.randint(2, 24)
    policy = WholePrompt() if rng.random() < 0.3 else Chunked(rng.randint(1, 2 * beta))
    block_size = rng.choice([1, 2, 4, 8])
    make = [repeating, distinct]
    requests = [(f"r{i}", rng.choice(make)(seed * 10 + i, rng.randint(1, 3 * beta)), rng.randint(1, 16))
                for i in range(rng.randint(1, 10))]
    num_blocks = max(math.ceil((len(p) + m) / block_size) for _, p, m in requests) + rng.randint(0, 3)
    arrivals: dict[int, list] = {}
    for req in requests:
        arrivals.setdefault(rng.randint(0, 10), []).append(req)
    aborts: dict[int, list[str]] = {}
    for at, reqs in arrivals.items():
        for rid, _, _ in reqs:
            if rng.random() < 0.15:
                aborts.setdefault(at + rng.randint(0, 6), []).append(rid)
    s = make_scheduler(beta, policy, block_size=block_size, num_blocks=num_blocks,
                       max_num_seqs=rng.randint(1, 8))
    trace, _ = run(s, arrivals, looping_token, Speculation(rng.randint(1, 6)), aborts)
    aborted = {rid for rids in aborts.values() for rid in rids}
    want = expected(arrivals, looping_token, skip=aborted)
    assert {rid: out for rid, out in trace.outputs.items() if rid not in aborted} == want, f"seed {seed}"


def test_a_request_that_allows_no_draft_never_drafts_among_others_that_do():
    s = make_scheduler(64, Chunked(16), block_size=4)
    arrivals = {0: [("off", repeating(0, 12), 20), ("on", repeating(1, 12), 20)]}
    for rid, prompt, m in arrivals[0]:
        s.add_request(rid, prompt, m)
    s.request("off").spec = SpecStats(allowed=lambda draft: 0)  # a grammar that refuses every draft
    trace, _ = run(s, {}, looping_token, rids=["off", "on"])
    assert all("off" not in o.drafts for o in trace.steps) and any("on" in o.drafts for o in trace.steps)
    assert trace.outputs == expected(arrivals, looping_token)


@pytest.mark.parametrize("num_blocks", [1024, 14])
@pytest.mark.parametrize("policy", [Chunked(4), Chunked(64), WholePrompt()])
def test_prefix_caching_with_speculation(num_blocks, policy):
    prompt = repeating(2, 21)
    arrivals = {0: [("a", prompt, 20)], 60: [("b", prompt, 20), ("c", prompt[:13] + [5, 6], 10)]}
    s = make_scheduler(32, policy, block_size=4, num_blocks=num_blocks, prefix_caching=True)
    assert isinstance(s.blocks, PrefixCachingPool)
    trace, check = run(s, arrivals, looping_token)
    assert trace.outputs == expected(arrivals, looping_token)
    st = s.stats()
    # b finds a's prompt (all but the block with its last token), c the first 3 blocks of it
    assert st.prefix_cache_hits >= (len(prompt) - 1) // 4 * 4 + 12
    assert st.spec_num_accepted_tokens > 0 and check.rejections > 0
    check_counts(s, trace, 4)


def test_blocks_filled_by_kept_drafts_are_cached():
    prompt = repeating(0, 9)
    a = prompt + reference(prompt, 40, model=looping_token)  # b's prompt: all of a, once a is done
    s = make_scheduler(64, Chunked(64), block_size=4, prefix_caching=True)
    trace, _ = run(s, {0: [("a", prompt, 40)], 60: [("b", a, 5)]}, looping_token)
    assert trace.outputs == {"a": a[len(prompt) :], "b": reference(a, 5, model=looping_token)}
    assert trace.steps[59].decodes == [] and s.stats().spec_num_accepted_tokens > 0
    # b finds every full block a computed, drafts' ones too; each full computed block is cached once
    st = s.stats()
    assert st.prefix_cache_hits == (len(a) - 1) // 4 * 4
    assert st.num_cached_blocks == (len(a) + 5 - 1) // 4


# ---- update() ---------------------------------------------------------------------------------------


def drafting() -> tuple[Scheduler, ScheduleOutput]:
    s = make_scheduler(64, speculation=Speculation(3))
    s.add_request("a", [1, 2, 3] * 2, 20)
    s.add_request("b", [9, 8, 7, 6], 20)
    s.update(s.schedule(), {"a": 1, "b": 5})
    out = s.schedule()
    assert out.drafts == {"a": (2, 3, 1)} and out.decodes == ["a", "b"]
    return s, out


@pytest.mark.parametrize("bad", [[], [3, 0], [2, 2, 0], [2, 3, 1, 2, 0], [0, 3, 1, 5]])
def test_update_refuses_a_list_that_does_not_begin_with_the_drafts(bad):
    s, out = drafting()
    with pytest.raises(ValueError, match="prefix of its drafts"):
        s.update(out, {"a": bad, "b": 4})


@pytest.mark.parametrize("good", [7, [7], [2, 7], [2, 3, 7], [2, 3, 1, 7]])
def test_update_takes_the_kept_drafts_then_the_next_token(good):
    s, out = drafting()
    s.update(out, {"a": good, "b": 4})
    sent = good if isinstance(good, list) else [good]
    assert s.output("a") == [1, *sent] and s.output("b") == [5, 4]
    assert s.request("a").num_computed == len(s.tokens("a")) - 1  # ready to decode its newest token
    assert len(s.block_table("a")) == -(-len(s.tokens("a")) // s.cfg.block_size)


def test_update_refuses_several_tokens_for_a_decode_without_drafts():
    s, out = drafting()
    with pytest.raises(ValueError):
        s.update(out, {"a": 7, "b": [4, 5]})
