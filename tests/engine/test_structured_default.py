"""Structured output on the default model (SmolLM2): JSON that parses and validates with sampling on,
20 times out of 20; json_object, choice and regex; unconstrained requests unchanged beside them."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from mixserve.config import EngineConfig
from mixserve.engine import LLMEngine
from mixserve.engine.llm import LLM
from mixserve.engine.sampling_params import SamplingParams, StructuredOutput

pytest.importorskip("xgrammar")
pytestmark = pytest.mark.slow

# bounded strings and numbers: a sampled answer always fits in max_tokens, so every one must end
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24},
        "languages": {"type": "array", "items": {"enum": ["en", "fr", "de", "es"]}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "languages"],
}


@pytest.fixture(scope="module")
def llm(default_runner: Any) -> LLM:
    return LLM.from_engine(LLMEngine(default_runner, EngineConfig(threads=1, max_batch_tokens=256)))


def chat(llm: LLM, text: str) -> list[int]:
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def test_json_schema_sampled_validates_20_times_out_of_20(llm: LLM) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    prompt = chat(llm, "Describe a person as JSON: name, age, city and the languages they speak.")
    spec = StructuredOutput("json_schema", json.dumps(PERSON))
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=100, structured_output=spec)
              for s in range(20)]
    outs = llm.generate([prompt] * 20, params, use_tqdm=False)
    for o in outs:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), PERSON)
    assert len({o.text for o in outs}) > 10  # twenty seeds, (nearly) twenty answers


def test_json_object_regex_and_choice(llm: LLM) -> None:
    prompt = chat(llm, "Give me the capital of France as JSON.")
    kinds = [StructuredOutput("json_object"), StructuredOutput("regex", r"[A-Z][a-z]{2,12}, [0-9]{4}"),
             StructuredOutput("choice", choices=("Paris", "Lyon", "Marseille"))]
    outs = llm.generate([prompt] * 3, [SamplingParams(temperature=0.0, max_tokens=40, structured_output=k)
                                       for k in kinds], use_tqdm=False)
    assert all(o.finish_reason == "stop" for o in outs), [o.text for o in outs]
    assert isinstance(json.loads(outs[0].text), dict) and "\n" not in outs[0].text
    assert re.fullmatch(kinds[1].spec, outs[1].text)
    assert outs[2].text in kinds[2].choices


def test_unconstrained_requests_get_the_same_tokens_beside_constrained_ones(llm: LLM) -> None:
    prompts = [chat(llm, "Name three colours."), chat(llm, "What is 2 + 2?")]
    plain = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    alone = llm.generate(prompts, plain, use_tqdm=False)
    spec = StructuredOutput("json_schema", json.dumps(PERSON))
    constrained = SamplingParams(temperature=1.0, seed=3, max_tokens=16, structured_output=spec)
    mixed = llm.generate([prompts[0], prompts[0], prompts[1]], [plain, constrained, plain], use_tqdm=False)
    assert [mixed[0].token_ids, mixed[2].token_ids] == [o.token_ids for o in alone]
    assert mixed[1].text.startswith('{"name": "')
