"""CPU threads: torch's intra-op pool sized to the cores, one thread bound per core — only the model's.

torch has no API to pin its OpenMP workers, and OMP_PROC_BIND only counts if set before libgomp loads
(before `import torch`). So we pin from the outside: Linux lets sched_setaffinity take a thread id. The
thread that runs the model (the OpenMP master) goes to the first core; the workers its first parallel
region creates (the threads that appear in /proc/self/task) go one to each following core. libgomp keeps
one worker pool per master thread, so the engine binds again when step() first runs on a new thread.

The server's event loop runs on any core, never pinned, and the engine is built (the model's load, a draft
model's, the cost profile) on a thread of its own that then ends (`run_on_own_thread`), so the thread that
steps owns the only OpenMP pool. Why, measured:
docs/decisions/threads-and-the-event-loop.md.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from functools import cache
from typing import TypeVar

import torch

T = TypeVar("T")

# native id of a master thread -> the native ids of the OpenMP workers its first parallel region started
_pools: dict[int, list[int]] = {}


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
    me = threading.get_native_id()
    try:
        before = _task_ids()
        torch.ones(1 << 20).add_(1.0)  # a parallel region: makes libgomp start this thread's pool
        new = sorted(_task_ids() - before)
        if not new:  # the pool existed: the workers found when this thread was first bound, if it was
            new = _pools.get(me) or sorted(_task_ids() - {t.native_id for t in threading.enumerate()})
        if len(new) != n - 1:  # other native threads among them (torch's own): binding one of those to a
            return False       # worker's core would halve the pool's speed; unbound is correct, merely slower
        _pools[me] = new
        os.sched_setaffinity(me, {cores[0]})
        for i, tid in enumerate(new):
            os.sched_setaffinity(tid, {cores[(i + 1) % len(cores)]})
        return True
    except OSError:
        return False  # e.g. a thread exited meanwhile, or a sandbox forbids it: unbound is still correct


def unbind_thread() -> None:
    """Let the calling thread (not its OpenMP workers) run on every available core again."""
    with contextlib.suppress(AttributeError, OSError):  # not Linux, or a sandbox forbids it
        os.sched_setaffinity(threading.get_native_id(), available_cores())


def run_on_own_thread(load: Callable[[], T], n: int) -> T:
    """Run `load` (the model's loading, the start-up profile: anything that runs the model before the step
    thread does) on a thread of its own, bound one per core (bind_threads), wait for it and return its
    result (or raise its exception); the thread then ends, and its OpenMP pool with it.

    Why not load on the calling thread: libgomp keeps a worker pool for every thread that ever ran a
    parallel region, until that thread exits, and once it manages more threads than the machine has CPUs
    it cuts the spin-wait at its barriers to ~100 spins (its "throttled" GOMP_SPINCOUNT), so the workers
    of the pool that does run sleep in the kernel between regions and every region waits for them to wake.
    In `mixserve serve` the loading thread goes on to run the event loop while a step thread of its own
    steps: two pools, and slower decode steps (docs/decisions/threads-and-the-event-loop.md).
    """
    result: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            bind_threads(n)
            result.append(load())
        except BaseException as exc:  # handed to the caller, as if it had loaded on its own thread
            error.append(exc)

    thread = threading.Thread(target=run, name="mixserve-load", daemon=True)
    thread.start()
    thread.join()
    _wait_gone(thread.native_id)
    if error:
        raise error[0]
    return result[0]


def _wait_gone(native_id: int | None, deadline_s: float = 5.0) -> None:
    """Wait until the OS thread `native_id` has exited. Thread.join returns when its Python code is done;
    libgomp frees the thread's pool (and stops counting its workers) in a destructor that runs after that,
    as the thread exits."""
    end = time.monotonic() + deadline_s
    while native_id is not None and os.path.exists(f"/proc/self/task/{native_id}") and time.monotonic() < end:
        time.sleep(0.001)


def _task_ids() -> set[int]:
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:
        return set()
