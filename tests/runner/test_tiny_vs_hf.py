"""The runner on tiny random checkpoints equals HF transformers' forward, in mixed chunked batches."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mixserve import ModelRunner
from mixserve.core.batch import ForwardBatch, ForwardSeq
from tests.runner.drive import Req, drive, interleaved_tables, max_rel_error
from tests.tiny_model import make_tiny_llama

TOL = 2e-3  # of the largest |logit| per row, as against the default model; tiny fp32 models do ~1e-6


def hf_logits(path: Path, token_lists: list[list[int]]) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    if path.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return [model.eval()(torch.tensor([t])).logits[0] for t in token_lists]


def check_mixed_against_hf(path: Path, *, chunk: int = 5, block_size: int = 4) -> None:
    runner = ModelRunner.from_pretrained(str(path), num_blocks=64, block_size=block_size)
    g = torch.Generator().manual_seed(1)
    lens = (23, 9, 31)
    prompts = [torch.randint(0, runner.config.vocab_size, (n,), generator=g).tolist() for n in lens]
    tables = interleaved_tables(3, 16, 64)
    # b arrives while a is mid-prefill; c arrives while a and b decode: decodes and chunks share steps
    arrivals = (0, 2, 5)
    reqs = [Req(rid, p, t, a) for rid, p, t, a in zip("abc", prompts, tables, arrivals, strict=True)]
    drive(runner, reqs, chunk=chunk, new_tokens=6)
    refs = hf_logits(path, [r.tokens for r in reqs])
    for r, ref in zip(reqs, refs, strict=True):
        assert len(r.rows) == 6
        assert max_rel_error(r.rows, ref) < TOL, r.rid


def test_safetensors_llama_matches_hf(tiny_model_dir: Path) -> None:
    check_mixed_against_hf(tiny_model_dir)


def test_gguf_llama_with_permuted_qk_matches_hf(tiny_gguf_path: Path) -> None:
    check_mixed_against_hf(tiny_gguf_path, chunk=3, block_size=16)


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_qwen2_bias_untied_matches_hf(tmp_path: Path, fmt: str) -> None:
    path = make_tiny_llama(tmp_path, fmt=fmt, bias=True, tie_word_embeddings=False, seed=3)
    check_mixed_against_hf(path, chunk=4)


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 16},
        {"rope_type": "linear", "factor": 4.0},
    ],
    ids=["llama3", "linear"],
)
def test_rope_scaling_matches_hf(tmp_path: Path, scaling: dict) -> None:
    path = make_tiny_llama(tmp_path, rope_scaling=scaling, seed=5)
    check_mixed_against_hf(path, chunk=7)


def test_rope_scaling_changes_logits(tmp_path: Path) -> None:
    # Guards the test above: a scaling our runner ignored would still equal HF only if HF ignored it too.
    plain = ModelRunner.from_pretrained(str(make_tiny_llama(tmp_path / "a", seed=5)), num_blocks=8)
    scaled_path = make_tiny_llama(tmp_path / "b", seed=5, rope_scaling={"rope_type": "linear", "factor": 4.0})
    scaled = ModelRunner.from_pretrained(str(scaled_path), num_blocks=8)
    batch = ForwardBatch([ForwardSeq("x", list(range(10, 40)), 0, [0, 1])])
    assert not torch.allclose(plain.forward(batch), scaled.forward(batch), atol=1e-3)
