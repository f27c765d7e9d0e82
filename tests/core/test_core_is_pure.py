"""`import mixserve.core` stays standard-library only: no torch, no numpy."""

from __future__ import annotations

import subprocess
import sys


def test_core_imports_neither_torch_nor_numpy():
    code = (
        "import sys, mixserve, mixserve.core\n"
        "heavy = sorted(m for m in ('torch', 'numpy') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
        "assert 'Scheduler' in dir(mixserve.core) and 'LLM' in dir(mixserve)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
