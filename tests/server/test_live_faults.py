"""The live server when things go wrong inside it: preemption, a failed step, a hung step, SIGTERM mid-way.

Every client gets a well-formed end: a stream its chunks, an error event or a finish, then [DONE]; a plain
request a JSON answer or an error in the OpenAI shape. Never a cut connection.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

from tests.server.conftest import LiveServer, start_server, wait_until

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]  # each starts a server of its own

COMPLETIONS = "/v1/completions"


def _stream(server: LiveServer, body: dict, lines: list[str], started: threading.Event) -> None:
    with httpx.stream("POST", f"{server.url}{COMPLETIONS}", json={**body, "stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            if line:
                lines.append(line)
                started.set()


def _ended_well(lines: list[str]) -> str:
    """'finished' or 'error' for a stream that ended with [DONE] after a finish or an error event."""
    assert lines and lines[-1] == "data: [DONE]", lines[-3:]
    last = json.loads(lines[-2].removeprefix("data: "))
    if "error" in last:
        assert set(last["error"]) == {"message", "type", "param", "code"}
        return "error"
    assert last["choices"][0]["finish_reason"] in ("length", "stop")
    return "finished"


def test_preemption_through_the_server_gives_each_request_its_answer_alone(tiny_model_dir, tmp_path,
                                                                          record_property):
    # 24 blocks x 16 = 384 tokens of KV for 16 requests of ~50 tokens each: they must take turns
    server = start_server(tiny_model_dir, tmp_path / "stderr.log", "--num-blocks", "24",
                          "--max-num-seqs", "16")
    try:
        bodies = [{"prompt": f"request {i} says", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
                  for i in range(16)]
        alone = [httpx.post(f"{server.url}{COMPLETIONS}", json=b, timeout=60).json()["choices"][0]["text"]
                 for b in bodies]

        async def together() -> list[str]:
            async with httpx.AsyncClient(timeout=120) as client:
                url = f"{server.url}{COMPLETIONS}"
                rs = await asyncio.gather(*(client.post(url, json=b) for b in bodies))
            return [r.json()["choices"][0]["text"] for r in rs]

        assert asyncio.run(together()) == alone
        preemptions = server.metrics()["mixserve:num_preemptions_total"]
        record_property("preemptions", preemptions)
        assert preemptions > 0
    finally:
        server.stop()


def test_a_failed_step_ends_its_streams_and_the_server_serves_again(tiny_model_dir, tmp_path,
                                                                   record_property):
    # step 200: late enough for all three streams to have joined (they arrive within milliseconds), early
    # enough that none has finished (900 tokens each)
    server = start_server(tiny_model_dir, tmp_path / "stderr.log", env={"MIXSERVE_FAULT_STEP": "200"})
    try:
        streams = [([], threading.Event()) for _ in range(3)]
        threads = [threading.Thread(target=_stream, args=(server, {"prompt": f"s{i}", "max_tokens": 900,
                                                                   "ignore_eos": True}, *s))
                   for i, s in enumerate(streams)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert [_ended_well(lines) for lines, _ in streams] == ["error"] * 3, server.log.read_text()[-3000:]
        failed_at = time.monotonic()
        wait_until(lambda: httpx.post(f"{server.url}{COMPLETIONS}", json={"prompt": "again", "max_tokens": 3},
                                      timeout=10).status_code == 200, "a request served after the restart",
                   deadline_s=5)
        record_property("served_again_after_s", round(time.monotonic() - failed_at, 3))
        assert time.monotonic() - failed_at < 5
        m = server.metrics()
        assert m["mixserve:engine_restarts_total"] == 1 and m["mixserve:kv_cache_usage_perc"] == 0
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    finally:
        server.stop()


def test_a_hung_step_ends_its_streams_and_the_server_exits_non_zero(tiny_model_dir, tmp_path):
    server = start_server(tiny_model_dir, tmp_path / "stderr.log", "--step-timeout", "1",
                          env={"MIXSERVE_FAULT_STEP": "10:hang"})
    try:
        lines: list[str] = []
        body = {"prompt": "hang", "max_tokens": 500, "ignore_eos": True}
        client = threading.Thread(target=_stream, args=(server, body, lines, threading.Event()))
        client.start()
        client.join(60)
        assert _ended_well(lines) == "error" and "watchdog" in lines[-2]
        assert server.proc.wait(30) == 1
        assert "the engine is dead" in server.log.read_text()
    finally:
        if server.proc.poll() is None:
            server.proc.kill()


def test_sigterm_past_the_grace_period_ends_every_response_properly(tiny_model_dir, tmp_path):
    # every step >= 50 ms (the slow failpoint): 900 tokens take >= 45 s, far past the 1 s grace on any CPU
    server = start_server(tiny_model_dir, tmp_path / "stderr.log", "--shutdown-timeout", "1",
                          env={"MIXSERVE_FAULT_STEP": "1:slow"})
    body = {"prompt": "keep going", "max_tokens": 900, "ignore_eos": True}
    streams = [([], threading.Event()) for _ in range(2)]
    plain: list[httpx.Response] = []
    threads = [threading.Thread(target=_stream, args=(server, body, *s)) for s in streams]
    threads += [threading.Thread(target=lambda: plain.append(
        httpx.post(f"{server.url}{COMPLETIONS}", json=body, timeout=120))) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        for _, started in streams:
            assert started.wait(60), "no token streamed"
        wait_until(lambda: server.metrics()["mixserve:num_requests_running"] == 4, "four running requests")
        rc = server.stop(timeout=60)
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
    for t in threads:
        t.join(60)
    assert rc == 0, server.log.read_text()
    assert [_ended_well(lines) for lines, _ in streams] == ["error"] * 2
    assert [r.status_code for r in plain] == [503, 503]
    assert all(r.json()["error"]["type"] == "service_unavailable" for r in plain)
