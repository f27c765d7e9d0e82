"""The official `openai` client against the real server on a tiny random model: it works unchanged."""

from __future__ import annotations

import asyncio

import openai
import pytest

from mixserve.model.tokenizer import load_tokenizer
from tests.server.conftest import LiveServer

pytestmark = pytest.mark.timeout(300)


def test_models_lists_the_served_model(client: openai.OpenAI, tiny_model_dir):
    assert [m.id for m in client.models.list().data] == [tiny_model_dir.name]


def test_completion_answers_with_usage(client: openai.OpenAI, model: str):
    out = client.completions.create(model=model, prompt="The capital of France is", max_tokens=5,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 5 and out.usage.prompt_tokens > 0
    assert out.usage.total_tokens == out.usage.prompt_tokens + 5


def test_token_id_prompt_answers_as_its_text(client: openai.OpenAI, model: str, tiny_model_dir):
    ids = load_tokenizer(tiny_model_dir).encode("hello world")
    kwargs = {"model": model, "max_tokens": 4, "temperature": 0, "extra_body": {"ignore_eos": True}}
    by_text = client.completions.create(prompt="hello world", **kwargs)
    by_ids = client.completions.create(prompt=ids, **kwargs)
    assert by_ids.usage.prompt_tokens == len(ids) == by_text.usage.prompt_tokens
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_chat_completion_answers_an_assistant_message(client: openai.OpenAI, model: str):
    out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi there"}],
                                         max_completion_tokens=6, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 6


def test_streamed_chat_equals_the_whole_answer_and_ends_with_usage(client: openai.OpenAI, model: str):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    whole = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0,
                                           extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_streamed_completion_without_usage(client: openai.OpenAI, model: str):
    chunks = list(client.completions.create(model=model, prompt="hello", max_tokens=4, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert all(c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_seeded_sampling_repeats(client: openai.OpenAI, model: str):
    def sample() -> str:
        return client.completions.create(model=model, prompt="hello", max_tokens=8, temperature=1.0, seed=7,
                                         extra_body={"ignore_eos": True}).choices[0].text

    assert sample() == sample()


def test_logprobs_through_the_client(client: openai.OpenAI, model: str):
    out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "a"}],
                                         max_tokens=3, logprobs=True, top_logprobs=2,
                                         extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)


def test_async_client_runs_requests_concurrently(live_server: LiveServer, model: str):
    async def main() -> list:
        client = openai.AsyncOpenAI(base_url=f"{live_server.url}/v1", api_key="unused", max_retries=0)
        async with client:
            return await asyncio.gather(*(client.completions.create(
                model=model, prompt=f"request {i}", max_tokens=4 + i, extra_body={"ignore_eos": True})
                for i in range(6)))

    outs = asyncio.run(main())
    assert [o.usage.completion_tokens for o in outs] == [4 + i for i in range(6)]
