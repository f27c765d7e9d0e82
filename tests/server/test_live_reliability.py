"""The live server under attack: a disconnect storm, a burst past the queue, huge and slow bodies, a prompt
of megabytes. Each part against a real `mixserve serve` on 127.0.0.1 (issue 13's reliability suite)."""

from __future__ import annotations

import asyncio
import random
import socket
import threading
import time
from collections.abc import Iterator
from urllib.parse import urlparse

import httpx
import pytest

from tests.server.conftest import LiveServer, start_server, wait_until

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

COMPLETIONS = "/v1/completions"
MAX_WAITING = 8
MAX_NUM_SEQS = 4


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory) -> Iterator[LiveServer]:
    log = tmp_path_factory.mktemp("reliability") / "stderr.log"
    live = start_server(tiny_model_dir, log, "--max-waiting", str(MAX_WAITING), "--max-num-seqs",
                        str(MAX_NUM_SEQS), "--body-timeout", "1")
    try:
        yield live
    finally:
        live.stop()


def _idle(server: LiveServer) -> bool:
    m = server.metrics()
    return (m["mixserve:num_requests_running"], m["mixserve:num_requests_waiting"],
            m["mixserve:kv_cache_usage_perc"]) == (0, 0, 0)


def _rss_peak_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def test_disconnect_storm_leaves_nothing_behind(server: LiveServer, record_property):
    rng = random.Random(13)

    async def stream_then_leave(client: httpx.AsyncClient, leave_after: int) -> None:
        body = {"prompt": "storm", "max_tokens": 500, "stream": True, "ignore_eos": True}
        async with client.stream("POST", f"{server.url}{COMPLETIONS}", json=body) as r:
            if r.status_code != 200:  # a 429 is a fair answer under a storm; nothing to leave
                return
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data: {")
                if seen >= leave_after:
                    return  # leaving the block drops the connection mid-stream

    async def main() -> None:
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=64)) as client:
            for _ in range(10):  # 300 streams in waves of 30
                await asyncio.gather(*(stream_then_leave(client, rng.randint(1, 8)) for _ in range(30)))

    asyncio.run(main())
    left = time.monotonic()
    wait_until(lambda: _idle(server), "running, waiting and KV usage all 0 after the storm", deadline_s=5)
    record_property("storm_idle_after_s", round(time.monotonic() - left, 3))  # --junitxml keeps the figures


def test_a_burst_is_admitted_up_to_the_queue_and_the_rest_get_429(server: LiveServer, record_property):
    wait_until(lambda: _idle(server), "an idle engine before the burst")
    peak_waiting = [0.0]
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak_waiting[0] = max(peak_waiting[0], server.metrics()["mixserve:num_requests_waiting"])

    async def main() -> list[httpx.Response]:
        body = {"prompt": "burst", "max_tokens": 1000, "stream": True, "ignore_eos": True}
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=250)) as client:
            async def one() -> httpx.Response:
                request = client.build_request("POST", f"{server.url}{COMPLETIONS}", json=body)
                return await client.send(request, stream=True)
            responses = await asyncio.gather(*(one() for _ in range(200)))
            for r in responses:
                await r.aclose()  # admitted streams are dropped: their requests are aborted
            return responses

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        responses = asyncio.run(main())
    finally:
        done.set()
        watcher.join()
    admitted = sum(r.status_code == 200 for r in responses)
    refused = [r for r in responses if r.status_code == 429]
    record_property("burst_admitted", admitted)
    record_property("burst_refused_429", len(refused))
    record_property("burst_peak_waiting", peak_waiting[0])
    assert admitted + len(refused) == 200
    assert MAX_WAITING <= admitted <= MAX_NUM_SEQS + MAX_WAITING, admitted
    assert all(r.headers.get("retry-after") == "1" for r in refused)
    assert peak_waiting[0] <= MAX_WAITING
    wait_until(lambda: _idle(server), "an idle engine after the burst", deadline_s=10)


