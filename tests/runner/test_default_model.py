"""Chunk invariance (the seed's test) on the default model, and equality with HF's forward on its GGUF."""

from __future__ import annotations

import pytest
import torch

from mixserve.core.batch import ForwardBatch, ForwardSeq
from tests.runner.drive import Req, drive, interleaved_tables, max_rel_error

TOL = 2e-3  # of the largest |logit| of a row
NEW_TOKENS = 8


def chat_prompt(runner, text: str) -> list[int]:
    return runner.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def test_chunked_prefill_matches_whole_within_tolerance(default_runner) -> None:
    runner = default_runner
    prompt = chat_prompt(runner, "What is the capital of France? Answer in one short sentence.")
    assert len(prompt) > 16  # so chunk size 16 really splits it
    table = interleaved_tables(1, 24, 96)[0]
    whole = Req("whole", prompt, table)
    drive(runner, [whole], chunk=len(prompt), new_tokens=NEW_TOKENS)
    for chunk in (1, 3, 7, 16):
        # a different block table each time: the result may not depend on where K/V live
        req = Req(f"chunk{chunk}", prompt, interleaved_tables(2, 24, 96)[chunk % 2])
        drive(runner, [req], chunk=chunk, new_tokens=NEW_TOKENS)
        assert req.tokens == whole.tokens, f"greedy continuation changed at chunk size {chunk}"
        for (pos, row), (wpos, wrow) in zip(req.rows, whole.rows, strict=True):
            assert pos == wpos
            assert float((row - wrow).abs().max() / wrow.abs().max()) < TOL, (chunk, pos)


def test_default_model_answers_paris(default_runner) -> None:
    runner = default_runner
    req = Req("paris", chat_prompt(runner, "What is the capital of France?"), list(range(32)))
    drive(runner, [req], chunk=256, new_tokens=12)
    assert "Paris" in runner.tokenizer.decode(req.tokens[len(req.prompt):])


def test_default_runner_attributes(default_runner) -> None:
    r = default_runner
    assert r.model_name == "SmolLM2-135M-Instruct"
    assert r.max_model_len == 8192
    assert r.dtype == torch.float32 and r.device.type == "cpu"
    assert r.config.num_layers == 30 and r.config.num_kv_heads == 3 and r.config.head_dim == 64
    assert 2 in r.tokenizer.eos_token_ids  # <|im_end|>
    # PERF.md: SmolLM2 fp32 KV = 2 x 30 x 3 x 64 x 4 bytes per token
    assert r.kv_bytes_per_token == 46080


@pytest.mark.slow
def test_mixed_batches_match_hf_forward(default_runner, hf_default_model) -> None:
    runner = default_runner
    texts = [
        "Write a haiku about the sea.",
        "What is the capital of France?",
        "List three prime numbers and explain why each one is prime.",
    ]
    prompts = [chat_prompt(runner, t) for t in texts]
    tables = interleaved_tables(3, 40, 512)
    # b arrives while a is still prefilling; c arrives once a and b decode: decodes and chunks share steps
    reqs = [Req(rid, p, t, a) for rid, p, t, a in zip("abc", prompts, tables, (0, 1, 4), strict=True)]
    drive(runner, reqs, chunk=7, new_tokens=10)
    with torch.no_grad():
        for r in reqs:
            ref = hf_default_model(torch.tensor([r.tokens])).logits[0]
            assert len(r.rows) == 10
            assert max_rel_error(r.rows, ref) < TOL, r.rid
            # greedy tokens are HF's too
            assert r.tokens[len(r.prompt):] == ref[len(r.prompt) - 1 : -1].argmax(-1).tolist(), r.rid


def test_decode_reads_kv_written_by_earlier_steps(default_runner) -> None:
    # A decode alone at position n-1 must see the prompt's K/V from a previous forward: changing the
    # cached prefix (another prompt in the same blocks) must change the logits.
    runner = default_runner
    table = list(range(100, 110))
    a = chat_prompt(runner, "Tell me about cats.")
    b = chat_prompt(runner, "Tell me about rockets and the moon landing.")[: len(a)]
    outs = []
    for prefix in (a, b):
        runner.forward(ForwardBatch([ForwardSeq("p", prefix[:-1], 0, table)]))
        outs.append(runner.forward(ForwardBatch([ForwardSeq("p", prefix[-1:], len(prefix) - 1, table)])))
    assert not torch.allclose(outs[0], outs[1], atol=1e-2)
