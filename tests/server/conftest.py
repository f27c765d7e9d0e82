"""The real server as a subprocess: `python -m mixserve serve --model <tiny> --port 0`, polled until ready."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

START_DEADLINE_S = 120.0
READY = re.compile(r"serving .* at (http://\S+)")


@dataclass
class LiveServer:
    """A running `mixserve serve`: its URL, process and stderr log."""

    url: str
    proc: subprocess.Popen
    log: Path

    def metrics(self) -> dict[str, float]:
        """The unlabelled samples of /metrics, by name."""
        out = {}
        for line in httpx.get(f"{self.url}/metrics", timeout=10).text.splitlines():
            if line and not line.startswith("#") and "{" not in line:
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, then the exit code (killing it only if it outlives `timeout`)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise


def start_server(model_dir: Path, log: Path, *extra: str, env: dict[str, str] | None = None) -> LiveServer:
    """Start the server on a free port and return once /health answers 200; `env` adds variables."""
    cmd = [sys.executable, "-m", "mixserve", "serve", "--model", str(model_dir), "--port", "0",
           "--threads", "1", "--num-blocks", "512", *extra]
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True,
                                env={**os.environ, **(env or {})})
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    deadline = time.monotonic() + START_DEADLINE_S
    url = None
    while url is None:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the server did not start (exit {proc.poll()}):\n{log.read_text()}")
        try:
            match = READY.search(lines.get(timeout=0.5))
        except queue.Empty:
            continue
        url = match.group(1) if match else None
    while True:  # ready line printed; /health must agree
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return LiveServer(url, proc, log)
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"/health never answered 200:\n{log.read_text()}")
        time.sleep(0.1)


@pytest.fixture(scope="session")
def live_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """One server on the tiny model shared by the live tests (they leave it idle when they end)."""
    server = start_server(tiny_model_dir, tmp_path_factory.mktemp("serve") / "stderr.log")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def client(live_server: LiveServer) -> openai.OpenAI:
    """The official openai client on the shared live server (modules may define their own `client`)."""
    return openai.OpenAI(base_url=f"{live_server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def wait_until(condition, what: str, deadline_s: float = 30.0, every_s: float = 0.05) -> None:
    """Poll `condition` until it holds; fail after a bounded deadline."""
    deadline = time.monotonic() + deadline_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(every_s)