def _raw_upload(server: LiveServer, headers: bytes, chunks: Iterator[bytes]) -> tuple[bytes, int]:
    """Send a request by hand, stopping as soon as the server answers; (its status line, bytes sent)."""
    url = urlparse(server.url)
    sent = 0
    with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
        sock.sendall(headers)
        sock.setblocking(False)
        answer = b""
        for chunk in chunks:
            try:
                answer += sock.recv(65536)
                break  # the server answered before the upload ended
            except BlockingIOError:
                pass
            except OSError:
                break
            try:
                sock.setblocking(True)
                sock.sendall(chunk)
                sock.setblocking(False)
                sent += len(chunk)
            except OSError:  # the server closed the connection: its answer is waiting to be read
                break
        sock.setblocking(True)
        while b"\r\n" not in answer:
            more = sock.recv(65536)
            if not more:
                break
            answer += more
    return answer.split(b"\r\n", 1)[0], sent


def test_a_200_mb_body_is_a_413_before_the_upload_ends(server: LiveServer, record_property):
    size = 200 * 1024 * 1024
    peak_before = _rss_peak_kib(server.proc.pid)
    head = (f"POST {COMPLETIONS} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {size}\r\n\r\n").encode()
    status, sent = _raw_upload(server, head, (b" " * 2**20 for _ in range(200)))
    record_property("body_200mb_sent_before_413_mib", round(sent / 2**20, 1))
    assert b" 413 " in status and sent < size, (status, sent)
    chunked = (f"POST {COMPLETIONS} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               "Transfer-Encoding: chunked\r\n\r\n").encode()
    mib = b"100000\r\n" + b" " * 2**20 + b"\r\n"  # one chunk of 1 MiB (its size in hex)
    status, sent = _raw_upload(server, chunked, (mib for _ in range(200)))
    record_property("chunked_200mb_sent_before_413_mib", round(sent / 2**20, 1))
    assert b" 413 " in status and sent < size, (status, sent)
    grown_mib = (_rss_peak_kib(server.proc.pid) - peak_before) / 1024
    record_property("body_200mb_peak_rss_growth_mib", round(grown_mib, 1))
    assert grown_mib <= 20, f"peak RSS grew {grown_mib:.1f} MiB"
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_a_body_that_never_finishes_is_a_408(server: LiveServer):
    head = (f"POST {COMPLETIONS} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            "Content-Length: 100\r\n\r\n").encode()
    start = time.monotonic()
    status, _ = _raw_upload(server, head, iter([b'{"prompt": ']))
    assert b" 408 " in status, status
    assert time.monotonic() - start < 10


def test_a_megabyte_prompt_is_refused_while_health_keeps_answering(server: LiveServer, record_property):
    latencies: list[float] = []
    done = threading.Event()

    def poll_health() -> None:
        with httpx.Client(timeout=10) as client:
            while not done.is_set():
                start = time.monotonic()
                assert client.get(f"{server.url}/health").status_code == 200
                latencies.append(time.monotonic() - start)
                time.sleep(0.01)

    poller = threading.Thread(target=poll_health)
    poller.start()
    try:
        prompt = "lorem ipsum dolor " * (1_500_000 // 18)  # 1.5 MB: under the body limit, over the context
        r = httpx.post(f"{server.url}{COMPLETIONS}", json={"prompt": prompt, "max_tokens": 1}, timeout=60)
        chat = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                          json={"messages": [{"role": "user", "content": prompt}]})
    finally:
        done.set()
        poller.join()
    record_property("prompt_1_5mb_refused_in_s", round(r.elapsed.total_seconds(), 3))
    record_property("health_max_latency_ms", round(max(latencies) * 1000, 1))
    assert (r.status_code, r.json()["error"]["param"]) == (400, "prompt")
    assert (chat.status_code, chat.json()["error"]["param"]) == (400, "messages")
    assert latencies and max(latencies) < 0.1, f"/health took up to {max(latencies) * 1000:.0f} ms"
