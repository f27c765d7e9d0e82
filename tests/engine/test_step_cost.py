"""The engine with a TPOT target: start-up profile, online fit, trace fields, the cost model file, and the
limits on partial prefills passed through from the config."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from mixserve.config import ConfigError, add_engine_flags, config_from_args, load_config
from mixserve.core.cost_model import StepCostModel
from mixserve.engine import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def prompts(n: int) -> list[list[int]]:
    return [[(7 * i + j) % 50 + 3 for j in range(5 + 9 * i)] for i in range(n)]


def test_target_profiles_fits_traces_and_writes_the_model(make_llm, tmp_path: Path) -> None:
    trace, cost = tmp_path / "steps.jsonl", tmp_path / "cost.json"
    llm = make_llm(tpot_target_ms=400, cost_model=str(cost), step_trace=str(trace), max_batch_tokens=64)
    sc = llm.engine.step_cost
    assert sc.profiled > 0 and sc.model.num_samples == sc.profiled  # seeded before any request
    assert trace.read_text() == ""  # the profile does not go through the step trace
    ps = prompts(4)
    outs = llm.generate(ps, GREEDY)
    plain = make_llm(prefill_chunk=4, max_batch_tokens=64).generate(ps, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]  # chunking never changes tokens
    llm.engine.close()
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert lines and all(line["predicted_s"] >= 0 and len(line["cost_model"]) == 6 for line in lines)
    saved = StepCostModel.load(cost)
    assert saved.num_samples == sc.profiled + len(lines)  # it went on learning from the real steps
    assert saved.coefficients.as_list() == pytest.approx(sc.model.coefficients.as_list())
    again = make_llm(tpot_target_ms=400, cost_model=str(cost), max_batch_tokens=64).engine.step_cost
    assert again.profiled == 0 and again.model.num_samples == saved.num_samples  # the file is the seed


def test_target_off_neither_profiles_nor_predicts(make_llm, tmp_path: Path) -> None:
    trace = tmp_path / "steps.jsonl"
    llm = make_llm(step_trace=str(trace), max_batch_tokens=64)
    assert llm.engine.step_cost.profiled == 0 and llm.engine.scheduler.step_budget is None
    llm.generate(prompts(2), GREEDY)
    llm.engine.close()
    assert all("predicted_s" not in json.loads(line) for line in trace.read_text().splitlines())
    assert llm.engine.step_cost.model.num_samples > 0  # still learning: serve writes it for simulate


def test_with_a_target_prefill_chunk_does_not_cap_a_chunk(make_llm, tmp_path: Path) -> None:
    trace = tmp_path / "steps.jsonl"
    llm = make_llm(tpot_target_ms=1e6, prefill_chunk=4, max_batch_tokens=64, step_trace=str(trace))
    llm.generate([list(range(3, 33))], GREEDY)  # 30 tokens: alone, with no decodes, budget 64
    llm.engine.close()
    first = json.loads(trace.read_text().splitlines()[0])
    assert first["prefill_tokens"] == 30


def test_partial_prefill_limits_reach_the_scheduler(make_llm) -> None:
    llm = make_llm(max_partial_prefills=2, long_prefill_threshold=100, max_long_partial_prefills=1)
    cfg = llm.engine.scheduler.cfg
    limits = (cfg.max_partial_prefills, cfg.long_prefill_threshold, cfg.max_long_partial_prefills)
    assert limits == (2, 100, 1)
    outs = llm.generate(prompts(5), GREEDY)
    assert all(len(o.token_ids) == 6 for o in outs)


def test_flags_and_config_errors(tmp_path: Path) -> None:
    p = argparse.ArgumentParser()
    add_engine_flags(p)
    args = p.parse_args(["--tpot-target-ms", "400", "--max-partial-prefills", "2", "--cost-model", "c.json"])
    cfg = config_from_args(args).engine
    assert (cfg.tpot_target_ms, cfg.max_partial_prefills, cfg.cost_model) == (400.0, 2, "c.json")
    with pytest.raises(ConfigError, match="--tpot-target-ms: must be a number"):
        config_from_args(p.parse_args(["--tpot-target-ms", "fast"]))
    with pytest.raises(ConfigError, match="tpot_target_ms: must be >= 0"):
        load_config(None, {"tpot_target_ms": -1})
    with pytest.raises(ConfigError, match="max_long_partial_prefills"):
        load_config(None, {"max_long_partial_prefills": -2})
    assert load_config("runtime.toml").engine.tpot_target_ms == 0
    assert config_from_args(p.parse_args(["--waiting-share", "0"])).engine.waiting_share == 0
    with pytest.raises(ConfigError, match="waiting_share: must be <= 1"):
        load_config(None, {"waiting_share": 1.5})


def test_the_engine_hands_its_waiting_share_to_the_scheduler(make_llm) -> None:
    llm = make_llm(tpot_target_ms=400, max_batch_tokens=64, waiting_share=0.5)
    assert llm.engine.scheduler.waiting_share == 0.5 and llm.engine.scheduler.step_budget is not None


def test_metrics_show_the_cost_model_while_a_target_is_on(make_llm) -> None:
    from mixserve.metrics import ServerMetrics

    llm = make_llm(tpot_target_ms=400, max_batch_tokens=64)
    llm.generate(prompts(2), GREEDY)
    m = ServerMetrics()
    m.observe_stats(llm.engine.stats().scheduler, stepped=True)
    text = m.render()[0].decode()
    model = llm.engine.step_cost.model
    assert f"mixserve:step_cost_actual_seconds {model.last_actual_s}" in text
    assert f"mixserve:step_cost_predicted_seconds {model.last_predicted_s}" in text
    assert 'mixserve:step_cost_coefficient{term="per_token_s"}' in text
    assert f'mixserve:step_cost_coefficient{{term="per_seq_s"}} {model.coefficients.per_seq_s}' in text
    assert "mixserve:step_cost_actual_over_predicted_count 1.0" in text
    assert f"mixserve:step_cost_drift {model.drift}" in text
    assert f"mixserve:step_cost_margin {model.step_drift.margin}" in text
    off = ServerMetrics()
    off.observe_stats(make_llm(max_batch_tokens=64).engine.stats().scheduler, stepped=True)
    assert 'step_cost_coefficient{' not in off.render()[0].decode()


def test_the_trace_counts_garbage_collection_between_lines(tmp_path: Path) -> None:
    import gc

    from mixserve.engine.step_trace import StepTrace

    trace = StepTrace(str(tmp_path / "steps.jsonl"))
    gc.disable()  # no automatic collection between the lines: only the one asked for
    try:
        trace.write(1, 0.0, 1, 1, 1, 0.01, {})
        gc.collect()  # a full collection of this test process: well over a microsecond
        trace.write(2, 0.0, 1, 1, 1, 0.01, {})
        trace.write(3, 0.0, 1, 1, 1, 0.01, {})
    finally:
        gc.enable()
        trace.close()
    gcs = [json.loads(line)["gc_s"] for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert gcs[1] > 0 and gcs[2] == 0  # the collection lands on the line after it, once
    assert trace._gc._on_gc not in gc.callbacks  # closed: no callback left behind
