"""The front's /health while its prefill instance is killed: a real `mixserve serve --role prefill` process,
the decode side in this process behind the app (create_app), so /health can be read after the engine died
(a real server exits right after, as test_live.py checks)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from fastapi.testclient import TestClient

from mixserve.disagg.decode_side import DecodeEngine
from mixserve.disagg.kv_blocks import describe
from mixserve.disagg.link import DECODE, KVLink
from mixserve.disagg.roles import IDLE_POLL_S
from mixserve.distributed.group import free_port
from mixserve.engine.async_engine import AsyncEngine
from mixserve.server import create_app
from tests.disagg.conftest import options, tiny_runner, until

LOCAL = "http://127.0.0.1"
FAIL_WITHIN_S = 10.0


def waiting(client: TestClient) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("mixserve:num_requests_waiting "):
            return float(line.split()[1])
    return 0.0


def test_a_killed_prefill_instance_fails_the_request_and_health_turns_503(tiny_model_dir: Path,
                                                                          tmp_path: Path):
    port = free_port()
    cmd = [sys.executable, "-m", "mixserve", "serve", "--model", str(tiny_model_dir), "--port", "0",
           "--role", "prefill", "--kv-peer", f"127.0.0.1:{port}", "--threads", "1", "--num-blocks", "256",
           "--block-size", "4"]
    log = open(tmp_path / "prefill.log", "w")  # noqa: SIM115 - closed in finally
    prefill = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        decode = DecodeEngine(tiny_runner(tiny_model_dir, 256), options(num_blocks=256))
        link = KVLink.connect(DECODE, "127.0.0.1", port, describe(decode.runner))
        decode.attach(link)
        with TestClient(create_app(AsyncEngine(decode, idle_timeout=IDLE_POLL_S)), base_url=LOCAL) as client:
            ok = client.post("/v1/completions", json={"prompt": list(range(5, 30)), "max_tokens": 3})
            assert ok.status_code == 200 and decode.num_imported == 1  # the pair works
            os.kill(prefill.pid, signal.SIGSTOP)  # holds the next prompt without answering
            out: list[str] = []
            body = {"prompt": list(range(40, 80)), "max_tokens": 5, "stream": True}
            t = threading.Thread(target=lambda: out.append(client.post("/v1/completions", json=body).text))
            t.start()
            until(lambda: waiting(client) >= 1, 30, "the prompt to go out")
            os.kill(prefill.pid, signal.SIGKILL)
            killed = time.monotonic()
            t.join(FAIL_WITHIN_S)
            assert out, "the in-flight request did not end"
            events = [line[6:] for line in out[0].split("\n\n") if line.startswith("data: ")]
            assert events[-1] == "[DONE]" and "prefill instance" in json.loads(events[-2])["error"]["message"]
            left = FAIL_WITHIN_S - (time.monotonic() - killed)
            until(lambda: client.get("/health").status_code == 503, left, "/health 503")
            assert "prefill instance is gone" in client.get("/health").text
            assert client.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 1}).status_code == 503
    finally:
        if prefill.poll() is None:
            os.kill(prefill.pid, signal.SIGCONT)
            prefill.kill()
        prefill.wait(30)
        log.close()
