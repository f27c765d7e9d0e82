"""The draft gate: drafts where they are measured to pay, per bucket of decodes, the other mode probed."""

from __future__ import annotations

from mixserve.core.draft_gate import MAX_PROBE_EVERY, PROBE_EVERY, DraftGate
from mixserve.core.speculative import Speculation
from tests.core.fake_runner import FakeRunner, looping_token, make_scheduler, run_step


def probes(steps: int) -> list[int]:
    """The steps (1-based) of `steps` that probe a loser that keeps losing: its first two measure either
    mode, then the waits double from PROBE_EVERY up to MAX_PROBE_EVERY."""
    at, wait, out = 2, PROBE_EVERY, []
    while at + wait <= steps:
        at += wait
        out.append(at)
        wait = min(2 * wait, MAX_PROBE_EVERY)
    return out


def settle(gate: DraftGate, decodes: int, with_rate: float, without_rate: float, steps: int) -> list[bool]:
    """Run `steps` decode-only steps whose tokens/s depend on the mode the gate picks; its choices."""
    choices = []
    for _ in range(steps):
        drafted = gate.allows(decodes)
        choices.append(drafted)
        gate.observe(decodes, drafted, 100, 100 / (with_rate if drafted else without_rate))
    return choices


def test_drafts_first_then_a_baseline_then_the_faster_mode() -> None:
    gate = DraftGate()
    choices = settle(gate, 1, with_rate=180.0, without_rate=90.0, steps=4 * PROBE_EVERY)
    assert choices[:2] == [True, False]  # drafts tried, then one step without for a baseline
    assert [i + 1 for i, c in enumerate(choices) if not c][1:] == probes(len(choices))  # the probes only
    assert gate.rates()[(1, False)] == (90.0, 180.0)


def test_where_drafts_lose_they_are_off_but_for_the_probes() -> None:
    gate = DraftGate()
    choices = settle(gate, 16, with_rate=100.0, without_rate=130.0, steps=40 * PROBE_EVERY)
    assert [i + 1 for i, c in enumerate(choices) if c][1:] == probes(len(choices))
    assert len(probes(len(choices))) < len(choices) // PROBE_EVERY // 3  # each confirming probe waits longer


def test_a_change_of_winner_brings_the_probes_back_to_their_first_wait() -> None:
    gate = DraftGate()
    settle(gate, 4, with_rate=100.0, without_rate=130.0, steps=20 * PROBE_EVERY)  # waits grown
    choices = settle(gate, 4, with_rate=300.0, without_rate=130.0, steps=2 * MAX_PROBE_EVERY)
    first = choices.index(True)  # the probe that finds drafts now win turns them on
    assert first >= PROBE_EVERY  # it waited longer than the first wait
    off = [i for i, c in enumerate(choices) if not c and i > first]
    assert off[:2] == [first + PROBE_EVERY, first + 3 * PROBE_EVERY]  # the new loser's probes: 16, then 32


def test_buckets_are_separate_and_a_change_is_followed() -> None:
    gate = DraftGate()
    settle(gate, 1, 200.0, 100.0, 40)
    settle(gate, 16, 100.0, 150.0, 40)
    assert settle(gate, 3, 100.0, 150.0, 2) == [True, False]  # 2-3 decodes: a bucket of its own, new
    # one stream's drafts stop paying (e.g. nothing left to copy): the probes see it, the gate turns
    choices = settle(gate, 1, 50.0, 100.0, 20 * PROBE_EVERY)
    assert choices[-PROBE_EVERY:].count(True) <= 1


def test_steps_with_chunks_are_measured_apart() -> None:
    gate = DraftGate()
    settle(gate, 1, 200.0, 100.0, 40)  # decode-only: drafts win
    choices = []
    for _ in range(40):  # beside chunks they lose
        drafted = gate.allows(1, chunks=True)
        choices.append(drafted)
        gate.observe(1, drafted, 100, 100 / (80.0 if drafted else 120.0), chunks=True)
    assert [i + 1 for i, c in enumerate(choices) if c][1:] == probes(len(choices))
    assert gate.allows(1) or gate.allows(1)


def test_bad_observations_are_ignored() -> None:
    gate = DraftGate()
    gate.observe(0, True, 5, 1.0)
    gate.observe(4, True, 5, 0.0)
    assert gate.rates() == {}
    assert gate.allows(4)


def test_the_scheduler_books_no_drafts_where_the_gate_measured_them_losing() -> None:
    spec = Speculation(4)
    s = make_scheduler(64, speculation=spec)
    s.add_request("a", [1, 2, 3, 4, 5] * 4, 200)
    runner = FakeRunner(s.cfg.num_blocks, s.cfg.block_size, model=looping_token)
    assert any(run_step(s, runner)[0].drafts for _ in range(20))  # nothing measured yet: drafts tried
    spec.gate.observe(1, True, 10, 1.0)
    spec.gate.observe(1, False, 10, 0.5)  # without drafts twice as fast
    drafted = sum(bool(run_step(s, runner)[0].drafts) for _ in range(2 * PROBE_EVERY))
    assert drafted <= 2  # the probes at most
