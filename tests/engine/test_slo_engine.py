"""The engine in the SLO mode (`slo_ttft_ms`, `slo_tpot_ms`): the same tokens as without it, the step trace
says each step's limit and mode, the stats and /metrics count what was given up, and the flags parse."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from mixserve.config import ConfigError, add_engine_flags, config_from_args
from mixserve.core.slo import SloBudget
from mixserve.core.tpot_budget import TpotBudget
from mixserve.engine import SamplingParams
from mixserve.metrics import ServerMetrics

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def prompts(n: int) -> list[list[int]]:
    return [[(5 * i + j) % 50 + 3 for j in range(4 + 11 * i)] for i in range(n)]


def test_slo_mode_keeps_the_tokens_and_traces_limit_and_mode(make_llm, tmp_path: Path) -> None:
    """Scheduling to an SLO changes when tokens come, never which: greedy output equals a plain run's."""
    trace = tmp_path / "steps.jsonl"
    llm = make_llm(slo_ttft_ms=2000, slo_tpot_ms=200, max_batch_tokens=64, step_trace=str(trace))
    budget = llm.engine.scheduler.step_budget
    assert isinstance(budget, SloBudget) and llm.engine.scheduler.slo is budget
    assert budget.targets.ttft_s == 2.0 and budget.targets.tpot_s == 0.2
    ps = prompts(4)
    outs = llm.generate(ps, GREEDY)
    plain = make_llm(prefill_chunk=8, max_batch_tokens=64).generate(ps, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    llm.engine.close()
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert lines and all(line["mode"] in ("mixed", "decode-only", "prefill-only") for line in lines)
    limits = [line["slo_limit_s"] for line in lines if line["slo_limit_s"] is not None]
    assert limits and all(0 < x <= 2 * 0.2 + 1e-9 for x in limits)  # STEP_CAP_TPOTS x the TPOT SLO


def test_slo_tpot_supersedes_the_target_and_a_ttft_slo_alone_keeps_it(make_llm) -> None:
    """slo_tpot_ms wins over tpot_target_ms; with only a TTFT SLO the target is the SLO mode's TPOT."""
    both = make_llm(slo_tpot_ms=150, tpot_target_ms=400, max_batch_tokens=64).engine.scheduler.step_budget
    assert isinstance(both, SloBudget) and both.targets.tpot_s == pytest.approx(0.15)
    ttft = make_llm(slo_ttft_ms=900, tpot_target_ms=400, max_batch_tokens=64).engine.scheduler.step_budget
    assert isinstance(ttft, SloBudget) and ttft.targets.tpot_s == pytest.approx(0.4)
    target = make_llm(tpot_target_ms=400, max_batch_tokens=64).engine.scheduler.step_budget
    assert type(target) is TpotBudget


def test_given_up_requests_are_counted_in_stats_and_metrics(make_llm) -> None:
    """A TTFT SLO no step can meet gives up on every request, which still finishes, and says so."""
    llm = make_llm(slo_ttft_ms=1e-6, slo_tpot_ms=0, max_batch_tokens=64)
    outs = llm.generate(prompts(3), GREEDY)
    assert all(len(o.token_ids) == GREEDY.max_tokens for o in outs)  # given up on, still served
    stats = llm.engine.stats().scheduler
    assert stats.slo_given_up_ttft == 3 and stats.slo_given_up_tpot == 0
    m = ServerMetrics()
    m.observe_stats(stats, stepped=True)
    text = m.render()[0].decode()
    assert 'mixserve:slo_given_up_total{slo="ttft"} 3.0' in text
    assert 'mixserve:slo_given_up_total{slo="tpot"} 0.0' in text


def test_slo_flags_parse_and_reject_negatives(tmp_path: Path) -> None:
    """--slo-ttft-ms / --slo-tpot-ms reach the config; a negative one is one line naming the key."""
    p = argparse.ArgumentParser()
    add_engine_flags(p)
    cfg = config_from_args(p.parse_args(["--slo-ttft-ms", "2000", "--slo-tpot-ms", "200"]))
    assert (cfg.engine.slo_ttft_ms, cfg.engine.slo_tpot_ms) == (2000, 200)
    with pytest.raises(ConfigError, match="slo_tpot_ms"):
        config_from_args(p.parse_args(["--slo-tpot-ms", "-1"]))
