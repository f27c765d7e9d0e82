"""The real server under bad input, load and clients that walk away: a 4xx each, never a 5xx, blocks freed."""

from __future__ import annotations

import asyncio
import threading

import httpx
import openai
import pytest

from tests.server.conftest import LiveServer, wait_until

pytestmark = pytest.mark.timeout(300)

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]

# (route, body or raw bytes, status, param named in the error)
BAD_INPUTS = [
    (COMPLETIONS, b'{"prompt": "hi", "max_tokens": ', 400, None),  # malformed JSON
    (COMPLETIONS, b"[1, 2, 3]", 400, None),  # JSON, but not an object
    (COMPLETIONS, {"max_tokens": 4}, 400, "prompt"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 5000}, 400, "max_tokens"),  # over the 1024-token context
    (COMPLETIONS, {"prompt": [5] * 1100, "max_tokens": 1}, 400, "prompt"),  # the prompt alone is too long
    (COMPLETIONS, {"prompt": [1, 10**9]}, 400, "prompt"),  # outside the vocabulary
    (COMPLETIONS, {"prompt": [-1]}, 400, "prompt"),
    (COMPLETIONS, {"prompt": ["a", "b"]}, 400, "prompt"),
    # lone UTF-16 surrogates (valid JSON escapes, invalid text): no tokenizer takes them
    (COMPLETIONS, rb'{"prompt": "\ud800"}', 400, "prompt"),
    (COMPLETIONS, rb'{"prompt": "hi", "model": "\ud800"}', 404, "model"),
    (CHAT, rb'{"messages": [{"role": "user", "content": "\udfff"}]}', 400, "messages"),
    (COMPLETIONS, {"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    (COMPLETIONS, {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    (COMPLETIONS, {"prompt": "hi", "top_k": -7}, 400, "top_k"),
    (COMPLETIONS, {"prompt": "hi", "min_p": 3}, 400, "min_p"),
    (COMPLETIONS, {"prompt": "hi", "seed": 2**70}, 400, "seed"),
    (COMPLETIONS, {"prompt": "hi", "n": 0}, 400, "n"),
    (COMPLETIONS, {"prompt": "hi", "logprobs": 99}, 400, "logprobs"),
    (COMPLETIONS, {"prompt": "hi", "stop": [""]}, 400, "stop"),
    (COMPLETIONS, {"prompt": "hi", "model": "no-such-model"}, 404, "model"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages.0.role"),
    (CHAT, {"messages": "hi"}, 400, "messages"),
    (CHAT, {"messages": MSG, "max_completion_tokens": 5000}, 400, "max_tokens"),
    (CHAT, {"messages": [{"role": "user", "content": "hi " * 2000}]}, 400, "messages"),  # fills the context
    (CHAT, {"messages": MSG, "top_logprobs": 50, "logprobs": True}, 400, "top_logprobs"),
    (CHAT, {"messages": MSG, "model": "gpt-4o"}, 404, "model"),
]


@pytest.mark.parametrize(("route", "body", "status", "param"), BAD_INPUTS)
def test_bad_input_is_a_4xx_and_the_server_still_serves(live_server: LiveServer, route, body, status, param):
    kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body}
    r = httpx.post(f"{live_server.url}{route}", timeout=30, **kwargs)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    ok = httpx.post(f"{live_server.url}{COMPLETIONS}", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_unknown_route_and_method_are_4xx_in_openai_shape(live_server: LiveServer):
    missing = httpx.get(f"{live_server.url}/v1/engines", timeout=10)
    wrong_method = httpx.get(f"{live_server.url}{COMPLETIONS}", timeout=10)
    assert (missing.status_code, wrong_method.status_code) == (404, 405)
    assert missing.json()["error"]["type"] == "not_found_error" and "error" in wrong_method.json()


def test_64_concurrent_streams_all_complete(live_server: LiveServer):
    async def one(client: openai.AsyncOpenAI, model: str, i: int) -> tuple[str | None, int]:
        stream = await client.completions.create(
            model=model, prompt=f"stream {i}", max_tokens=6, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        finish, usage = None, 0
        async for chunk in stream:
            if chunk.choices:
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
        return finish, usage

    async def main() -> list[tuple[str | None, int]]:
        limits = httpx.Limits(max_connections=100)
        http = httpx.AsyncClient(limits=limits, timeout=120)
        async with openai.AsyncOpenAI(base_url=f"{live_server.url}/v1", api_key="unused", max_retries=0,
                                      http_client=http) as client:
            model = (await client.models.list()).data[0].id
            return await asyncio.gather(*(one(client, model, i) for i in range(64)))

    assert asyncio.run(main()) == [("length", 6)] * 64
    wait_until(lambda: live_server.metrics()["mixserve:num_requests_running"] == 0, "an idle engine")


def _idle(server: LiveServer) -> bool:
    m = server.metrics()
    return m["mixserve:num_requests_running"] == 0 and m["mixserve:kv_cache_usage_perc"] == 0


def test_dropped_streams_are_aborted_and_free_their_blocks(live_server: LiveServer):
    wait_until(lambda: _idle(live_server), "an idle engine before the test")
    before = live_server.metrics()["mixserve:generation_tokens_total"]
    n, max_tokens = 4, 1000

    def stream_then_drop() -> None:
        body = {"prompt": "drop me", "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{live_server.url}{COMPLETIONS}", json=body, timeout=60) as r:
            seen = 0
            for line in r.iter_lines():
                seen += line.startswith("data: {")
                if seen == 3:
                    return  # leaving the block closes the connection mid-stream

    threads = [threading.Thread(target=stream_then_drop) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    wait_until(lambda: _idle(live_server), "running == 0 and KV usage == 0 after the drops")
    generated = live_server.metrics()["mixserve:generation_tokens_total"] - before
    assert generated < n * max_tokens  # aborted, not run to the end


def test_dropped_non_streaming_request_is_aborted(live_server: LiveServer):
    wait_until(lambda: _idle(live_server), "an idle engine before the test")
    before = live_server.metrics()["mixserve:generation_tokens_total"]
    max_tokens = 1000

    async def main() -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            task = asyncio.create_task(client.post(f"{live_server.url}{COMPLETIONS}", json={
                "prompt": "drop me", "max_tokens": max_tokens, "ignore_eos": True}))
            while live_server.metrics()["mixserve:generation_tokens_total"] - before < 3:
                await asyncio.sleep(0.02)
                assert not task.done(), "the request finished before the test could drop it"
            task.cancel()  # closes the connection with the answer still being generated
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(main())
    wait_until(lambda: _idle(live_server), "running == 0 and KV usage == 0 after the drop")
    assert live_server.metrics()["mixserve:generation_tokens_total"] - before < max_tokens


def test_metrics_count_what_was_served(live_server: LiveServer):
    before = live_server.metrics()
    r = httpx.post(f"{live_server.url}{COMPLETIONS}", json={"prompt": "count me", "max_tokens": 5,
                                                             "ignore_eos": True}, timeout=30)
    after = live_server.metrics()
    prompt_tokens = r.json()["usage"]["prompt_tokens"]
    assert after["mixserve:generation_tokens_total"] - before["mixserve:generation_tokens_total"] == 5
    assert after["mixserve:prompt_tokens_total"] - before["mixserve:prompt_tokens_total"] == prompt_tokens
    assert after["mixserve:time_to_first_token_seconds_count"] - \
        before["mixserve:time_to_first_token_seconds_count"] == 1
    assert after["mixserve:time_per_output_token_seconds_count"] - \
        before["mixserve:time_per_output_token_seconds_count"] == 4
