"""bench/drift_study.py: its replay of the engine's drift rule is the engine's, step for step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import drift_study
from mixserve.core.cost_model import CostCoefficients, StepCostModel, step_features


def engine_trace(path: Path) -> list[float]:
    """A target run's trace as the engine writes it (predicted before the step, drift after), on a
    machine that turns 30% slower halfway; returns each planned step's actual / predicted."""
    model = StepCostModel(CostCoefficients(0.03, 2e-4, 1e-7, 5e-4))
    ratios, lines = [], []
    for i in range(60):
        planned = i % 3 != 2  # every third step decode-only: it teaches the fit, not the drift
        seqs = [(100 + i, 1)] * 8 + ([(64 * (i % 5), 128 + 8 * i)] if planned else [])
        f = step_features(seqs)
        predicted = model.predict(f)
        actual = (0.03 + 2.2e-4 * f.num_tokens + 1e-7 * f.num_pairs) * (1.3 if i >= 30 else 1.0) \
            * (1.0 + 0.2 * ((i * 7) % 5 - 2) / 2)
        model.observe(f, actual, planned=planned)
        lines.append({"decode_tokens": 8, "prefill_tokens": seqs[-1][1] if planned else 0,
                      "duration_s": actual, "predicted_s": predicted, "drift": model.drift})
        if planned:
            ratios.append(actual / predicted)
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return ratios


def test_the_current_rules_replay_predicts_what_the_engine_predicted(tmp_path):
    expected = engine_trace(tmp_path / "run.steps.jsonl")
    steps = drift_study.read_trace(tmp_path / "run.steps.jsonl", 0.4)
    current = drift_study.replay(steps, drift_study.RULES[1]())
    assert [r for r, _ in current] == pytest.approx(expected, rel=1e-9)
    # no drift at all predicts the fit alone: the 30% slowdown shows in its ratios
    none = [r for r, _ in drift_study.replay(steps, drift_study.Rule())]
    assert max(none[-10:]) > 1.2 > max(r for r, _ in current[-10:])


def test_the_study_reports_every_rule_and_counts_stalls_at_the_line():
    assert drift_study.summary([1.0, 1.3, 1.2, 0.9])["stalls"] == 1  # 1.3 x 400 ms > 500 ms
    rule = drift_study.Quantile(3, 0.5)
    for r in (1.0, 2.0, 1.2, 1.1):
        rule.observe(r)
    assert rule.drift() == pytest.approx(1.2)  # the median of the last 3: 2.0, 1.2, 1.1
