"""AsyncEngine over a model-free engine: streams, abort on cancel, a dead step loop, stop, metrics."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import pytest

from mixserve.engine.async_engine import AsyncEngine, EngineDeadError
from mixserve.engine.sampling_params import SamplingParams
from mixserve.metrics import ServerMetrics
from tests.server.fake_engine import FakeEngine

DEADLINE_S = 10.0


async def until(condition, what: str) -> None:
    """Poll `condition` until true, failing after a bounded deadline."""
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def drain(engine: AsyncEngine, rid: str, prompt: list[int], max_tokens: int) -> list:
    return [u async for u in engine.generate(rid, prompt, SamplingParams(max_tokens=max_tokens))]


def test_generate_streams_each_token_then_finishes():
    async def main():
        engine = AsyncEngine(FakeEngine())
        await engine.start()
        updates = await drain(engine, "r", [0, 1], 5)
        await engine.stop(1.0)
        return updates

    updates = asyncio.run(main())
    assert [u.new_text for u in updates] == list("cdefg")
    assert [u.finished for u in updates] == [False] * 4 + [True]
    assert updates[-1].finish_reason == "length"


def test_concurrent_requests_all_finish_with_their_own_tokens():
    async def main():
        engine = AsyncEngine(FakeEngine(max_num_seqs=3))
        results = await asyncio.gather(*(drain(engine, f"r{i}", [i], 4 + i) for i in range(8)))
        await engine.stop(1.0)
        return results

    for i, updates in enumerate(asyncio.run(main())):
        assert len(updates) == 4 + i
        assert updates[0].new_token_ids == [(i + 1) % 26]


def test_step_loop_never_blocks_the_event_loop():
    fake = FakeEngine()
    fake.gate = threading.Event()  # step() blocks until the test opens the gate

    async def main():
        engine = AsyncEngine(fake)
        task = asyncio.create_task(drain(engine, "r", [0], 2))
        await until(lambda: fake.added == ["r"], "the request to reach the engine")
        ticks = 0
        for _ in range(5):  # the loop keeps running other coroutines while a step is blocked
            await asyncio.sleep(0)
            ticks += 1
        assert not task.done()
        fake.gate.set()
        updates = await task
        await engine.stop(1.0)
        return ticks, updates

    ticks, updates = asyncio.run(main())
    assert ticks == 5 and len(updates) == 2


def test_cancelled_stream_aborts_its_request_and_frees_blocks():
    fake = FakeEngine()

    async def main():
        engine = AsyncEngine(fake)
        seen = 0
        # A budget no fake engine exhausts before the abort lands (10,000 tokens it could, and then the
        # request finished instead of being aborted: a flaky test).
        stream = engine.generate("r", [0], SamplingParams(max_tokens=10**9))
        async with contextlib.aclosing(stream) as updates:
            async for _ in updates:
                seen += 1
                if seen == 3:
                    break
        await until(lambda: fake.aborted == ["r"], "the abort")
        await until(lambda: engine.llm.stats().kv_cache_usage == 0, "the blocks to be freed")
        await engine.stop(1.0)
        return seen

    assert asyncio.run(main()) == 3
    assert not fake.has_unfinished()


def test_num_waiting_counts_requests_not_yet_running():
    fake = FakeEngine(max_num_seqs=1)
    fake.gate = threading.Event()

    async def main():
        engine = AsyncEngine(fake)
        tasks = [asyncio.create_task(drain(engine, f"r{i}", [0], 2)) for i in range(4)]
        await until(lambda: engine.num_waiting() == 4, "four waiting requests")
        fake.gate.set()
        await asyncio.gather(*tasks)
        await until(lambda: engine.num_waiting() == 0, "an empty queue")
        await engine.stop(1.0)

    asyncio.run(main())


def test_stop_lets_in_flight_requests_finish_then_refuses_new_ones():
    async def main():
        engine = AsyncEngine(FakeEngine())
        task = asyncio.create_task(drain(engine, "r", [0], 20))
        await asyncio.sleep(0)
        await engine.stop(timeout=5.0)
        with pytest.raises(EngineDeadError):
            await drain(engine, "late", [0], 1)
        return await task

    assert len(asyncio.run(main())) == 20


def test_stop_aborts_what_outlives_the_timeout():
    fake = FakeEngine()
    fake.gate = threading.Event()

    async def main():
        engine = AsyncEngine(fake, idle_timeout=0.05)
        task = asyncio.create_task(drain(engine, "r", [0], 20))
        await until(lambda: fake.added == ["r"], "the request to reach the engine")
        stopping = asyncio.create_task(engine.stop(timeout=0.1))
        await until(lambda: engine._stop_requested, "the stop flag")
        fake.gate.set()  # the blocked step returns; the loop sees the stop flag and aborts
        await stopping
        return await asyncio.gather(task, return_exceptions=True)

    (result,) = asyncio.run(main())
    assert isinstance(result, EngineDeadError)
    assert not fake.has_unfinished()


def test_metrics_observe_ttft_every_token_gap_and_token_counts():
    metrics = ServerMetrics()

    async def main():
        engine = AsyncEngine(FakeEngine(), metrics)
        await drain(engine, "a", [0, 1, 2], 5)
        await drain(engine, "b", [0], 3)
        await engine.stop(1.0)

    asyncio.run(main())
    value = metrics.registry.get_sample_value
    assert value("mixserve:time_to_first_token_seconds_count") == 2
    assert value("mixserve:time_per_output_token_seconds_count") == (5 - 1) + (3 - 1)
    assert value("mixserve:e2e_request_latency_seconds_count") == 2
    assert value("mixserve:generation_tokens_total") == 8
    assert value("mixserve:prompt_tokens_total") == 4
    assert value("mixserve:num_requests_running") == 0
    assert value("mixserve:kv_cache_usage_perc") == 0
    assert value("mixserve:step_tokens_count") >= 5


def test_start_after_stop_serves_again():
    async def main():
        engine = AsyncEngine(FakeEngine())
        await engine.start()
        first = await drain(engine, "a", [0], 2)
        await engine.stop(1.0)
        assert not engine.running and engine.healthy
        await engine.start()
        second = await drain(engine, "b", [0], 3)
        await engine.stop(1.0)
        return first, second

    first, second = asyncio.run(main())
    assert (len(first), len(second)) == (2, 3)


def test_metrics_read_the_engines_clock_from_the_updates():
    from mixserve.engine.outputs import RequestUpdate
    from mixserve.engine.streams import Tracked

    seen: list[tuple[str, float]] = []

    class Recorder:
        def observe_first_token(self, ttft):
            seen.append(("ttft", round(ttft, 6)))

        def observe_token_gap(self, gap):
            seen.append(("gap", round(gap, 6)))

    tracked = Tracked("r", [1, 2, 3], None, 10.0, None, None)  # type: ignore[arg-type]
    first = RequestUpdate("r", [5], "a", False, None, None, None, token_times=(10.5,))
    later = RequestUpdate("r", [6, 7], "bc", False, None, None, None, token_times=(10.75, 11.0),
                          prev_token_time=10.5)
    sibling = RequestUpdate("r", [8], "d", False, None, None, None, index=1, token_times=(10.6,))
    for update in (first, later, sibling):
        tracked.observe(update, Recorder())
    assert seen == [("ttft", 0.5), ("gap", 0.25), ("gap", 0.25)]  # the sibling's first token: no TTFT


def test_token_counters_are_the_engines_totals():
    from mixserve.core.stats import EngineStats, SchedulerStats

    m = ServerMetrics()
    value = m.registry.get_sample_value
    sched = SchedulerStats(1, 0, 64, 60, 2, 1, 0)
    m.observe_stats(EngineStats(sched, 1, 10, 3, 2), stepped=True)
    m.observe_stats(EngineStats(sched, 2, 10, 5, 2), stepped=True)
    counts = ("prompt_tokens_total", "generation_tokens_total", "num_preemptions_total")
    assert [value(f"mixserve:{c}") for c in counts] == [10, 5, 2]
    m.observe_stats(EngineStats(sched, 1, 4, 1, 2), stepped=True)  # a smaller total: a new engine's, all new
    m.observe_stats(sched, stepped=False)  # a bare SchedulerStats carries no token totals: they stay
    assert [value(f"mixserve:{c}") for c in counts] == [14, 6, 2]


def test_metrics_count_what_the_engine_counts_not_what_the_streams_saw():
    metrics = ServerMetrics()
    fake = FakeEngine()

    async def main():
        engine = AsyncEngine(fake, metrics)
        await drain(engine, "a", [0, 1, 2], 4)
        fake.generation_tokens_total += 7  # tokens no stream saw (as a request aborted mid-step)
        await drain(engine, "b", [0], 1)
        await engine.stop(1.0)

    asyncio.run(main())
    value = metrics.registry.get_sample_value
    assert value("mixserve:generation_tokens_total") == fake.stats().num_generation_tokens_total == 4 + 7 + 1
    assert value("mixserve:prompt_tokens_total") == fake.stats().num_prompt_tokens_total == 3 + 1
