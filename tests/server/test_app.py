"""The app in process over a model-free engine: answer shapes, SSE framing, errors, auth, 429, a dead loop."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from mixserve.engine.async_engine import AsyncEngine
from tests.server.fake_engine import FakeEngine, make_app

LOCAL = "http://127.0.0.1"  # the app answers loopback Host names only (DNS rebinding)

DEADLINE_S = 10.0


def until(condition, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def events(body: str) -> list[str]:
    """The payloads of an SSE body, in order."""
    return [line[len("data: "):] for line in body.split("\n\n") if line.startswith("data: ")]


@pytest.fixture
def fake() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def client(fake: FakeEngine) -> Iterator[TestClient]:
    with TestClient(make_app(fake), base_url=LOCAL, raise_server_exceptions=False) as c:
        yield c


def test_completion_answers_text_usage_and_finish_reason(client: TestClient):
    r = client.post("/v1/completions", json={"model": "fake-model", "prompt": "ab", "max_tokens": 3})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == "fake-model"
    assert body["choices"][0]["text"] == "cde"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}


def test_completion_takes_token_ids(client: TestClient):
    r = client.post("/v1/completions", json={"prompt": [3, 4], "max_tokens": 2})
    assert r.json()["choices"][0]["text"] == "fg"


def test_chat_answers_an_assistant_message(client: TestClient):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a"}],
                                                   "max_completion_tokens": 2})
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "bc"}
    assert body["usage"]["completion_tokens"] == 2


def test_logprobs_in_completion_and_chat_shapes(client: TestClient):
    r = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, "logprobs": 2})
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == ["b", "c"] and lp["token_logprobs"] == [-0.5, -0.5]
    assert [len(t) for t in lp["top_logprobs"]] == [2, 2] and lp["text_offset"] == [0, 1]
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a"}],
                                                   "max_tokens": 1, "logprobs": True, "top_logprobs": 3})
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert content[0]["token"] == "b" and len(content[0]["top_logprobs"]) == 3


def test_stream_sends_deltas_then_usage_then_done(client: TestClient):
    r = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "a"}], "max_tokens": 3, "stream": True,
        "stream_options": {"include_usage": True}})
    assert r.headers["content-type"].startswith("text/event-stream")
    payloads = events(r.text)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "bcd"
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3


def test_stream_without_include_usage_has_no_usage_chunk(client: TestClient):
    r = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, "stream": True})
    chunks = [json.loads(p) for p in events(r.text)[:-1]]
    assert [c["choices"][0]["text"] for c in chunks] == ["b", "c"]
    assert all("usage" not in c for c in chunks)


def test_stream_sends_a_chunk_per_token_even_while_text_is_held_back(fake: FakeEngine, client: TestClient):
    fake.hold_back_text = True
    r = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 4, "stream": True})
    chunks = [json.loads(p) for p in events(r.text)[:-1]]
    assert [c["choices"][0]["text"] for c in chunks] == ["", "", "", "bcde"]


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/v1/completions", {"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 1000}, 400, "max_tokens"),  # over the fake's 128
    ("/v1/completions", {"prompt": "a", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "a", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "a", "model": "gpt-4"}, 404, "model"),
    ("/v1/completions", {"prompt": [1, 99]}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"max_tokens": 1}, 400, "prompt"),
    ("/v1/completions", {"prompt": "a", "stop": [""]}, 400, "stop"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "a"}]}, 400, "messages.0.role"),
])
def test_bad_input_is_a_4xx_in_openai_shape(client: TestClient, path, body, status, param):
    r = client.post(path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param


def test_malformed_json_is_a_400(client: TestClient):
    headers = {"content-type": "application/json"}
    r = client.post("/v1/completions", content=b'{"prompt": "a",', headers=headers)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_api_key_guards_model_routes_but_not_health(fake: FakeEngine):
    with TestClient(make_app(fake, api_key="s3cret"), base_url=LOCAL) as client:
        body = {"prompt": "a", "max_tokens": 1}
        assert client.post("/v1/completions", json=body).status_code == 401
        wrong = client.post("/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
        assert client.get("/v1/models").status_code == 401
        good = client.post("/v1/completions", json=body, headers={"Authorization": "Bearer s3cret"})
        assert good.status_code == 200
        assert client.get("/health").status_code == 200


def test_too_many_waiting_is_a_429(fake: FakeEngine):
    fake.gate = threading.Event()  # nothing runs: every request stays waiting
    fake.max_num_seqs = 1
    app = make_app(fake, max_waiting=2)
    engine: AsyncEngine = app.state.mixserve.engine
    with TestClient(app, base_url=LOCAL) as client:
        results: list[int] = []
        def post() -> None:
            results.append(client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1}).status_code)

        threads = [threading.Thread(target=post) for _ in range(2)]
        for t in threads:
            t.start()
        until(lambda: engine.num_waiting() == 2, "two waiting requests")
        r = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1})
        assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
        assert r.headers["retry-after"] == "1"
        fake.gate.set()
        for t in threads:
            t.join(DEADLINE_S)
        assert results == [200, 200]


def test_dead_engine_makes_health_503_and_streams_end_with_an_error_event(fake: FakeEngine):
    fake.gate = threading.Event()
    with TestClient(make_app(fake, max_engine_restarts=0), base_url=LOCAL) as client:
        assert client.get("/health").status_code == 200
        out: list[str] = []
        t = threading.Thread(target=lambda: out.append(client.post("/v1/completions", json={
            "prompt": "a", "max_tokens": 5, "stream": True}).text))
        t.start()
        until(lambda: len(fake.added) == 1, "the request to reach the engine")
        fake.crash = True
        fake.gate.set()
        t.join(DEADLINE_S)
        payloads = events(out[0])
        assert payloads[-1] == "[DONE]" and "error" in json.loads(payloads[-2])
        until(lambda: client.get("/health").status_code == 503, "health to turn 503")
        r = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1})
        assert r.status_code == 503 and "error" in r.json()


def test_metrics_exposes_every_design_name(client: TestClient):
    client.post("/v1/completions", json={"prompt": "a", "max_tokens": 3})
    text = client.get("/metrics").text
    names = ["time_to_first_token_seconds_count", "time_per_output_token_seconds_count",
             "e2e_request_latency_seconds_count", "num_requests_running", "num_requests_waiting",
             "kv_cache_usage_perc", "prompt_tokens_total", "generation_tokens_total", "num_preemptions_total",
             "step_tokens_count"]
    for name in (f"mixserve:{n}" for n in names):
        assert f"\n{name} " in text, name
    assert "\nmixserve:generation_tokens_total 3.0" in text


def test_two_apps_keep_their_own_registries():
    a, b = make_app(), make_app()
    with TestClient(a, base_url=LOCAL) as ca, TestClient(b, base_url=LOCAL) as cb:
        ca.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
        assert "\nmixserve:generation_tokens_total 2.0" in ca.get("/metrics").text
        assert "\nmixserve:generation_tokens_total 0.0" in cb.get("/metrics").text
