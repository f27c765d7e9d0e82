"""Structured output through the engine on the tiny random model: a random model under a grammar is the
hard case, as nothing but the mask keeps it on the grammar."""

from __future__ import annotations

import json
import re
import sys
from typing import Any

import pytest
import torch

from mixserve.config import EngineConfig
from mixserve.engine import LLMEngine
from mixserve.engine.llm import LLM
from mixserve.engine.llm_engine import RequestError
from mixserve.engine.sampling_params import SamplingParams, StructuredOutput
from mixserve.engine.structured import Grammars

pytest.importorskip("xgrammar")

CHOICE = StructuredOutput("choice", choices=("yes", "no", "maybe later"))
REGEX = StructuredOutput("regex", r"[0-9]{2}-[a-c]{3}")
BOOL_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
               "required": ["ok", "n"]}
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [17, 18]]


def sampled(seed: int, spec: StructuredOutput, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=kw.pop("max_tokens", 24),
                          structured_output=spec, **kw)


def greedy(spec: StructuredOutput | None = None, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=kw.pop("max_tokens", 12), structured_output=spec, **kw)


def test_choice_sampled_is_always_one_of_the_choices(make_llm):
    llm = make_llm()
    outs = llm.generate([PROMPTS[i % 4] for i in range(12)], [sampled(s, CHOICE) for s in range(12)],
                        use_tqdm=False)
    assert {o.text for o in outs} <= set(CHOICE.choices)
    assert all(o.finish_reason == "stop" and o.token_ids[-1] in llm.engine.eos_token_ids for o in outs)
    assert len({o.text for o in outs}) > 1  # sampling picks among them: the mask is not a fixed path


def test_regex_output_matches(make_llm):
    llm = make_llm()
    outs = llm.generate([PROMPTS[i % 4] for i in range(8)], [sampled(s, REGEX) for s in range(8)],
                        use_tqdm=False)
    for o in outs:
        assert o.finish_reason == "stop" and re.fullmatch(REGEX.spec, o.text), o.text


def test_json_schema_sampled_parses_and_validates(make_llm):
    jsonschema = pytest.importorskip("jsonschema")
    llm = make_llm()
    spec = StructuredOutput("json_schema", json.dumps(BOOL_SCHEMA))
    outs = llm.generate([PROMPTS[i % 4] for i in range(20)], [sampled(s, spec, max_tokens=32)
                                                            for s in range(20)], use_tqdm=False)
    for o in outs:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), BOOL_SCHEMA)
        assert ": " in o.text and "  " not in o.text  # fixed separators, no free whitespace


def test_unconstrained_requests_get_the_same_tokens_beside_constrained_ones(make_llm):
    llm = make_llm(prefill_chunk=4, max_batch_tokens=16)  # chunks and decodes share steps
    plain = [greedy(max_tokens=12, ignore_eos=True)] * 2
    alone = llm.generate([PROMPTS[0], PROMPTS[2]], plain, use_tqdm=False)
    mixed = llm.generate(PROMPTS, [plain[0], greedy(CHOICE), plain[1], greedy(REGEX)], use_tqdm=False)
    assert [mixed[0].token_ids, mixed[2].token_ids] == [alone[0].token_ids, alone[1].token_ids]
    assert mixed[1].text in CHOICE.choices and re.fullmatch(REGEX.spec, mixed[3].text)


def test_max_tokens_cut_reports_length(make_llm):
    llm = make_llm()
    spec = StructuredOutput("json_schema", json.dumps(BOOL_SCHEMA))
    out = llm.generate([PROMPTS[0]], greedy(spec, max_tokens=3), use_tqdm=False)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3
    assert '{"ok": '.startswith(out.text) or out.text.startswith('{"ok"')


def test_an_ended_grammar_stops_whatever_ignore_eos_and_min_tokens_say(make_llm):
    llm = make_llm()
    outs = llm.generate(PROMPTS[:2], [greedy(CHOICE, max_tokens=16, ignore_eos=True),
                                      greedy(CHOICE, max_tokens=16, min_tokens=12)], use_tqdm=False)
    for o in outs:
        assert o.finish_reason == "stop" and o.text in CHOICE.choices
        assert len(o.token_ids) < 12 and o.token_ids[-1] in llm.engine.eos_token_ids


