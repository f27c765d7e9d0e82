"""bench/gpu_bench.py stays runnable: its --tiny mode runs every section on the CPU without an error row."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gpu_bench_tiny_runs_every_section(tmp_path: Path) -> None:
    rows = tmp_path / "rows.txt"
    # Run as the GPU machine runs it (plain `python bench/gpu_bench.py`, no PYTHONPATH), from elsewhere.
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_bench.py"), "--tiny", "--no-hf",
                           "--rows-file", str(rows)], capture_output=True, text=True, cwd=tmp_path,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = rows.read_text().splitlines()
    names = [line.split(" | ")[0] for line in lines]
    errors = [line for line in lines if " | ERROR | " in line or " | skipped | " in line]
    assert not errors, errors
    for section in ("correctness chunk 1", "correctness chunk 7", "correctness chunk 64"):
        line = lines[names.index(section)]
        assert "PASS" in line, line
    assert any(n.startswith("decode b1 ") for n in names), names
    assert any(n.startswith("prefill chunk ") for n in names), names
    assert any(n.startswith("e2e ours ") for n in names), names
    assert proc.stdout.rstrip().splitlines()[-1].startswith("total "), proc.stdout[-500:]
