"""A machine's step-time noise, measured, for `mixserve simulate --noise-from`: how far steps ran from the
time the engine predicted for them, drawn again step by step in a replay.

Why: a step of the same tokens does not take the same time twice. On the 2-core Xeon VM the same 9 decodes
and 256-token chunk, run 10 times in a row offline with nothing else running, took 460-517 ms; in the
served full-M runs one planned step in ~30 ran 1.2-1.3x its prediction, with no feature of the step that
foretold it (bench/results/tpot-target/README.md, full-M-8). A replay on the fit alone never stalls a step
the fit puts under the line, so it cannot say how often a setting stalls; a replay with this noise can.

What is measured: in a TPOT-target run's step trace (`[engine] step_trace`, every line with `predicted_s`,
the fit times the drift as the step was planned), each step's measured / predicted ratio: the part of the
step's time that the engine's own model and drift did not foresee. Planned steps (decodes beside a
chunk: the ones the budget sizes) and the others (decode-only, prefill-only) are kept apart, since the
two ran at different spreads. A replay draws each step's ratio from its kind's pool, independently, with
a seed; the drift is not replayed (the ratios are what was left after it).
"""

from __future__ import annotations

import json
import random
import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class StepNoise:
    """Measured / predicted ratios of planned steps and of the other steps."""

    planned: tuple[float, ...]
    other: tuple[float, ...]

    @classmethod
    def from_traces(cls, paths: Iterable[str | Path]) -> StepNoise:
        """The ratios of every step of these target-run traces; ValueError (one line) naming a bad file."""
        planned: list[float] = []
        other: list[float] = []
        for path in paths:
            try:
                lines = Path(path).read_text(encoding="utf-8").splitlines()
            except OSError as e:
                raise ValueError(f"{path}: cannot read the step trace ({e.strerror})") from None
            found = 0
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
                found += 1
            if found == 0:
                raise ValueError(f"{path}: no step with predicted_s (the trace of a run with "
                                 "--tpot-target-ms and --step-trace is needed)")
        if not planned:
            raise ValueError("the traces hold no planned step (decodes beside a chunk)")
        return cls(tuple(planned), tuple(other or planned))

    def draw(self, rng: random.Random, planned: bool) -> float:
        """One step's ratio, from its kind's pool."""
        return rng.choice(self.planned if planned else self.other)

    def describe(self) -> str:
        """One line: how many ratios, and their spread."""
        def q(xs: tuple[float, ...]) -> str:
            s = sorted(xs)
            at = lambda p: s[min(len(s) - 1, int(p * len(s)))]  # noqa: E731
            return f"p50 {statistics.median(s):.3f}, p90 {at(0.9):.3f}, p99 {at(0.99):.3f}, max {s[-1]:.3f}"

        return f"step noise: {len(self.planned)} planned steps ({q(self.planned)}); " \
               f"{len(self.other)} others ({q(self.other)})"
