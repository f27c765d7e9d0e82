"""The load client: sends each request at its arrival offset and timestamps every streamed token."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx
from tqdm import tqdm

from mixserve.bench.lean_http import StreamedPost
from mixserve.bench.report import RequestResult
from mixserve.bench.workload import RequestSpec

COMPLETIONS_PATH = "/v1/completions"


def base_url(url: str) -> str:
    """The server's root from either its root or its /v1/completions URL."""
    url = url.rstrip("/")
    for suffix in (COMPLETIONS_PATH, "/v1"):
        if url.endswith(suffix):
            return url[: -len(suffix)]
    return url


def request_body(spec: RequestSpec, model: str, logprobs: int | None = None) -> dict:
    """A greedy streaming /v1/completions body that asks for exactly spec.output_len tokens.

    logprobs (any N >= 0) makes servers that hold back incomplete text still send one chunk per token.
    """
    body = {
        "model": model,
        "prompt": spec.prompt,
        "max_tokens": spec.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    if logprobs is not None:
        body["logprobs"] = logprobs
    return body


async def stream_one(
    url: str, model: str, spec: RequestSpec, t0: float, logprobs: int | None = None,
    r: RequestResult | None = None, timeout_s: float = 600.0,
) -> RequestResult:
    """Stream one completion into r (a new one by default); every failure becomes r.error, never an
    exception. A caller that cancels it keeps, in r, the tokens that had come. `timeout_s` bounds each
    wait for the server (connecting, its next bytes), not the whole stream."""
    r = r if r is not None else RequestResult(spec.index, spec.kind, spec.prompt_len, spec.output_len)
    r.start = time.perf_counter() - t0
    try:
        async with StreamedPost(url, request_body(spec, model, logprobs), timeout_s) as resp:
            if resp.status != 200:
                r.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return r
            async for line in resp.lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter() - t0
                event = json.loads(data)
                if "error" in event:
                    r.error = f"stream error: {event['error']}"[:300]
                    return r
                # Every chunk with a choice carries at least one new token (the last one its finish_reason
                # too); servers may hold back text that is not whole UTF-8 yet, so usage gives the count.
                if event.get("choices"):
                    r.token_times.append(now)
                if usage := event.get("usage"):
                    r.prompt_tokens = usage.get("prompt_tokens")
                    r.completion_tokens = usage.get("completion_tokens")
    except (OSError, EOFError, TimeoutError, ValueError, asyncio.LimitOverrunError) as e:
        # (ValueError: ProtocolError and json.JSONDecodeError; OSError: refused, reset, TLS)
        r.error = f"{type(e).__name__}: {e}"[:300]
        return r
    finally:
        r.end = time.perf_counter() - t0
    if not r.token_times:
        r.error = "no tokens: the stream ended before the first token"
        return r
    r.ok = True
    return r


async def discover_model(client: httpx.AsyncClient, root: str) -> str:
    """The first model /v1/models lists; 'default' when the server has no such endpoint."""
    try:
        resp = await client.get(f"{root}/v1/models")
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError):
        return "default"


@dataclass
class LoadRun:
    """The results of one load run and the clocks at its start (to line up the server's step trace)."""

    results: list[RequestResult]
    duration: float
    model: str
    t0_monotonic: float
    t0_wall: float


async def run_load(
    url: str,
    specs: Sequence[RequestSpec],
    *,
    model: str | None = None,
    max_concurrency: int | None = None,
    timeout_s: float = 600.0,
    progress: bool = True,
    logprobs: int | None = None,
    max_duration_s: float | None = None,
) -> LoadRun:
    """Send every spec at its arrival offset (seconds after start) and stream them all to the end.

    max_duration_s bounds the whole run: what has not finished by then is cancelled (the server sees the
    client leave) and reported failed, so an overloaded server cannot hold the bench forever.
    """
    root = base_url(url)
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    if model is None:
        async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=30.0)) as client:
            model = await discover_model(client, root)
    bar = tqdm(total=len(specs), desc="requests", unit="req", disable=not progress, leave=False)
    t0, t0_monotonic, t0_wall = time.perf_counter(), time.monotonic(), time.time()

    async def send(spec: RequestSpec, r: RequestResult) -> None:
        await asyncio.sleep(max(0.0, spec.arrival_s - (time.perf_counter() - t0)))
        if gate is None:
            await stream_one(root + COMPLETIONS_PATH, model, spec, t0, logprobs, r, timeout_s)
            return
        async with gate:
            await stream_one(root + COMPLETIONS_PATH, model, spec, t0, logprobs, r, timeout_s)

    async def one(spec: RequestSpec) -> RequestResult:
        r = RequestResult(spec.index, spec.kind, spec.prompt_len, spec.output_len)
        left = None if max_duration_s is None else max_duration_s - (time.perf_counter() - t0)
        try:
            async with asyncio.timeout(left):
                await send(spec, r)
        except TimeoutError:
            # the tokens that came stay in r: the cross-check with the server counts them too
            r.ok, r.error = False, f"deadline: unfinished after the run's {max_duration_s} s"
            r.end = time.perf_counter() - t0
        bar.update(1)
        return r

    results = await asyncio.gather(*(one(s) for s in specs))
    duration = time.perf_counter() - t0
    bar.close()
    return LoadRun(sorted(results, key=lambda r: r.index), duration, model, t0_monotonic, t0_wall)
