"""Two real `mixserve serve` processes, --role prefill and --role decode, on 127.0.0.1 free ports.

Through the decode instance (the front), greedy answers equal an offline `both` engine's. A prefill
instance that is killed while it holds a prompt (stopped first, so the prompt is surely in flight) makes
the decode instance fail the request with an error and turn unhealthy within 10 s; one that only hangs
does too, by the link's silence rule.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from mixserve.disagg.link import SILENCE_S
from mixserve.distributed.group import free_port
from mixserve.engine.llm import LLM
from mixserve.engine.sampling_params import SamplingParams
from tests.disagg.conftest import until

START_DEADLINE_S = 120.0
FAIL_WITHIN_S = 10.0
COMMON = ["--threads", "1", "--num-blocks", "256", "--block-size", "4", "--prefill-chunk", "8",
          "--max-batch-tokens", "32"]
PROMPTS = [[(5 * i + 11 * k) % 300 + 5 for i in range(n)] for k, n in enumerate([6, 19, 33, 50])]


@dataclass
class Instance:
    proc: subprocess.Popen
    url: str
    log: Path

    def health(self) -> int | None:
        """/health's status, or None once nothing listens."""
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code
        except httpx.TransportError:
            return None


def start(model: Path, role: str, peer: str, log: Path) -> tuple[subprocess.Popen, queue.Queue[str]]:
    cmd = [sys.executable, "-m", "mixserve", "serve", "--model", str(model), "--port", "0", "--role", role,
           "--kv-peer", peer, *COMMON]
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    return proc, lines


def wait_url(proc: subprocess.Popen, lines: queue.Queue[str], log: Path) -> str:
    deadline = time.monotonic() + START_DEADLINE_S
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            continue
        if " at http://" in line:
            return line.rsplit(" at ", 1)[1].strip()
    raise AssertionError(f"{log.name} did not start: {log.read_text()[-2000:]}")


@pytest.fixture
def pair(tiny_model_dir: Path, tmp_path: Path) -> Iterator[tuple[Instance, Instance]]:
    """A prefill instance and a decode instance joined by a KV link; both gone afterwards."""
    peer = f"127.0.0.1:{free_port()}"
    started = [start(tiny_model_dir, role, peer, tmp_path / f"{role}.log") for role in ("prefill", "decode")]
    try:
        instances = [Instance(proc, wait_url(proc, lines, tmp_path / f"{role}.log"), tmp_path / f"{role}.log")
                     for (proc, lines), role in zip(started, ("prefill", "decode"), strict=True)]
        yield instances[0], instances[1]
    finally:
        for proc, _ in started:
            with_signal(proc, signal.SIGCONT)
            proc.kill()
            proc.wait(30)


def with_signal(proc: subprocess.Popen, sig: int) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, sig)


def completion(url: str, prompt: list[int], max_tokens: int, **extra: object) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return float("nan")


def test_greedy_answers_through_the_pair_equal_one_both_engine(pair, tiny_model_dir: Path):
    prefill, decode = pair
    llm = LLM(str(tiny_model_dir), threads=1, num_blocks=256, block_size=4, prefill_chunk=8,
              max_batch_tokens=32, dtype="float32")
    expected = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=10, temperature=0,
                                                                           ignore_eos=True), use_tqdm=False)]
    tokenizer = llm.engine.tokenizer
    answers = []
    for prompt in PROMPTS:
        r = completion(decode.url, prompt, 10)
        assert r.status_code == 200, r.text
        answers.append(r.json()["choices"][0]["text"])
    assert answers == [tokenizer.decode(ids) for ids in expected]
    # 3 of the 4 prompts have a full block to hand over: their KV came from the prefill instance
    assert metric(decode.url, "mixserve:prefix_cache_hits_total") == sum(
        (len(p) - 1) // 4 * 4 for p in PROMPTS)
    assert prefill.health() == 200 and decode.health() == 200


def stream_outcome(url: str, prompt: list[int], out: queue.Queue) -> None:
    """Stream a completion; put ('error', event), ('done', n) or ('status', code) on `out`."""
    body = {"prompt": prompt, "max_tokens": 20, "temperature": 0, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            if r.status_code != 200:
                out.put(("status", r.status_code))
                return
            tokens = 0
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    if "error" in event:
                        out.put(("error", event))
                        return
                    tokens += 1
            out.put(("done", tokens))
    except httpx.TransportError as exc:
        out.put(("transport", repr(exc)))


@pytest.mark.parametrize("kill", [True, False], ids=["killed", "hung"])
def test_a_dead_prefill_instance_fails_in_flight_requests_and_the_front(pair, kill: bool):
    prefill, decode = pair
    with_signal(prefill.proc, signal.SIGSTOP)  # it holds the prompt without answering
    outcome: queue.Queue = queue.Queue()
    threading.Thread(target=stream_outcome, args=(decode.url, PROMPTS[3], outcome), daemon=True).start()
    until(lambda: metric(decode.url, "mixserve:num_requests_waiting") >= 1, 30, "the prompt to go out")
    start = time.monotonic()
    if kill:
        with_signal(prefill.proc, signal.SIGKILL)
    within = FAIL_WITHIN_S if kill else SILENCE_S + 2.0  # a hang is only silence until SILENCE_S
    kind, detail = outcome.get(timeout=within + 5)
    failed_after = time.monotonic() - start
    assert kind in ("error", "status") and failed_after < within, (kind, detail, failed_after)
    # the front says it cannot serve: /health 503 while it shuts down, then it exits 1
    until(lambda: decode.health() in (503, None), within, "/health 503")
    assert decode.proc.wait(30) == 1
    assert "the prefill instance" in decode.log.read_text()


def test_a_killed_decode_instance_takes_the_prefill_instance_down(pair):
    prefill, decode = pair
    assert completion(decode.url, PROMPTS[2], 2).status_code == 200
    with_signal(decode.proc, signal.SIGKILL)
    until(lambda: prefill.health() in (503, None), FAIL_WITHIN_S, "the prefill instance's /health 503")
    assert prefill.proc.wait(30) == 1
    assert "the decode instance is gone" in prefill.log.read_text()
