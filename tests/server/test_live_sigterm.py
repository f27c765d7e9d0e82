"""SIGTERM: the server stops accepting, finishes in-flight streams, exits 0 (past the grace period:
test_live_faults.py); a KV cache smaller than the context."""

from __future__ import annotations

import threading

import httpx
import pytest

from tests.server.conftest import start_server, wait_until

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]  # each starts a server of its own


@pytest.fixture(scope="module")
def small_server(tiny_model_dir, tmp_path_factory):
    """A KV cache of 40 blocks x 16 = 640 tokens (the context is 1024)."""
    log = tmp_path_factory.mktemp("small") / "stderr.log"
    server = start_server(tiny_model_dir, log, "--num-blocks", "40", "--shutdown-timeout", "0")
    try:
        yield server
    finally:
        if server.proc.poll() is None:
            server.stop()


def test_a_prompt_alone_over_the_kv_cache_names_the_prompt_even_on_chat(small_server):
    chat = {"messages": [{"role": "user", "content": "hi " * 700}]}  # no max_tokens sent
    r = httpx.post(f"{small_server.url}/v1/chat/completions", json=chat, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    body = {"prompt": [5] * 700, "max_tokens": 1}
    r = httpx.post(f"{small_server.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text


def test_request_over_the_kv_cache_is_a_400(small_server):
    r = httpx.post(f"{small_server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 700}, timeout=30)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "max_tokens" and "KV cache" in r.json()["error"]["message"]
    url = f"{small_server.url}/v1/completions"
    fits = httpx.post(url, json={"prompt": "hi", "max_tokens": 8}, timeout=60)
    assert fits.status_code == 200


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
