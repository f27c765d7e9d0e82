"""Stretched steps of the SLO mode (core/slo.py): one mixed step given the time of k paced steps, then k - 1
decode-only steps, where the cost model says a step past the few-row knee pays a fixed part worth saving."""

from __future__ import annotations

import pytest

from mixserve.core import slo as slo_module
from mixserve.core.cost_model import CostCoefficients
from tests.core.test_slo import COST, make, run_step, steps_until_done

# the fit of the default Q4_1 model's SLO run on a 2-core CPU (docs/decisions/step-cost-few-rows.md): 3.9 ms
# a row up to 32 rows, 1.5 ms a row past them after ~90 ms
HINGED = CostCoefficients(overhead_s=0.013, per_token_s=0.0015, per_pair_s=6.7e-7, per_seq_s=0.0,
                          per_few_row_s=0.0024)


def _serve(cost: CostCoefficients) -> tuple[list[tuple[str, int, int, float, float]], dict, float]:
    """11 decoding requests and a 3000-token prompt to a 0.2 s TPOT SLO: per step (mode, decodes, chunk
    tokens, predicted time, limit), each short request's mean TPOT, and when the long prompt's first token
    came."""
    s, slo, clock = make(cost, ttft=60.0, tpot=0.2, budget=2048)
    for i in range(11):
        s.add_request(f"d{i}", [1] * 16, 40)
    run_step(s, clock, cost)
    s.add_request("long", [1] * 3000, 2)
    tracked = [s.request(f"d{i}") for i in range(11)] + [s.request("long")]
    steps, last_token = [], {}
    for _ in steps_until_done(s):
        before = clock[0]
        out = run_step(s, clock, cost)
        steps.append((slo.mode, len(out.decodes), sum(c.length for c in out.chunks), clock[0] - before,
                      slo.target_s))
        for r in tracked:
            if r.num_generated == r.max_tokens:
                last_token.setdefault(r.request_id, clock[0])
    tpot = {r.request_id: (last_token[r.request_id] - r.first_token_s) / (r.max_tokens - 1)
            for r in tracked[:-1]}
    return steps, tpot, tracked[-1].first_token_s


@pytest.fixture
def no_stretch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(slo_module, "MAX_STRETCH", 1)


def test_a_hinged_cost_stretches_steps_and_repays_them_with_decode_only_steps() -> None:
    steps, tpot, _ = _serve(HINGED)
    stretched = [i for i, st in enumerate(steps) if st[0] == "stretched"]
    assert stretched
    for i in stretched:
        mode, decodes, chunk, took, limit = steps[i]
        assert decodes == 11 and chunk > 0 and took <= limit + 1e-9 <= 2 * 0.2 + 1e-9  # within its cap
        # then decode-only steps: the decodes alone, until the next mixed or stretched one
        j = i + 1
        while j < len(steps) and steps[j][0] == "decode-only":
            assert steps[j][2] == 0 and steps[j][1] == 11
            j += 1
        assert j > i + 1 or j == len(steps) or steps[j][1] < 11  # (unless the decodes just finished)
    assert max(tpot.values()) <= 0.2  # every short request still meets its TPOT SLO


def test_stretching_prefills_the_long_prompt_sooner(no_stretch: None) -> None:
    _, tpot_plain, first_plain = _serve(HINGED)
    slo_module.MAX_STRETCH = 4  # (the fixture undoes it)
    steps, tpot, first = _serve(HINGED)
    assert any(st[0] == "stretched" for st in steps)
    assert first < 0.95 * first_plain and max(tpot.values()) <= 0.2 and max(tpot_plain.values()) <= 0.2


def test_no_knee_no_stretch() -> None:
    """A cost without the few-row knee saves nothing by stretching (each step pays its overhead anyway)."""
    steps, _, _ = _serve(COST)
    assert not any(st[0] == "stretched" for st in steps)
