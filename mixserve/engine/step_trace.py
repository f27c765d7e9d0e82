"""The step trace (`[engine] step_trace`): one JSON line per engine step, flushed as it is written."""

from __future__ import annotations

import json
from typing import IO


class StepTrace:
    """A JSONL file of steps: index, wall time, decode and prefill tokens, sequences, duration, and the
    step cost model's fields while a TPOT target is on."""

    def __init__(self, path: str) -> None:
        self._file: IO[str] | None = open(path, "a", encoding="utf-8")  # noqa: SIM115 - open until close()

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
            **cost_fields,
        }
        self._file.write(json.dumps(line) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
