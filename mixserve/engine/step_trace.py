"""The step trace (`[engine] step_trace`): one JSON line per engine step, flushed as it is written."""

from __future__ import annotations

import gc
import json
import time
from typing import IO


class GcClock:
    """Seconds the process spent in garbage collection (any thread: a collection holds the GIL, so the
    step thread waits for it too), read as the time since the last read."""

    def __init__(self) -> None:
        self._start = 0.0
        self._total = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self._total += time.perf_counter() - self._start

    def take(self) -> float:
        total, self._total = self._total, 0.0
        return total

    def close(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)


class StepTrace:
    """A JSONL file of steps: index, wall time, decode and prefill tokens, sequences, duration, the seconds
    of garbage collection since the previous line (gc_s), the step cost model's fields while a TPOT
    target is on, and with speculation the draft tokens verified and accepted (decode_tokens counts the
    drafts too: they are the decodes' rows)."""

    def __init__(self, path: str) -> None:
        self._file: IO[str] | None = open(path, "a", encoding="utf-8")  # noqa: SIM115 - open until close()
        self._gc = GcClock()

    def write(self, step: int, wall: float, num_decodes: int, num_tokens: int, num_seqs: int,
              duration_s: float, cost_fields: dict) -> None:
        if self._file is None:
            return
        line = {
            "step": step,
            "time": wall,
            "decode_tokens": num_decodes,
            "prefill_tokens": num_tokens - num_decodes,
            "num_seqs": num_seqs,
            "duration_s": duration_s,
            "gc_s": round(self._gc.take(), 6),
            **cost_fields,
        }
        self._file.write(json.dumps(line) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
            self._gc.close()
