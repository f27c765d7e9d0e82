"""`mixserve simulate --noise-from`: measured step-time noise read from target traces and replayed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mixserve.bench.simulate import SimSettings, simulate
from mixserve.bench.step_noise import MeasuredRun, StepNoise
from mixserve.bench.workload import RequestSpec, workload_m
from mixserve.cli import main
from mixserve.core.cost_model import CostCoefficients
from mixserve.core.step_drift import SPREAD_MIN_STEPS, SPREAD_WARMUP

COST = CostCoefficients(overhead_s=0.03, per_token_s=0.0012, per_pair_s=2e-8, per_seq_s=0.0005)


def write_trace(path: Path, rows: list[tuple[int, int, float, float | None]]) -> Path:
    """A step trace: (decode_tokens, prefill_tokens, duration_s, predicted_s) per line."""
    lines = []
    for i, (d, p, actual, predicted) in enumerate(rows):
        row = {"step": i, "decode_tokens": d, "prefill_tokens": p, "duration_s": actual}
        if predicted is not None:
            row["predicted_s"] = predicted
        lines.append(json.dumps(row))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_ratios_are_read_per_kind(tmp_path: Path):
    trace = write_trace(tmp_path / "a.steps.jsonl", [(4, 100, 0.5, 0.4), (4, 0, 0.09, 0.1), (0, 64, 0.2, 0.2),
                                                       (3, 50, 0.3, None)])
    noise = StepNoise.from_traces([trace])
    (run,) = noise.runs
    assert run.planned == (1.25,) and run.other == pytest.approx((0.9, 1.0))
    assert "1 planned steps" in noise.describe()


def test_a_replay_walks_one_run_in_order_from_a_seeded_point(tmp_path: Path):
    slow = write_trace(tmp_path / "slow.jsonl", [(4, 100, 0.4 * r, 0.4) for r in (1.1, 1.2, 1.3, 1.4)])
    quiet = write_trace(tmp_path / "quiet.jsonl", [(4, 100, 0.4 * r, 0.4) for r in (0.9, 0.95)] +
                        [(4, 0, 0.1, 0.1)])
    noise = StepNoise.from_traces([slow, quiet])
    walks = set()
    for seed in range(20):
        replay = noise.replay(seed)
        walk = tuple(round(replay.next(True), 6) for _ in range(8))
        walks.add(walk)
        run = next(r for r in noise.runs if walk[0] in [round(x, 6) for x in r.planned])
        n = len(run.planned)
        start = [round(x, 6) for x in run.planned].index(walk[0])
        assert list(walk) == [round(run.planned[(start + i) % n], 6) for i in range(8)]  # in order, wrapping
    assert len(walks) > 2  # seeds pick other runs and other points
    assert noise.replay(3).next(True) == noise.replay(3).next(True)


@pytest.mark.parametrize("rows, message", [([(4, 100, 0.5, None)], "no step with predicted_s"),
                                           ([(0, 10, 0.1, 0.1)], "no planned step")])
def test_unusable_traces_are_one_line(tmp_path: Path, rows, message: str):
    with pytest.raises(ValueError, match=message):
        StepNoise.from_traces([write_trace(tmp_path / "t.jsonl", rows)])
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(ValueError, match="bad.jsonl: line 1"):
        StepNoise.from_traces([tmp_path / "bad.jsonl"])


def test_noise_scales_each_step_and_is_seeded():
    # every request at once: the schedule does not depend on the clock, only the steps' times do
    specs = [RequestSpec(i, 0.0, [], 30 + 17 * i, 6 + i) for i in range(10)]
    settings = SimSettings(prefill_chunk=64, max_batch_tokens=256)
    plain = simulate(specs, COST, settings)
    doubled = simulate(specs, COST, settings, StepNoise.constant(2.0, 2.0))
    assert [s.duration_s for s in doubled.steps] == pytest.approx([2 * s.duration_s for s in plain.steps])
    noise = StepNoise((MeasuredRun((0.9, 1.0, 1.3, 1.2, 0.8), (0.8, 1.1, 1.05)),))
    a, b = simulate(specs, COST, settings, noise, seed=1), simulate(specs, COST, settings, noise, seed=1)
    c = simulate(specs, COST, settings, noise, seed=2)
    assert a.steps == b.steps and a.steps != c.steps


def test_the_margin_keeps_a_noisy_target_within_it():
    """Every planned step runs 1.25x its prediction: once the spread has seen enough of them, the budget
    sizes planned steps so that even so they stay within the target (without a margin: 1.25x over it)."""
    specs = workload_m(num_short=24, short_rate=2.0, long_input_len=1500, seed=1)
    settings = SimSettings(max_batch_tokens=2048, tpot_target_ms=300)
    run = simulate(specs, COST, settings, StepNoise.constant(1.25, 1.0))
    planned = [s for s in run.steps if s.decode_tokens and s.prefill_tokens]
    known = SPREAD_WARMUP + SPREAD_MIN_STEPS
    assert len(planned) > 2 * known
    late = planned[known:]
    assert max(s.duration_s for s in late) <= 0.3 + 1e-9
    assert max(s.duration_s for s in planned[:known]) > 0.3  # before it knew: over the target
    assert sum(s.duration_s > 0.28 for s in late) > 3  # and it still fills the steps it sizes


def test_cli_replays_seeds(tmp_path: Path, capsys):
    cost = tmp_path / "cost.json"
    cost.write_text(json.dumps({"overhead_s": 0.03, "per_token_s": 0.0012, "per_pair_s": 2e-8}))
    trace = write_trace(tmp_path / "t.steps.jsonl", [(4, 100, r, 0.4) for r in (0.3, 0.4, 0.5, 0.6)])
    argv = ["simulate", "--cost-model", str(cost), "--num-requests", "8", "--tpot-target-ms", "300",
            "--max-batch-tokens", "2048"]
    assert main(argv + ["--seeds", "3"]) == 2
    assert "needs --noise-from" in capsys.readouterr().err
    out = tmp_path / "r.json"
    assert main(argv + ["--noise-from", str(trace), "--seeds", "3", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "noise seed 2:" in text and "over 3 seeds: stalled none in" in text
    assert [r["seed"] for r in json.loads(out.read_text())["noise"]["seeds"]] == [0, 1, 2]
