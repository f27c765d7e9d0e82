"""Penalties, logit_bias and min_tokens: the batched processors against their definitions, row by row."""

from __future__ import annotations

import math

import pytest
import torch

from mixserve.engine.sampling_params import SamplingParams
from mixserve.runner.logits_processors import ProcessorRow, apply_processors
from mixserve.runner.sampler import Sampler, SamplingRow

VOCAB = 12


def reference(logits: list[float], row: ProcessorRow) -> list[float]:
    """The definitions, one token at a time in plain Python (HF's repetition penalty, OpenAI's
    presence/frequency over the output, bias added, hidden tokens -inf)."""
    out = list(logits)
    for t in set(row.seen_ids):
        p = row.repetition_penalty
        out[t] = out[t] / p if out[t] > 0 else out[t] * p
    for t in set(row.output_ids):
        out[t] -= row.frequency_penalty * list(row.output_ids).count(t) + row.presence_penalty
    for t, b in row.logit_bias:
        out[t] += b
    for t in row.hidden_ids:
        out[t] = -math.inf
    return out


ROWS = [
    ProcessorRow(),
    ProcessorRow(presence_penalty=0.5, output_ids=[1, 1, 3]),
    ProcessorRow(frequency_penalty=-1.5, output_ids=[2, 2, 2, 7]),
    ProcessorRow(presence_penalty=1.0, frequency_penalty=0.25, output_ids=[0, 5, 5]),
    ProcessorRow(repetition_penalty=1.3, seen_ids=[0, 1, 2, 2, 9]),
    ProcessorRow(repetition_penalty=0.7, seen_ids=[4, 11]),
    ProcessorRow(logit_bias=((3, -100.0), (6, 4.5))),
    ProcessorRow(hidden_ids=(10, 11)),
    ProcessorRow(1.0, 1.0, 1.2, ((8, 2.0),), (0,), [8, 8], [3, 8, 8]),
]


def test_every_processor_matches_its_definition_in_one_batch():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(len(ROWS), VOCAB, generator=gen) * 3
    before = logits.clone()
    out = apply_processors(logits, ROWS)
    assert torch.equal(logits, before)  # the raw logits stay (logprobs are read from them)
    for i, row in enumerate(ROWS):
        assert out[i].tolist() == pytest.approx(reference(before[i].tolist(), row), rel=1e-6), i


def test_greedy_sampling_follows_the_processed_logits():
    logits = torch.tensor([[5.0, 4.0, 0.0], [5.0, 4.0, 0.0], [5.0, 4.0, 0.0]])
    rows = [SamplingRow(temperature=0.0),
            SamplingRow(temperature=0.0, processing=ProcessorRow(logit_bias=((0, -100.0),))),
            SamplingRow(temperature=0.0, processing=ProcessorRow(hidden_ids=(0, 1)))]
    assert Sampler()(logits, rows).token_ids == [0, 1, 2]


def test_logprobs_stay_those_of_the_model():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    row = SamplingRow(temperature=0.0, num_logprobs=1, processing=ProcessorRow(logit_bias=((2, 50.0),)))
    result = Sampler()(logits, [row])
    assert result.token_ids == [2]
    assert result.logprobs[0] == pytest.approx(torch.log_softmax(logits[0], -1)[2].item())


def test_sampled_rows_never_draw_a_hidden_or_banned_token():
    logits = torch.zeros(64, VOCAB)
    proc = ProcessorRow(logit_bias=((3, -100.0),), hidden_ids=(0, 1, 2))
    rows = [SamplingRow(temperature=1.0, seed=s, processing=proc) for s in range(64)]
    tokens = Sampler()(logits, rows).token_ids
    assert not {0, 1, 2, 3} & set(tokens) and len(set(tokens)) > 3


def test_a_strong_frequency_penalty_moves_sampling_off_repeated_tokens():
    logits = torch.zeros(200, VOCAB)
    proc = ProcessorRow(frequency_penalty=2.0, output_ids=[5] * 10)  # token 5's logit falls by 20
    rows = [SamplingRow(temperature=1.0, seed=s, processing=proc) for s in range(200)]
    assert 5 not in Sampler()(logits, rows).token_ids


@pytest.mark.parametrize(("field", "value"), [
    ("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0), ("logit_bias", {1: 101}),
    ("logit_bias", {-1: 1}), ("min_tokens", 17)])
def test_sampling_params_refuse_out_of_range_values(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(max_tokens=16, **{field: value})
