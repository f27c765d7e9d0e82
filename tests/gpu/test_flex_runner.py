"""The gpu backend (asked for by its old name, flex) through the ModelRunner on the tiny model (CPU: dense
decode, eager FlexAttention) agrees with the reference."""

from __future__ import annotations

import torch

from mixserve.core import ForwardBatch, ForwardSeq
from mixserve.runner.model_runner import ModelRunner

BLOCK_SIZE = 4


def greedy_steps(runner: ModelRunner, prompts: list[list[int]], chunk: int, new_tokens: int) -> list:
    """Mixed steps: each request prefills `chunk` tokens a step, then decodes greedily beside the others."""
    tables = [list(range(i, 64, len(prompts))) for i in range(len(prompts))]  # interleaved blocks
    tokens = [list(p) for p in prompts]
    done = [0] * len(prompts)
    all_logits = []
    while any(len(t) - len(p) < new_tokens for t, p in zip(tokens, prompts, strict=True)):
        seqs, owners = [], []
        for i, t in enumerate(tokens):
            if len(t) - len(prompts[i]) >= new_tokens:
                continue
            take = min(chunk, len(prompts[i]) - done[i]) if done[i] < len(prompts[i]) else 1
            seqs.append(ForwardSeq(f"r{i}", t[done[i]:done[i] + take], done[i], tables[i]))
            owners.append(i)
            done[i] += take
        logits = runner.forward(ForwardBatch(seqs))
        all_logits.append(logits)
        for row, i in enumerate(owners):
            if done[i] == len(tokens[i]):  # the row of a request's newest token: sample it
                tokens[i].append(int(logits[row].argmax()))
    return all_logits


def test_flex_runner_matches_torch_runner_in_mixed_steps(tiny_model_dir):
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21], [30, 31, 32, 33, 34, 35]]
    outs = {}
    for name in ("torch", "flex"):
        runner = ModelRunner.from_pretrained(str(tiny_model_dir), num_blocks=64, block_size=BLOCK_SIZE,
                                             attention_backend=name)
        assert runner.attention.name == {"torch": "torch", "flex": "gpu"}[name]  # flex: the gpu's alias
        outs[name] = greedy_steps(runner, prompts, chunk=4, new_tokens=5)
    assert len(outs["torch"]) == len(outs["flex"])
    for ref, got in zip(outs["torch"], outs["flex"], strict=True):
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
