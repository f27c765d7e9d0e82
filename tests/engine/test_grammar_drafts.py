"""Speculative decoding under a grammar: drafts cut where the grammar refuses them, every verifying row
masked as the plain row at that place would be, and the output the one without speculation."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import torch

from mixserve import SamplingParams
from mixserve.core.draft_gate import DraftGate
from mixserve.engine.sampling_params import StructuredOutput
from mixserve.engine.structured import Grammars

xgr = pytest.importorskip("xgrammar")

REPEATS = StructuredOutput("regex", r"(ab){10}")
SCHEMA = StructuredOutput("json_schema", json.dumps({
    "type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["ab", "cd"]},
                                              "minItems": 6, "maxItems": 6}},
    "required": ["tags"]}))


@pytest.fixture(autouse=True)
def drafts_always_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """What drafts do, not when the timed gate lets them run."""
    monkeypatch.setattr(DraftGate, "allows", lambda self, num_decodes, chunks=False: True)


def counts(llm: Any) -> tuple[int, int]:
    s = llm.engine.stats().scheduler
    return s.spec_num_draft_tokens, s.spec_num_accepted_tokens


def tokens_of(tiny_runner: Any, text: str) -> list[int]:
    return tiny_runner.tokenizer.hf.encode(text, add_special_tokens=False)


def test_walk_cuts_a_draft_where_the_grammar_refuses_it_and_leaves_the_matcher_in_place(tiny_runner):
    grammars = Grammars(tiny_runner.tokenizer, tiny_runner.config.vocab_size, [2])
    g = grammars.matcher(SCHEMA, "r")
    good = tokens_of(tiny_runner, '{"tags": ["ab", "cd", ')
    draft = good + tokens_of(tiny_runner, "}}}")
    assert g.allowed(draft) == len(good)
    assert g.allowed(draft[:3]) == 3
    before = xgr.allocate_token_bitmask(1, grammars.vocab_size)
    g.matcher.fill_next_token_bitmask(before, 0)
    masks = grammars.draft_masks([(None, (5, 6)), (g, tuple(draft))])
    assert masks is not None
    after = xgr.allocate_token_bitmask(1, grammars.vocab_size)
    g.matcher.fill_next_token_bitmask(after, 0)
    assert torch.equal(before, after)  # rolled back to where it was
    # row j of the grammar's group: the mask of a fresh matcher after draft[:j]; the first group unmasked
    assert all(i >= 3 for i in masks.indices) and 3 + len(good) in masks.indices
    assert max(masks.indices) == 3 + len(good)  # rows past the refused draft are never read: not masked
    for j in range(len(good) + 1):
        fresh = grammars.matcher(SCHEMA, "f").matcher
        assert all(fresh.accept_token(t) for t in draft[:j])
        want = xgr.allocate_token_bitmask(1, grammars.vocab_size)
        fresh.fill_next_token_bitmask(want, 0)
        assert torch.equal(masks.bitmask[3 + j], want[0]), j


def test_a_drafts_stop_token_ends_the_walk(tiny_runner):
    grammars = Grammars(tiny_runner.tokenizer, tiny_runner.config.vocab_size, [2])
    g = grammars.matcher(StructuredOutput("regex", "ab"), "r")
    body = tokens_of(tiny_runner, "ab")
    assert g.allowed([*body, 2, 7, 8]) == len(body) + 1  # the text, then the stop token that ends it
    assert g.allowed([*body, 9]) == len(body)


@pytest.mark.parametrize("chunk", [0, 16])
def test_greedy_under_a_grammar_drafts_and_gives_the_output_without_speculation(make_llm, chunk: int):
    params = SamplingParams(max_tokens=40, temperature=0.0, structured_output=REPEATS)
    prompt = [17, 18, 19, 20, 21]
    outs, llms = {}, {}
    for spec in ("", "ngram"):
        llms[spec] = make_llm(speculative=spec, prefill_chunk=chunk, max_batch_tokens=64)
        outs[spec] = llms[spec].generate([prompt], params, use_tqdm=False)[0]
    assert outs["ngram"].token_ids == outs[""].token_ids
    assert outs["ngram"].text == "ab" * 10 and outs["ngram"].finish_reason == "stop"
    drafted, accepted = counts(llms["ngram"])
    assert accepted > 0 and drafted >= accepted


def test_a_json_schema_beside_speculating_requests_keeps_every_output(make_llm):
    grammar = SamplingParams(max_tokens=60, temperature=0.0, structured_output=SCHEMA)
    free = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompts = [[30, 31, 32, 33] * 3, [40, 41, 42] * 4, [50, 51] * 5, [60, 61, 62, 63, 64]]
    params = [grammar, free, grammar, free]
    outs, llm = {}, None
    for spec in ("", "ngram"):
        llm = make_llm(speculative=spec, prefill_chunk=8, max_batch_tokens=48)
        outs[spec] = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs["ngram"]] == [o.token_ids for o in outs[""]]
    for o in (outs["ngram"][0], outs["ngram"][2]):
        value = json.loads(o.text)
        assert len(value["tags"]) == 6 and set(value["tags"]) <= {"ab", "cd"}
    assert counts(llm)[1] > 0


def test_sampled_under_a_grammar_with_drafts_stays_in_it(make_llm):
    params = SamplingParams(max_tokens=60, temperature=0.7, seed=5, structured_output=REPEATS)
    llm = make_llm(speculative="ngram")
    outs = llm.generate([[5, 6, 7, 8]] * 6, params, use_tqdm=False)
    assert all(re.fullmatch(r"(ab){10}", o.text) and o.finish_reason == "stop" for o in outs)
    drafted, accepted = counts(llm)
    assert accepted > 0 and drafted >= accepted
