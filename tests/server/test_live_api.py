"""The OpenAI parameters clients send, through the official `openai` client against a live server:
logit_bias, penalties, min_tokens, continuous usage stats, served model names."""

from __future__ import annotations

import openai
import pytest

from mixserve.model.tokenizer import load_tokenizer
from tests.server.conftest import start_server

pytestmark = pytest.mark.timeout(300)


def _greedy(client: openai.OpenAI, model: str, **extra) -> openai.types.Completion:
    body = extra.pop("extra_body", {})
    return client.completions.create(model=model, prompt=[7, 8, 9], max_tokens=6, temperature=0,
                                     extra_body={"ignore_eos": True, **body}, logprobs=1, **extra)


def test_logit_bias_moves_the_greedy_token(client: openai.OpenAI, model: str, tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    first = _greedy(client, model).choices[0].logprobs.tokens[0]
    # every id that reads as the greedy first token, banned; then pushed up instead
    ids = [i for i in range(tok.vocab_size) if tok.decode([i], skip_special_tokens=False) == first]
    banned = _greedy(client, model, logit_bias={str(i): -100 for i in ids})
    assert ids and banned.choices[0].logprobs.tokens[0] != first
    other = banned.choices[0].logprobs.tokens[0]
    other_ids = [i for i in range(tok.vocab_size) if tok.decode([i], skip_special_tokens=False) == other]
    pushed = _greedy(client, model, logit_bias={str(i): 100 for i in other_ids})
    assert pushed.choices[0].logprobs.tokens[:2] == [other, other]  # +100 wins every position


def test_penalties_change_a_repetitive_answer(client: openai.OpenAI, model: str):
    body = {"model": model, "prompt": [3, 4], "max_tokens": 24, "temperature": 0,
            "extra_body": {"ignore_eos": True}}
    plain = client.completions.create(**body)
    penalized = client.completions.create(**body, presence_penalty=2.0, frequency_penalty=2.0)
    assert penalized.choices[0].text != plain.choices[0].text


def test_min_tokens_is_accepted_and_honoured(client: openai.OpenAI, model: str):
    out = client.completions.create(model=model, prompt="hi", max_tokens=8, temperature=0,
                                    extra_body={"min_tokens": 8})
    assert out.usage.completion_tokens == 8


def test_continuous_usage_stats_put_the_usage_on_every_chunk(client: openai.OpenAI, model: str):
    stream = client.completions.create(model=model, prompt="count", max_tokens=5, stream=True,
                                       extra_body={"ignore_eos": True},
                                       stream_options={"include_usage": True, "continuous_usage_stats": True})
    chunks = list(stream)
    with_choices = [c for c in chunks if c.choices]
    assert [c.usage.completion_tokens for c in with_choices] == [1, 2, 3, 4, 5]
    assert chunks[-1].usage.completion_tokens == 5 and not chunks[-1].choices


def test_served_model_names_are_aliases(tiny_model_dir, tmp_path):
    server = start_server(tiny_model_dir, tmp_path / "stderr.log", "--served-model-name", "gpt-mini",
                          "tiny")
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["gpt-mini", "tiny"]
        for name in ("gpt-mini", "tiny"):
            assert client.completions.create(model=name, prompt="hi", max_tokens=2).model == name
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model=tiny_model_dir.name, prompt="hi", max_tokens=2)
    finally:
        server.stop()


def test_n_greedy_choices_are_identical_and_the_prompt_counts_once(client: openai.OpenAI, model: str):
    one = client.completions.create(model=model, prompt="same", max_tokens=6, temperature=0)
    three = client.completions.create(model=model, prompt="same", max_tokens=6, temperature=0, n=3)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert [c.text for c in three.choices] == [one.choices[0].text] * 3
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens


def test_n_sampled_choices_with_a_seed_differ_and_repeat(client: openai.OpenAI, model: str):
    def run() -> list[str]:
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=12, temperature=1.0, seed=11, n=3)
        return [c.message.content for c in sorted(r.choices, key=lambda c: c.index)]

    first = run()
    assert first == run() and len(set(first)) == 3


def test_n_streams_every_choice_with_its_index(client: openai.OpenAI, model: str):
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "go"}],
                                            max_tokens=5, temperature=0, n=2, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    texts, finishes, usage = {0: "", 1: ""}, {}, None
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
        usage = chunk.usage or usage
    assert texts[0] == texts[1] and finishes == {0: "length", 1: "length"}
    assert usage.completion_tokens == 10
