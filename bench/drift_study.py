#!/usr/bin/env python3
"""Offline study of the cost model's drift rule, replayed on recorded target runs' step traces.

Not a test, and no server: each trace line of a TPOT-target run holds the step's measured duration, its
predicted time (the fit times the drift as the step was planned) and the drift after the step. The fit's
own prediction of step i is predicted_s_i / drift_{i-1} (drift_0 = 1). Each candidate rule sees the same
sequence of actual / fit ratios of planned (mixed: decodes beside a chunk) steps, clamped to DRIFT_RANGE
as the engine clamps them, and predicts step i as fit_i * its drift before step i. Reported per rule, over
the planned steps: the median, p90, p99 and max of actual / predicted, and the steps that would have
passed the stall line had the step been sized to a 400 ms prediction (actual * 400 / predicted > 500 ms).
The step sizes and the fit are those of the recorded run (the rule's own choices would have changed them
a little); "binding" steps are those the target actually sized (predicted >= 90% of the target).

    .venv/bin/python bench/drift_study.py                        # the full-M-4 target runs
    .venv/bin/python bench/drift_study.py --out /tmp/notes/drift.md TRACE.steps.jsonl ...
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from mixserve.core.step_drift import DRIFT_DOWN, DRIFT_RANGE, DRIFT_UP

STEPS = Path(__file__).parent / "results" / "tpot-target" / "full-M-4" / "steps"
DEFAULT_TRACES = [STEPS / f"{n}.steps.jsonl" for n in
                  ("tpot400-b2048", "share-0.tpot400-b2048", "share-0.25.tpot400-b2048", "target-450")]
SIZED_TO_S, STALL_S = 0.400, 0.500


@dataclass(frozen=True)
class Step:
    """One traced step: measured and fit-predicted seconds, whether the budget sized it, its target."""

    actual_s: float
    fit_s: float
    planned: bool
    binding: bool


def read_trace(path: Path, target_s: float) -> list[Step]:
    """The steps of one target run's trace, with the fit's prediction recovered from the drift."""
    steps, drift = [], 1.0
    for line in path.read_text().splitlines():
        r = json.loads(line)
        if r.get("predicted_s") is None:
            raise ValueError(f"{path}: not a TPOT-target run's trace (no predicted_s)")
        planned = r["decode_tokens"] > 0 and r["prefill_tokens"] > 0
        steps.append(Step(r["duration_s"], r["predicted_s"] / drift, planned,
                          planned and r["predicted_s"] >= 0.9 * target_s))
        drift = r["drift"]
    return steps


class Rule:
    """A drift rule: the factor on the fit's prediction, learnt from planned steps' actual / fit ratios."""

    name = "none (1.0)"

    def drift(self) -> float:
        return 1.0

    def observe(self, ratio: float) -> None:
        pass


@dataclass
class Ewma(Rule):
    """An exponentially weighted average, rising at `up` and falling at `down` (the engine's: 0.5, 0.15)."""

    up: float
    down: float
    value: float = 1.0

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"EWMA up {self.up:g} / down {self.down:g}" if self.up != self.down else f"EWMA {self.up:g}"

    def drift(self) -> float:
        return self.value

    def observe(self, ratio: float) -> None:
        self.value += (self.up if ratio > self.value else self.down) * (ratio - self.value)


@dataclass
class Quantile(Rule):
    """The q-quantile of the last k ratios (q 0.5: a running median); 1.0 before any."""

    k: int
    q: float
    last: deque = field(default_factory=deque)

    @property
    def name(self) -> str:  # type: ignore[override]
        what = "median" if self.q == 0.5 else f"q{self.q:g}"
        return f"{what} of last {self.k}"

    def drift(self) -> float:
        if not self.last:
            return 1.0
        xs = sorted(self.last)
        pos = self.q * (len(xs) - 1)  # linear interpolation between order statistics
        lo = int(pos)
        return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (pos - lo)

    def observe(self, ratio: float) -> None:
        self.last.append(ratio)
        if len(self.last) > self.k:
            self.last.popleft()


RULES: list[Callable[[], Rule]] = [
    Rule, lambda: Ewma(DRIFT_UP, DRIFT_DOWN), lambda: Ewma(0.5, 0.3), lambda: Ewma(0.15, 0.15),
    lambda: Ewma(0.3, 0.3), lambda: Ewma(0.5, 0.5), lambda: Ewma(0.7, 0.7), lambda: Ewma(1.0, 1.0),
    lambda: Quantile(4, 0.5), lambda: Quantile(8, 0.5), lambda: Quantile(16, 0.5), lambda: Quantile(32, 0.5),
    lambda: Quantile(16, 0.75), lambda: Quantile(32, 0.75), lambda: Quantile(16, 0.9),
    lambda: Quantile(32, 0.9),
]


def replay(steps: Sequence[Step], rule: Rule) -> list[tuple[float, bool]]:
    """actual / rule-predicted of each planned step (and whether it was binding), in order."""
    out = []
    for s in steps:
        d = rule.drift()
        if s.planned and s.fit_s > 0:
            out.append((s.actual_s / (s.fit_s * d), s.binding))
            rule.observe(min(max(s.actual_s / s.fit_s, DRIFT_RANGE[0]), DRIFT_RANGE[1]))
    return out


def quantile(xs: Sequence[float], q: float) -> float:
    ys = sorted(xs)
    pos = q * (len(ys) - 1)
    lo = int(pos)
    return ys[lo] + (ys[min(lo + 1, len(ys) - 1)] - ys[lo]) * (pos - lo)


def summary(ratios: Sequence[float], line: float = STALL_S / SIZED_TO_S) -> dict:
    """Median / p90 / p99 / max of actual / predicted; the steps over the line at a 400 ms size, and near
    it (over 1.15 and 1.2: 460 and 480 ms)."""
    if not ratios:
        return {"n": 0}
    return {"n": len(ratios), "median": statistics.median(ratios), "p90": quantile(ratios, 0.9),
            "p99": quantile(ratios, 0.99), "max": max(ratios), "stalls": sum(r > line for r in ratios),
            "over_1.15": sum(r > 1.15 for r in ratios), "over_1.2": sum(r > 1.2 for r in ratios)}


def study(traces: dict[str, list[Step]]) -> list[dict]:
    """One row per rule: pooled planned and binding steps, the stalls per run, and the spread at equal
    medians (each rule's ratios over its own median; stalls if every rule's median step took as long as
    the current rule's at 400 ms): a rule's bias is a choice of target, its spread is what it tracks."""
    rows = []
    for make in RULES:
        name = make().name
        per_run = {run: replay(steps, make()) for run, steps in traces.items()}
        pooled = [r for xs in per_run.values() for r, _ in xs]
        rows.append({"rule": name, "planned": summary(pooled),
                     "binding": summary([r for xs in per_run.values() for r, b in xs if b]),
                     "medians": [statistics.median([r for r, _ in xs]) for xs in per_run.values()],
                     "stalls": [summary([r for r, _ in xs])["stalls"] for xs in per_run.values()]})
    ref = rows[1]["planned"]["median"]  # the engine's rule
    for row, make in zip(rows, RULES, strict=True):
        pooled = [r for steps in traces.values() for r, _ in replay(steps, make())]
        m = row["planned"]["median"]
        row["equal_median"] = summary([r / m for r in pooled], STALL_S / (SIZED_TO_S * ref))
    return rows


def markdown(rows: Sequence[dict], runs: Sequence[str]) -> str:
    ref_ms = rows[1]["planned"]["median"] * SIZED_TO_S * 1000
    lines = ["| rule | planned: median / p90 / p99 / max | stalls at 400 ms (per run) | > 1.2, > 1.15 "
             "| binding: n, median / p90 / max, stalls | equal medians: p90 / p99, stalls "
             "| median per run |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        p, b, e = r["planned"], r["binding"], r["equal_median"]
        lines.append(
            f"| {r['rule']} | {p['median']:.3f} / {p['p90']:.3f} / {p['p99']:.3f} / {p['max']:.3f} "
            f"| {p['stalls']} ({', '.join(map(str, r['stalls']))}) | {p['over_1.2']}, {p['over_1.15']} "
            f"| {b['n']}, {b['median']:.3f} / {b['p90']:.3f} / {b['max']:.3f}, {b['stalls']} "
            f"| {e['p90']:.3f} / {e['p99']:.3f}, {e['stalls']} "
            f"| {', '.join(f'{m:.3f}' for m in r['medians'])} |")
    lines += ["", f"Runs: {', '.join(runs)}; {rows[0]['planned']['n']} planned steps, of which "
              f"{rows[0]['binding']['n']} binding (predicted >= 90% of the target). A stall at 400 ms: "
              "actual * 400 / predicted > 500 ms (ratio > 1.25). Equal medians: each rule's ratios over its "
              f"own median, and the steps over 500 ms had each rule's median step taken {ref_ms:.0f} ms "
              "(the engine's rule's median at 400 ms)."]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="*", type=Path, default=DEFAULT_TRACES)
    ap.add_argument("--out", type=Path, help="also write the table here")
    args = ap.parse_args(argv)
    missing = [str(p) for p in args.traces if not p.exists()]
    if missing:  # raw traces are not tracked: bench/results/tpot-target/README.md says what made them
        ap.error(f"no step trace at {missing[0]}: run the target sweep with --step-trace, or name traces")
    traces = {}
    for p in args.traces:
        name = p.name.removesuffix(".steps.jsonl")
        traces[name] = read_trace(p, 0.450 if "450" in name else 0.400)  # the run's own target
    text = markdown(study(traces), list(traces))
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
