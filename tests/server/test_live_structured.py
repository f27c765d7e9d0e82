"""Structured output through the official `openai` client against a live server on the default model
(SmolLM2-135M-Instruct): a JSON schema followed with sampling on, 20 times out of 20."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest

from mixserve.model.loader import default_model_path
from tests.server.conftest import start_server

pytest.importorskip("xgrammar")  # a dependency of the project: present wherever `make install` ran
pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "country": {"type": "string", "maxLength": 30},
        "population_millions": {"type": "number"},
        "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 3},
    },
    "required": ["city", "country", "population_millions", "landmarks"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    log = tmp_path_factory.mktemp("structured") / "stderr.log"
    server = start_server(default_model_path(), log, "--num-blocks", "256", "--served-model-name", "default")
    try:
        yield f"{server.url}/v1"
    finally:
        server.stop()


@pytest.fixture
def client(url):
    # a client per test: each test runs its own event loop (asyncio.run), and a client's connections
    # belong to the loop that opened them
    return openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0)


def _run(coro):
    return asyncio.run(coro)


def test_a_json_schema_is_followed_20_times_of_20_with_sampling(client):
    async def one(seed: int) -> tuple[str, str | None]:
        r = await client.chat.completions.create(
            model="default", temperature=1.0, seed=seed, max_tokens=200,
            messages=[{"role": "user", "content": "Describe Paris as JSON."}],
            response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}})
        return r.choices[0].message.content, r.choices[0].finish_reason

    async def main():
        return await asyncio.gather(*(one(seed) for seed in range(20)))

    results = _run(main())
    for text, finish in results:
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_choice_and_regex(client):
    async def main():
        obj = await client.chat.completions.create(
            model="default", max_tokens=400, temperature=0, frequency_penalty=1.0,  # greedy alone loops
            messages=[{"role": "user", "content": "Give me a small JSON object about cats."}],
            response_format={"type": "json_object"})
        choice = await client.completions.create(model="default", prompt="The sky is", max_tokens=10,
                                                 extra_body={"guided_choice": ["blue", "green", "red"]})
        regex = await client.completions.create(model="default", prompt="A phone number:", max_tokens=20,
                                                extra_body={"guided_regex": r"\d{3}-\d{4}"})
        return obj, choice, regex

    obj, choice, regex = _run(main())
    assert obj.choices[0].finish_reason == "stop", obj.choices[0].message.content
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    assert choice.choices[0].text in ("blue", "green", "red")
    assert len(regex.choices[0].text) == 8 and regex.choices[0].text[3] == "-"


def test_output_cut_by_max_tokens_reports_length(client):
    r = _run(client.chat.completions.create(
        model="default", max_tokens=5, messages=[{"role": "user", "content": "JSON please"}],
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}))
    assert r.choices[0].finish_reason == "length"
