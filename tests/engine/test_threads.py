"""CPU threads: torch's pool sized to the cores, the model thread and its OpenMP workers one per core."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = """
import os, threading
os.sched_setaffinity(0, range(os.cpu_count()))  # a parent bound by an earlier engine passed on its mask
from mixserve.engine.threads import available_cores, bind_threads, set_threads
n = set_threads(0)
bound = bind_threads(n)
me = threading.get_native_id()
mine = os.sched_getaffinity(me)
others = [os.sched_getaffinity(int(t)) for t in os.listdir("/proc/self/task") if int(t) != me]
print(n, bound, sorted(mine), available_cores(), sorted(sorted(a) for a in others if len(a) == 1))
"""


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or (os.cpu_count() or 1) < 2,
                    reason="needs Linux and at least two cores")
def test_threads_zero_binds_one_thread_per_core() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120,
                         check=True)
    n, bound, mine, rest = out.stdout.strip().split(" ", 3)
    cores_text, pinned = rest.split("] ", 1)
    cores = [int(c) for c in cores_text.strip("[]").split(",")]
    if len(cores) < 2:
        pytest.skip("this process may use only one core")
    assert int(n) == len(cores) and bound == "True"
    assert mine == str([cores[0]])  # the thread that runs the model is on the first core
    for core in cores[1:]:  # and each other core got a worker of its own
        assert f"[{core}]" in pinned
