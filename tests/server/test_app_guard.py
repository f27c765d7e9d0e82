"""The checks before any work: Host, body size, key before body, unsupported and unknown fields, stops."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from mixserve.server.guard import is_loopback_host
from tests.server.fake_engine import FakeEngine, make_app

LOCAL = "http://127.0.0.1"
BODY = {"prompt": "a", "max_tokens": 1}


@pytest.fixture
def client() -> Iterator[TestClient]:
    with TestClient(make_app(max_body_bytes=4000), base_url=LOCAL) as c:
        yield c


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("127.1.2.3", True), ("::1", True), ("[::1]", True), ("localhost", True),
    ("0.0.0.0", False), ("", False), ("example.com", False), ("10.0.0.1", False)])
def test_loopback_hosts(host, loopback):
    assert is_loopback_host(host) == loopback


def test_a_loopback_server_refuses_other_host_names(client: TestClient):
    for host in ("localhost:8000", "127.0.0.1", "[::1]:80"):
        assert client.get("/health", headers={"host": host}).status_code == 200, host
    r = client.get("/health", headers={"host": "attacker.example:8000"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed"


def test_a_server_on_every_interface_answers_any_host():
    with TestClient(make_app(host="0.0.0.0"), base_url=LOCAL) as c:
        assert c.get("/health", headers={"host": "my-box.lan:8000"}).status_code == 200


def test_a_content_length_over_the_limit_is_a_413(client: TestClient):
    r = client.post("/v1/completions", json={"prompt": "a" * 5000})
    assert r.status_code == 413 and "4000 bytes" in r.json()["error"]["message"]


def test_a_chunked_body_over_the_limit_is_cut_with_a_413(client: TestClient):
    def chunks() -> Iterator[bytes]:  # a generator body: sent chunked, without Content-Length
        yield b'{"prompt": "'
        for _ in range(100):
            yield b"a" * 100
        yield b'"}'

    r = client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"


def test_the_key_is_checked_before_the_body_is_parsed():
    with TestClient(make_app(api_key="k"), base_url=LOCAL) as c:
        r = c.post("/v1/completions", content=b'{"prompt": ', headers={"content-type": "application/json"})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        r = c.post("/v1/completions", content=b'{"prompt": ',
                   headers={"content-type": "application/json", "authorization": "Bearer k"})
        assert r.status_code == 400


def test_health_answers_head(client: TestClient):
    r = client.head("/health")
    assert r.status_code == 200 and r.content == b""


def test_metrics_is_documented_as_text(client: TestClient):
    spec = client.get("/openapi.json").json()
    assert list(spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    assert client.get("/metrics").headers["content-type"].startswith("text/plain")


@pytest.mark.parametrize(("field", "value"), [
    ("n", 129), ("best_of", 2), ("suffix", "!"), ("response_format", {"type": "xml"}),
    ("response_format", {"type": "json_schema"}), ("logit_bias", {"the": 1.0}), ("presence_penalty", 2.5)])
def test_known_but_unimplemented_or_bad_parameters_are_a_400_naming_them(client: TestClient, field, value):
    r = client.post("/v1/completions", json={**BODY, field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


@pytest.mark.parametrize(("field", "value"), [
    ("best_of", 1), ("logit_bias", {}), ("presence_penalty", 0), ("frequency_penalty", 0.0),
    ("repetition_penalty", 1), ("suffix", ""), ("response_format", {"type": "text"})])
def test_their_off_values_are_accepted(client: TestClient, field, value):
    assert client.post("/v1/completions", json={**BODY, field: value}).status_code == 200


def test_tools_on_chat_are_a_400(client: TestClient):
    chat = {"messages": [{"role": "user", "content": "a"}], "max_tokens": 1}
    r = client.post("/v1/chat/completions", json={**chat, "tools": [{"type": "function"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    assert client.post("/v1/chat/completions", json={**chat, "tool_choice": "none"}).status_code == 200


def test_unknown_fields_are_ignored_with_a_log_line(client: TestClient, caplog):
    with caplog.at_level(logging.WARNING, logger="mixserve.server.preprocess"):
        r = client.post("/v1/completions", json={**BODY, "frobnicate": 1, "stream": True,
                                                 "stream_options": {"include_obfuscation": True}})
    assert r.status_code == 200
    assert "frobnicate" in caplog.text and "stream_options.include_obfuscation" in caplog.text


@pytest.mark.parametrize("stop", [["a", "b", "c", "d", "e"], "x" * 1001, ["x" * 1001]])
def test_stop_lists_are_bounded(client: TestClient, stop):
    r = client.post("/v1/completions", json={**BODY, "stop": stop})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop", r.text


@pytest.mark.parametrize("field", ["max_tokens", "n", "seed", "top_k"])
def test_a_boolean_is_not_an_integer(client: TestClient, field):
    r = client.post("/v1/completions", json={**BODY, field: True})
    assert r.status_code == 400 and r.json()["error"]["param"] == field


def test_a_prompt_far_over_the_context_is_refused_before_tokenizing():
    fake = FakeEngine()
    fake.tokenizer.encode_releasing_gil = None  # tokenizing it would raise: the bound must answer first
    with TestClient(make_app(fake), base_url=LOCAL) as c:
        r = c.post("/v1/completions", json={"prompt": "a" * 5000, "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        assert "at least 5000 tokens" in r.json()["error"]["message"]
        chat = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a" * 5000}]})
        assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"
