"""The client against a fake OpenAI-compatible server on 127.0.0.1 (fake_http.py): SSE parsing, usage,
failures, concurrency and the run's deadline."""

from __future__ import annotations

import asyncio
import socket

from mixserve.bench.client import base_url, run_load
from mixserve.bench.workload import RequestSpec
from tests.bench.fake_http import FakeServer, Reply, json_reply, sse


def completions(seen: list[dict]):
    """Streams max_tokens tokens, the first two merged into one chunk, the last with its finish_reason."""

    async def handler(method: str, path: str, body) -> Reply:
        if path == "/v1/models":
            return json_reply(200, {"object": "list", "data": [{"id": "fake-model"}]})
        seen.append(body)
        if len(body["prompt"]) > 100:
            return json_reply(400, {"error": {"message": "prompt too long"}})
        n = body["max_tokens"]
        events = [{"choices": [{"index": 0, "text": "ab", "finish_reason": None}]}]
        events += [{"choices": [{"index": 0, "text": "c", "finish_reason": None}]} for _ in range(n - 3)]
        events.append({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})  # text held back
        events.append({"choices": [], "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": n,
                                                "total_tokens": len(body["prompt"]) + n}})
        return Reply(200, sse(events))

    return handler


def load(handler, specs, path: str = "", **kw):
    async def go():
        async with FakeServer(handler) as srv:
            return await run_load(srv.url + path, specs, progress=False, **kw)

    return asyncio.run(go())


def test_base_url_accepts_the_root_or_the_completions_url():
    assert base_url("http://h:1/") == "http://h:1"
    assert base_url("http://h:1/v1/completions") == "http://h:1"
    assert base_url("http://h:1/v1") == "http://h:1"


def test_run_load_streams_token_prompts_and_reads_usage():
    seen: list[dict] = []
    specs = [RequestSpec(0, 0.0, [1, 2, 3], 3, 5), RequestSpec(1, 0.0, [4] * 10, 10, 4, "long")]
    run = load(completions(seen), specs)
    results = run.results
    assert run.model == "fake-model" and run.duration >= 0
    assert all(b["stream"] and b["stream_options"] == {"include_usage": True} and b["ignore_eos"]
               for b in seen)
    assert sorted(b["prompt"] for b in seen) == [[1, 2, 3], [4] * 10]
    assert all(b["max_tokens"] == s.output_len and b["temperature"] == 0.0 and "logprobs" not in b
               for b, s in zip(sorted(seen, key=lambda b: len(b["prompt"])), specs, strict=True))
    r0, r1 = results
    assert r0.ok and r1.ok and r1.kind == "long"
    # 5 tokens in 4 chunks: the first chunk held two; the last had no text yet still a token
    assert len(r0.token_times) == 4 and r0.completion_tokens == 5 and r0.prompt_tokens == 3
    assert r0.token_times == sorted(r0.token_times) and r0.ttft >= 0 and r0.end >= r0.token_times[-1]


def test_logprobs_are_requested_only_when_asked():
    seen: list[dict] = []
    load(completions(seen), [RequestSpec(0, 0.0, [1], 1, 3)], model="m", logprobs=0)
    assert seen[0]["logprobs"] == 0


def test_http_errors_become_failed_results_with_reasons():
    specs = [RequestSpec(0, 0.0, [1] * 200, 200, 4), RequestSpec(1, 0.0, [1], 1, 2)]
    results = load(completions([]), specs, "/v1/completions", model="m").results
    assert not results[0].ok and results[0].error.startswith("HTTP 400") and "too long" in results[0].error
    assert results[1].ok


def test_connection_failures_are_reported_not_raised():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = asyncio.run(run_load(f"http://127.0.0.1:{port}", [RequestSpec(0, 0.0, [1], 1, 2)], model="m",
                               progress=False))
    assert not run.results[0].ok and run.results[0].error.startswith("ConnectionRefusedError")


def test_max_concurrency_bounds_requests_in_flight():
    in_flight, peak, started = 0, 0, 0
    changed = asyncio.Condition()

    async def handler(method: str, path: str, body) -> Reply:
        nonlocal in_flight, peak, started
        async with changed:
            in_flight, started = in_flight + 1, started + 1
            peak = max(peak, in_flight)
            changed.notify_all()
            async with asyncio.timeout(10):  # each answer waits for a second request in flight (or the last)
                await changed.wait_for(lambda: in_flight >= 2 or started == 6)
            in_flight -= 1
        return Reply(200, sse([{"choices": [{"text": "x", "finish_reason": None}]}]))

    specs = [RequestSpec(i, 0.0, [1], 1, 1) for i in range(6)]
    results = load(handler, specs, model="m", max_concurrency=2).results
    assert all(r.ok for r in results) and peak == 2


def test_the_run_deadline_cancels_unfinished_requests_and_reports_them():
    async def one_token_then_silence():
        yield b'data: {"choices": [{"text": "x", "finish_reason": null}]}\n\n'
        await asyncio.Event().wait()  # a server that stops sending mid-stream

    async def handler(method: str, path: str, body) -> Reply:
        if body["max_tokens"] == 1:
            return Reply(200, sse([{"choices": [{"text": "x", "finish_reason": "length"}]}]))
        return Reply(200, one_token_then_silence())

    # answered; one token then silence; not due to be sent before the deadline
    specs = [RequestSpec(0, 0.0, [1], 1, 1), RequestSpec(1, 0.0, [1], 1, 5),
             RequestSpec(2, 3600.0, [1], 1, 1)]
    results = load(handler, specs, model="m", max_duration_s=0.2).results
    assert results[0].ok
    assert [r.error.split(":")[0] for r in results[1:]] == ["deadline", "deadline"]
    assert len(results[1].token_times) == 1 and results[2].token_times == []  # what came is kept


def test_the_bench_never_imports_the_engine():
    # it must work against any OpenAI-compatible server: HTTP only, no torch, no engine
    import subprocess
    import sys

    code = ("import sys, mixserve.cli\nmixserve.cli.build_parser()\n"
            "import mixserve.bench.sweep, mixserve.bench.plot, mixserve.bench.run\n"
            "layers = ('mixserve.engine', 'mixserve.model', 'mixserve.runner', 'mixserve.server')\n"
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith(layers)]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True)