def test_preemption_by_recompute_keeps_the_grammar_state(make_llm):
    long_regex = StructuredOutput("regex", r"[a-e]{24}")
    params = [sampled(s, long_regex, max_tokens=40) for s in range(4)]
    roomy = make_llm().generate(PROMPTS, params, use_tqdm=False)
    llm = make_llm(num_blocks=14)  # 4 requests of 15 to 30 tokens in 4-token blocks: some are preempted
    tight = llm.generate(PROMPTS, params, use_tqdm=False)
    assert llm.engine.stats().num_preemptions_total > 0
    assert [o.token_ids for o in tight] == [o.token_ids for o in roomy]
    assert all(o.finish_reason == "stop" and re.fullmatch(long_regex.spec, o.text) for o in tight)


@pytest.mark.parametrize("spec", [StructuredOutput("regex", "(unclosed"),
                                  StructuredOutput("json_schema", '{"type": "objectx"}'),
                                  StructuredOutput("json_schema", '{"$ref": "#/nowhere"}')])
def test_a_bad_grammar_is_refused_naming_structured_output(make_llm, spec):
    llm = make_llm()
    for call in (lambda: llm.engine.validate([1, 2], greedy(spec)),
                 lambda: llm.engine.add_request("r", [1, 2], greedy(spec))):
        with pytest.raises(RequestError) as info:
            call()
        assert info.value.param == "structured_output"
        assert str(info.value).startswith("structured_output: cannot compile") and "\n" not in str(info.value)
    assert not llm.engine.has_unfinished()


def test_without_xgrammar_only_constrained_requests_are_refused(tiny_runner, monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # `import xgrammar` now raises ImportError
    engine = LLMEngine(tiny_runner, EngineConfig(threads=1))
    with pytest.raises(RequestError, match="^structured_output: .*xgrammar") as info:
        engine.validate([1, 2], greedy(CHOICE))
    assert info.value.param == "structured_output"
    out = LLM.from_engine(engine).generate([PROMPTS[0]], greedy(max_tokens=4), use_tqdm=False)[0]
    assert len(out.token_ids) == 4


def test_the_mask_touches_only_constrained_rows(tiny_runner):
    grammars = Grammars(tiny_runner.tokenizer, tiny_runner.config.vocab_size, [2])
    assert grammars.masks([None, None]) is None
    g = grammars.matcher(CHOICE, "r")
    logits = torch.randn(3, tiny_runner.config.vocab_size)
    before = logits.clone()
    masks = grammars.masks([None, g, None])
    assert masks is not None
    masks.apply(logits)
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    allowed = logits[1].isfinite().nonzero().flatten().tolist()
    assert 0 < len(allowed) < logits.shape[1] // 2
    assert torch.equal(logits[1][allowed], before[1][allowed])
    texts = [tiny_runner.tokenizer.decode([t]) for t in allowed]
    assert all(any(c.startswith(t) for c in CHOICE.choices) for t in texts)  # only a choice's beginning
    # every token that begins a choice is allowed (single-token prefixes of the choices)
    vocab = tiny_runner.tokenizer.hf.get_vocab()
    first = [i for i in vocab.values() if i < logits.shape[1] and tiny_runner.tokenizer.decode([i])
             and any(c.startswith(tiny_runner.tokenizer.decode([i])) for c in CHOICE.choices)]
    assert sorted(first) == sorted(allowed)



def test_choices_are_escaped_and_grammars_cached(tiny_runner):
    grammars = Grammars(tiny_runner.tokenizer, tiny_runner.config.vocab_size, [2])
    tricky = StructuredOutput("choice", choices=('say "hi"', "back\\slash", "two\nlines", "é ☃", "(a|b)*"))
    compiled = grammars.compile(tricky)
    assert grammars.compile(StructuredOutput("choice", choices=tricky.choices)) is compiled
    for choice in tricky.choices:
        matcher = grammars.matcher(tricky, "r").matcher
        assert matcher.accept_string(choice) and matcher.is_completed(), choice
    assert not grammars.matcher(tricky, "r").matcher.accept_string("ab")  # a regex-looking choice is text
