"""Read the engine's step_trace JSONL (one line per step) into plain records for the timeline plot."""

from __future__ import annotations

import json
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


def read_step_trace(path: str | Path) -> list[StepRecord]:
    """Steps in file order, start times relative to the first step; a missing file reads as no steps."""
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
    times = [_first(r, "time", "t", "timestamp") for r in rows]
    durations = [_first(r, "duration_s", "duration") for r in rows]
    starts = [t - d for t, d in zip(times, durations, strict=True)] if _time_is_end(rows) else times
    origin = min(starts)
    return [
        StepRecord(s - origin, d, int(_first(r, "decode_tokens", "num_decode_tokens")),
                   int(_first(r, "prefill_tokens", "num_prefill_tokens")))
        for s, d, r in zip(starts, durations, rows, strict=True)
    ]


def _time_is_end(rows: list[dict]) -> bool:
    # A trace may name its time field explicitly; otherwise "time" is written when the step ends.
    return not any("start" in r or "time_start" in r for r in rows)
