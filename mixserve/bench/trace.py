"""Read the engine's step_trace JSONL (one line per step) into plain records for the timeline plot."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class StepRecord:
    """One engine step: when it started (s since the first step), how long it ran, and its tokens."""

    start_s: float
    duration_s: float
    decode_tokens: int
    prefill_tokens: int


def _first(row: dict, *keys: str, default: float = 0.0) -> float:
    for k in keys:
        if row.get(k) is not None:
            return float(row[k])
    return default


def read_step_trace(path: str | Path, clocks: Sequence[float] = ()) -> list[StepRecord]:
    """Steps in file order; a missing file reads as no steps.

    Start times are relative to the bench's start read on whichever of `clocks` (e.g. its monotonic and
    its wall clock at t0) lies nearest the trace's times, so the trace lines up with the requests; with
    no clocks, relative to the first step.
    """
    p = Path(path)
    if not p.exists():
        return []
    rows = []
    for line in p.read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut short when the server stopped mid-write
    if not rows:
        return []
    # mixserve's engine writes "time" as the wall clock when the step began (time.time())
    starts = [_first(r, "time", "start", "timestamp") for r in rows]
    durations = [_first(r, "duration_s", "duration") for r in rows]
    origin = min(clocks, key=lambda c: abs(c - starts[0])) if clocks else min(starts)
    return [
        StepRecord(s - origin, d, int(_first(r, "decode_tokens", "num_decode_tokens")),
                   int(_first(r, "prefill_tokens", "num_prefill_tokens")))
        for s, d, r in zip(starts, durations, rows, strict=True)
    ]

