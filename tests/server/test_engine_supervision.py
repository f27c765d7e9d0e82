"""A failed step restarts the engine; too many restarts or a hung step kill it; admission is atomic."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from mixserve.engine.async_engine import AsyncEngine, EngineBusyError, EngineDeadError
from mixserve.engine.sampling_params import SamplingParams
from mixserve.engine.supervision import SLOW_STEP_S, Failpoint, InjectedFault, RestartBudget, step_timeout
from mixserve.metrics import ServerMetrics
from tests.server.fake_engine import FakeEngine
from tests.server.test_async_engine import drain, until


def test_failpoint_reads_its_environment_variable():
    assert Failpoint.from_env({}) == Failpoint()
    assert Failpoint.from_env({"MIXSERVE_FAULT_STEP": "3"}) == Failpoint(3)
    assert Failpoint.from_env({"MIXSERVE_FAULT_STEP": "5:hang"}) == Failpoint(5, hang=True)
    assert Failpoint.from_env({"MIXSERVE_FAULT_STEP": "1:slow"}) == Failpoint(1, slow=True)
    for bad in ("0", "x", "2:explode", "-1"):
        with pytest.raises(ValueError, match="MIXSERVE_FAULT_STEP"):
            Failpoint.from_env({"MIXSERVE_FAULT_STEP": bad})
    point = Failpoint(2)
    point.check(1)
    with pytest.raises(InjectedFault):
        point.check(2)
    point.check(2)  # once only
    slow = Failpoint(2, slow=True)
    for step in (1, 2, 3):
        slow.check(step)  # never raises
    clock = time.monotonic()
    slow.check(4)
    assert time.monotonic() - clock >= SLOW_STEP_S


def test_restart_budget_counts_restarts_within_its_window():
    budget = RestartBudget(2, window_s=10.0)
    assert budget.allow(0.0) and budget.allow(1.0)
    assert not budget.allow(5.0)
    assert budget.allow(10.5)  # the first one has left the window


def test_step_timeout_default_is_the_larger_of_60_s_and_10x_the_longest_step():
    assert step_timeout(0.5, 0.0) == 60.0
    assert step_timeout(9.0, 0.0) == 90.0
    assert step_timeout(9.0, 2.5) == 2.5


def test_a_failed_step_fails_its_requests_then_the_engine_serves_again():
    fake = FakeEngine()
    metrics = ServerMetrics()

    async def main():
        engine = AsyncEngine(fake, metrics, failpoint=Failpoint(2))
        in_flight = await asyncio.gather(*(drain(engine, f"r{i}", [0], 5) for i in range(3)),
                                         return_exceptions=True)
        after = await drain(engine, "after", [0], 4)
        healthy, restarts = engine.healthy, engine.num_restarts
        await engine.stop(1.0)
        return in_flight, after, healthy, restarts

    in_flight, after, healthy, restarts = asyncio.run(main())
    assert all(isinstance(r, EngineDeadError) and "restarted" in str(r) for r in in_flight)
    assert len(after) == 4 and healthy and restarts == 1
    assert not fake.has_unfinished()  # the failed requests' blocks went back
    assert metrics.registry.get_sample_value("mixserve:engine_restarts_total") == 1


def test_a_step_that_keeps_failing_kills_the_engine_after_the_restart_budget():
    fake = FakeEngine()
    fake.crash = True
    died: list[BaseException] = []

    async def main():
        engine = AsyncEngine(fake, max_engine_restarts=2)
        engine.on_dead = died.append
        results = [await asyncio.gather(drain(engine, f"r{i}", [0], 3), return_exceptions=True)
                   for i in range(3)]
        with pytest.raises(EngineDeadError):
            await drain(engine, "late", [0], 1)
        healthy = engine.healthy
        await engine.stop(1.0)
        return results, healthy, engine.num_restarts

    results, healthy, restarts = asyncio.run(main())
    assert all(isinstance(r[0], EngineDeadError) for r in results)
    assert not healthy and restarts == 2 and len(died) == 1


def test_a_hung_step_past_the_watchdog_kills_the_engine_and_fails_its_requests():
    died = threading.Event()

    async def main():
        engine = AsyncEngine(FakeEngine(), step_timeout_s=0.3, failpoint=Failpoint(3, hang=True))
        engine.on_dead = lambda exc: died.set()
        result = await asyncio.gather(drain(engine, "r", [0], 10), return_exceptions=True)
        return result[0], engine.healthy, engine.error

    result, healthy, error = asyncio.run(main())
    assert isinstance(result, EngineDeadError) and "watchdog" in str(result)
    assert not healthy and isinstance(error, TimeoutError)
    assert died.wait(5)  # on_dead comes after the streams are told


def test_admission_is_atomic_under_a_burst():
    fake = FakeEngine(max_num_seqs=1)
    fake.gate = threading.Event()  # nothing runs: every admitted request stays waiting

    async def main():
        engine = AsyncEngine(fake)
        admitted, refused = [], 0
        for i in range(50):  # no await between submits: the old check-then-await let all 50 in
            try:
                admitted.append(engine.submit(f"r{i}", [0], SamplingParams(max_tokens=2), max_waiting=8))
            except EngineBusyError:
                refused += 1
        waiting = engine.num_waiting()
        for stream in admitted:
            stream.close()
        fake.gate.set()
        await until(lambda: not fake.has_unfinished() and engine.num_waiting() == 0, "every abort")
        await engine.stop(1.0)
        return len(admitted), refused, waiting

    assert asyncio.run(main()) == (8, 42, 8)


def test_a_permanent_failure_kills_the_engine_without_restarting():
    class RankGone(RuntimeError):
        permanent = True  # as distributed.tp_runner.RankFailedError: no restart can mend it

    fake = FakeEngine()

    def broken_step():
        raise RankGone("rank 1 exited")

    fake.step = broken_step

    async def main():
        engine = AsyncEngine(fake)
        result = await asyncio.gather(drain(engine, "r", [0], 3), return_exceptions=True)
        await engine.stop(1.0)
        return result[0], engine.healthy, engine.num_restarts

    result, healthy, restarts = asyncio.run(main())
    assert isinstance(result, EngineDeadError) and not healthy and restarts == 0
