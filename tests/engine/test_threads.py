"""CPU threads: torch's pool sized to the cores, the model thread and its OpenMP workers one per core."""

from __future__ import annotations

import json
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


SERVE_SCRIPT = """
import asyncio, json, os, sys, time
os.sched_setaffinity(0, range(os.cpu_count()))
from mixserve.config import EngineConfig
from mixserve.engine import LLMEngine, SamplingParams
from mixserve.engine.async_engine import AsyncEngine
from mixserve.engine.threads import available_cores

def pinned():  # the threads held to one core: a bound OpenMP pool's master and workers
    masks = []
    for t in os.listdir("/proc/self/task"):
        try:
            masks.append(os.sched_getaffinity(int(t)))
        except OSError:  # a thread that exited meanwhile
            pass
    return sorted(next(iter(m)) for m in masks if len(m) == 1)

def pinned_settled():  # a freed pool's workers exit on their own, just after their master: wait for that
    end = time.monotonic() + 10
    while pinned() and time.monotonic() < end:
        time.sleep(0.01)
    return pinned()

engine = LLMEngine.from_config(EngineConfig(model=sys.argv[1], device="cpu", threads=0, num_blocks=64,
                                            block_size=4, attention_backend="torch"))
after_load = sorted(os.sched_getaffinity(0))  # the thread that goes on to run the event loop
pinned_after_load = pinned_settled()  # the loading thread's pool ended with its thread

async def serve_one():
    served = AsyncEngine(engine)
    await served.start()
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    async for update in served.generate("r0", [5, 6, 7], params):
        pass
    step = served._thread.native_id
    loop = sorted(os.sched_getaffinity(0))  # the event loop's thread, while the step thread lives
    helper = await asyncio.to_thread(lambda: sorted(os.sched_getaffinity(0)))  # a thread the loop starts
    stepper = sorted(os.sched_getaffinity(step))
    serving = pinned()
    await served.stop()
    return loop, helper, stepper, serving

print(json.dumps([available_cores(), after_load, pinned_after_load, *asyncio.run(serve_one())]))
"""


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or (os.cpu_count() or 1) < 2,
                    reason="needs Linux and at least two cores")
def test_event_loop_thread_is_not_left_on_the_compute_core(tiny_model_dir) -> None:
    """from_config loads on a bound thread of its own that ends: in `mixserve serve` the calling thread
    runs the event loop, never pinned, and the step thread's pool is the only one (threads.py says why).

    The step thread alone holds the first core; the loop's thread, and the threads it starts, may run on
    every core; no thread of the loading pool outlives the load.
    """
    out = subprocess.run([sys.executable, "-c", SERVE_SCRIPT, str(tiny_model_dir)], capture_output=True,
                         text=True, timeout=300, check=True)
    cores, after_load, pinned_after_load, loop, helper, stepper, serving = json.loads(
        out.stdout.strip().splitlines()[-1])
    if len(cores) < 2:
        pytest.skip("this process may use only one core")
    assert after_load == cores and loop == cores and helper == cores
    assert pinned_after_load == []  # the loading pool ended with its thread
    assert stepper == cores[:1]  # the step thread did pin itself to the compute core
    assert serving == cores  # one pool: the step thread and one worker per other core, no second pool


PROFILE_SCRIPT = """
import json, os, sys, time
os.sched_setaffinity(0, range(os.cpu_count()))
from mixserve.config import EngineConfig
from mixserve.engine import LLMEngine
before = set(os.listdir("/proc/self/task"))
extra = json.loads(sys.argv[2])
engine = LLMEngine.from_config(EngineConfig(model=sys.argv[1], device="cpu", threads=0, num_blocks=64,
                                            block_size=4, **extra))
end = time.monotonic() + 10  # a freed pool's workers exit just after their master
while set(os.listdir("/proc/self/task")) - before and time.monotonic() < end:
    time.sleep(0.01)
print(engine.step_cost.profiled, len(set(os.listdir("/proc/self/task")) - before))
"""


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or (os.cpu_count() or 1) < 2,
                    reason="needs Linux and at least two cores")
@pytest.mark.parametrize("extra", [{"tpot_target_ms": 400}, {"speculative": "DRAFT"}],
                         ids=["cost-profile", "draft-model"])
def test_start_up_work_leaves_no_pool_on_the_constructing_thread(tiny_model_dir, extra: dict) -> None:
    """With a TPOT target the engine profiles the model while it is built, and `speculative = PATH` loads a
    draft model; in `mixserve serve` the thread that builds the engine goes on to run the event loop, so that
    work must run (and end) on a thread of its own, or its OpenMP pool stays beside the step thread's and
    slows every step (threads.py)."""
    def threads_left(config: dict) -> tuple[int, int]:
        out = subprocess.run([sys.executable, "-c", PROFILE_SCRIPT, str(tiny_model_dir), json.dumps(config)],
                             capture_output=True, text=True, timeout=300, check=True)
        profiled, left = out.stdout.split()[-2:]
        return int(profiled), int(left)

    extra = {k: str(tiny_model_dir) if v == "DRAFT" else v for k, v in extra.items()}
    profiled, with_work = threads_left(extra)
    _, without = threads_left({})
    assert profiled > 0 or "speculative" in extra
    assert with_work == without
