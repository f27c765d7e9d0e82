"""`mixserve simulate`: deterministic on a fixed cost model, the bench's report, its inputs and errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mixserve.bench.simulate import SimSettings, load_requests, simulate
from mixserve.bench.workload import RequestSpec, workload_m
from mixserve.cli import main
from mixserve.core.cost_model import CostCoefficients, StepCostModel, StepFeatures, attended_pairs
from mixserve.core.waiting_share import WAITING_SHARE

COST = CostCoefficients(overhead_s=0.03, per_token_s=0.0012, per_pair_s=2e-8)


def small_m() -> list[RequestSpec]:
    return workload_m(num_short=12, short_rate=1.0, long_input_len=600, seed=3)


def test_simulate_is_deterministic_and_times_steps_by_the_model():
    specs = small_m()
    a = simulate(specs, COST, SimSettings(prefill_chunk=64, max_batch_tokens=256))
    b = simulate(specs, COST, SimSettings(prefill_chunk=64, max_batch_tokens=256))
    assert [r.token_times for r in a.results] == [r.token_times for r in b.results]
    assert a.duration_s == b.duration_s and a.steps == b.steps
    assert all(r.ok and len(r.token_times) == r.output_len for r in a.results)
    for s in a.steps:  # each step lasts what the model predicts, and they follow one another
        assert s.duration_s >= COST.overhead_s + COST.per_token_s * (s.decode_tokens + s.prefill_tokens)
    pairs = zip(a.steps, a.steps[1:], strict=False)
    assert all(x.start_s + x.duration_s <= y.start_s + 1e-9 for x, y in pairs)


def test_one_request_alone_takes_what_the_model_says():
    spec = RequestSpec(0, 0.0, [], 100, 3)
    run = simulate([spec], COST, SimSettings(prefill_chunk=0, max_batch_tokens=512))
    prefill = COST.predict(StepFeatures(100, attended_pairs(0, 100)))
    decode1 = COST.predict(StepFeatures(1, 101))
    decode2 = COST.predict(StepFeatures(1, 102))
    expected = [prefill, prefill + decode1, prefill + decode1 + decode2]
    assert run.results[0].token_times == pytest.approx(expected)


def test_a_decode_step_costs_its_sequences_as_the_engine_measures_them(tmp_path: Path):
    """The engine's step time grows with its rows (sampling, detokenizing): a cost model file with
    per_seq_s makes simulated decode-only steps longer with every stream, as measured steps are; a file
    from before per_seq_s (no such key) simulates as it did."""
    specs = [RequestSpec(i, 0.0, [], 50, 20) for i in range(8)]
    per_seq = CostCoefficients(overhead_s=0.03, per_token_s=0.0012, per_pair_s=2e-8, per_seq_s=0.002)
    run = simulate(specs, per_seq, SimSettings(prefill_chunk=0, max_batch_tokens=512))
    decode = [s for s in run.steps if s.prefill_tokens == 0]
    assert decode and all(s.decode_tokens == 8 for s in decode)
    assert decode[0].duration_s == pytest.approx(COST.predict(StepFeatures(8, 8 * 51)) + 8 * 0.002)
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"overhead_s": 0.03, "per_token_s": 0.0012, "per_pair_s": 2e-8}))
    old = simulate(specs, StepCostModel.load(path).coefficients, SimSettings(prefill_chunk=0,
                                                                              max_batch_tokens=512))
    assert old.steps == simulate(specs, COST, SimSettings(prefill_chunk=0, max_batch_tokens=512)).steps


def test_the_target_keeps_every_gap_within_it_and_chunks_more_than_prefill_chunk():
    specs = small_m()
    fixed = simulate(specs, COST, SimSettings(prefill_chunk=0, max_batch_tokens=2048))
    target = simulate(specs, COST, SimSettings(prefill_chunk=16, max_batch_tokens=2048, tpot_target_ms=250))
    gaps = [g for r in target.results for g in r.gaps]
    assert max(gaps) <= 0.25 + 1e-9 < max(g for r in fixed.results for g in r.gaps)
    assert max(s.prefill_tokens for s in target.steps) > 16


def test_waiting_share_reaches_the_scheduler():
    """--waiting-share (EngineConfig.waiting_share) is the simulated scheduler's: 0 keeps the short prompts
    that arrive during a long prompt's prefill behind its chunks, a share lets those that fit go first."""
    specs = workload_m(num_short=24, short_rate=2.0, long_input_len=1500, seed=1)
    ahead = {}
    for share in (0.0, WAITING_SHARE):
        settings = SimSettings(max_batch_tokens=2048, tpot_target_ms=500, waiting_share=share)
        run = simulate(specs, COST, settings)
        longs = [r for r in run.results if r.kind == "long"]
        ahead[share] = sum(1 for r in run.results if r.kind == "short" for x in longs
                           if x.start < r.start and r.token_times[0] < x.token_times[0])
    assert ahead[0.0] == 0 < ahead[WAITING_SHARE]
    assert SimSettings().waiting_share == WAITING_SHARE


def test_cli_prints_the_bench_report(tmp_path: Path, capsys):
    cost = tmp_path / "cost.json"
    cost.write_text(json.dumps({"overhead_s": 0.03, "per_token_s": 0.0012, "per_pair_s": 2e-8}))
    reqs = tmp_path / "reqs.jsonl"
    reqs.write_text("\n".join(json.dumps({"arrival_s": i * 0.1, "prompt_len": 40 + i, "output_len": 5,
                                          "kind": "long" if i == 2 else "short"}) for i in range(5)))
    out = tmp_path / "report.json"
    argv = ["simulate", "--cost-model", str(cost), "--requests", str(reqs), "--out", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "[short] max gap (ms), stalled" in text and "[long] TTFT p50/p99 (ms)" in text
    report = json.loads(out.read_text())
    assert report["completed"] == 5 and report["settings"]["simulated"] is True
    assert main(argv) == 0 and json.loads(out.read_text())["requests"] == report["requests"]


@pytest.mark.parametrize("line, message", [('{"arrival_s": 0}', "line 1: needs"),
                                           ('{"arrival_s": 0, "prompt_len": 0, "output_len": 1}', ">= 1")])
def test_bad_requests_file_is_one_line(tmp_path: Path, line: str, message: str):
    path = tmp_path / "r.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ValueError, match=message):
        load_requests(path)


def test_cli_errors_are_one_line(tmp_path: Path, capsys):
    assert main(["simulate"]) == 2
    assert "--cost-model FILE is required" in capsys.readouterr().err
    assert main(["simulate", "--cost-model", str(tmp_path / "nope.json")]) == 2
    err = capsys.readouterr().err
    assert "nope.json" in err and err.count("\n") == 1
