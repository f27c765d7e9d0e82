"""SIGTERM: the server stops accepting, lets the in-flight stream finish, and exits 0."""

from __future__ import annotations

import threading

import httpx
import pytest

from tests.server.conftest import start_server, wait_until

pytestmark = pytest.mark.timeout(300)


def test_sigterm_finishes_the_in_flight_stream_then_exits_0(tiny_model_dir, tmp_path):
    server = start_server(tiny_model_dir, tmp_path / "stderr.log", "--shutdown-timeout", "60")
    lines: list[str] = []
    first_token = threading.Event()

    def stream() -> None:
        body = {"prompt": "keep going", "max_tokens": 200, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    first_token.set()

    client = threading.Thread(target=stream)
    client.start()
    try:
        assert first_token.wait(60), "no token streamed"
        rc = server.stop(timeout=120)
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
    client.join(60)
    assert rc == 0, server.log.read_text()
    assert lines[-1] == "data: [DONE]"
    assert '"finish_reason": "length"' in lines[-2]  # finished, not cut off
    wait_until(lambda: _refused(server.url), "the port to refuse connections", deadline_s=10)


def _refused(url: str) -> bool:
    try:
        httpx.get(f"{url}/health", timeout=2)
    except httpx.TransportError:
        return True
    return False
