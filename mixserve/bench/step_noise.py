"""A machine's step-time noise, measured, for `mixserve simulate --noise-from`: how far steps ran from the
time the engine predicted for them, drawn again step by step in a replay.

Why: a step of the same tokens does not take the same time twice, and nothing about a step foretells the
slow ones (docs/decisions/step-drift-and-p90-margin.md). A replay on the fit alone never stalls a step the
fit puts under the line, so it cannot say how often a setting stalls; a replay with this noise can.

What is measured: in a TPOT-target run's step trace (`[engine] step_trace`, every line with `predicted_s`,
the fit times the drift as the step was planned), each step's measured / predicted ratio: the part of the
step's time that the engine's own model and drift did not foresee. Planned steps (decodes beside a
chunk: the ones the budget sizes) and the others (decode-only, prefill-only) are kept apart, since the
two ran at different spreads. A replay walks one measured run's ratios in their order, from a point the
seed picks (each kind on its own, wrapping round), so a slow phase of the machine stays one stretch of the
replay, as it was, rather than spread over it (independent draws would scatter a disturbance's slow
steps over the whole replay: docs/decisions/step-drift-and-p90-margin.md). The drift is not replayed
(the ratios are what was left after it); the margin is.
"""

from __future__ import annotations

import json
import random
import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class MeasuredRun:
    """One trace's measured / predicted ratios in step order: planned steps, and the others."""

    planned: tuple[float, ...]
    other: tuple[float, ...]


class NoiseReplay:
    """One seed's walk through one measured run."""

    def __init__(self, run: MeasuredRun, start: float) -> None:
        self._run = run
        self._at = {True: int(start * len(run.planned)), False: int(start * len(run.other))}

    def next(self, planned: bool) -> float:
        """The next step's ratio, of its kind."""
        xs = (self._run.planned if planned else self._run.other) or self._run.planned
        i = self._at[planned] % len(xs)
        self._at[planned] = i + 1
        return xs[i]


@dataclass(frozen=True)
class StepNoise:
    """The measured runs whose step-time spread a replay draws from."""

    runs: tuple[MeasuredRun, ...]

    @classmethod
    def constant(cls, planned: float, other: float) -> StepNoise:
        """Every planned step `planned` times its prediction, every other `other` times (for tests)."""
        return cls((MeasuredRun((planned,), (other,)),))

    @classmethod
    def from_traces(cls, paths: Iterable[str | Path]) -> StepNoise:
        """The ratios of every step of these target-run traces; ValueError (one line) naming a bad file."""
        runs = []
        for path in paths:
            try:
                lines = Path(path).read_text(encoding="utf-8").splitlines()
            except OSError as e:
                raise ValueError(f"{path}: cannot read the step trace ({e.strerror})") from None
            planned: list[float] = []
            other: list[float] = []
            for n, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    predicted, actual = row.get("predicted_s"), float(row["duration_s"])
                    is_planned = row["decode_tokens"] > 0 and row["prefill_tokens"] > 0
                except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
                    raise ValueError(f"{path}: line {n}: not a step trace line ({e})") from None
                if predicted is None or not predicted > 0 or not actual >= 0:
                    continue
                (planned if is_planned else other).append(actual / predicted)
            if not planned and not other:
                raise ValueError(f"{path}: no step with predicted_s (the trace of a run with "
                                 "--tpot-target-ms and --step-trace is needed)")
            if planned:  # a run without planned steps says nothing of the steps the budget sizes
                runs.append(MeasuredRun(tuple(planned), tuple(other)))
        if not runs:
            raise ValueError("the traces hold no planned step (decodes beside a chunk)")
        return cls(tuple(runs))

    def replay(self, seed: int) -> NoiseReplay:
        """A walk through one of the runs from a point that `seed` picks."""
        rng = random.Random(seed)
        return NoiseReplay(rng.choice(self.runs), rng.random())

    def describe(self) -> str:
        """One line: how many ratios, and their spread."""
        def q(xs: list[float]) -> str:
            s = sorted(xs)
            at = lambda p: s[min(len(s) - 1, int(p * len(s)))]  # noqa: E731
            return f"p50 {statistics.median(s):.3f}, p90 {at(0.9):.3f}, p99 {at(0.99):.3f}, max {s[-1]:.3f}"

        planned = [x for r in self.runs for x in r.planned]
        other = [x for r in self.runs for x in r.other] or planned
        return f"step noise of {len(self.runs)} runs: {len(planned)} planned steps ({q(planned)}); " \
               f"{len(other)} others ({q(other)})"
