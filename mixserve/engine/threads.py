"""CPU threads: torch's intra-op pool sized to the cores, one thread bound per core.

torch has no API to pin its OpenMP workers, and OMP_PROC_BIND only counts if set before libgomp loads
(before `import torch`). So we pin from the outside: Linux lets sched_setaffinity take a thread id. The
thread that runs the model (the OpenMP master) goes to the first core; the workers its first parallel
region creates (the threads that appear in /proc/self/task) go one to each following core. libgomp keeps
one worker pool per master thread, so the engine binds again when step() first runs on a new thread.
"""

from __future__ import annotations

import os
import threading
from functools import cache

import torch


@cache
def available_cores() -> list[int]:
    """The cores this process may run on (its affinity mask when first asked), sorted.

    Cached: once bind_threads has pinned this thread to one core, its own mask no longer says how many
    cores the process has, and a second engine in the same thread must still see all of them.
    """
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def set_threads(threads: int) -> int:
    """torch.set_num_threads(threads, or one per available core for 0); returns the number used."""
    n = threads or len(available_cores())
    torch.set_num_threads(n)
    return n


def bind_threads(n: int) -> bool:
    """Bind the calling thread and the OpenMP workers it starts one per core; False if that failed.

    Must run on the thread that will call the model, before or at its first parallel region (when the
    pool already existed, the workers are found as the native threads Python does not know about).
    """
    cores = available_cores()
    if not 2 <= n <= len(cores) or not hasattr(os, "sched_setaffinity"):
        return False  # one thread needs no binding; more threads than cores cannot have one each
    cores = cores[:n]
    try:
        before = _task_ids()
        torch.ones(1 << 20).add_(1.0)  # a parallel region: makes libgomp start this thread's pool
        new = sorted(_task_ids() - before)
        if not new:
            known = {t.native_id for t in threading.enumerate()}
            new = sorted(_task_ids() - known)
        os.sched_setaffinity(threading.get_native_id(), {cores[0]})
        for i, tid in enumerate(new):
            os.sched_setaffinity(tid, {cores[(i + 1) % len(cores)]})
        return True
    except OSError:
        return False  # e.g. a thread exited meanwhile, or a sandbox forbids it: unbound is still correct


def _task_ids() -> set[int]:
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:
        return set()
