"""Every dense family against transformers' own forward on the same tiny random weights: mixed chunked
paged steps at several chunk sizes on the CPU backends, and greedy generation through LLM."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mixserve import ModelRunner, SamplingParams
from mixserve.config import EngineConfig
from mixserve.engine import LLMEngine
from mixserve.engine.llm import LLM
from mixserve.model.errors import ModelLoadError
from tests.family_models import hf_models_of, make_tiny_family
from tests.runner.drive import Req, drive, interleaved_tables, max_rel_error

TOL = 2e-3  # of the largest |logit| per row, as the Llama tests take it
FAMILIES = ["qwen3", "qwen2-window", "mistral", "gemma2", "gemma3", "phi3"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {f: make_tiny_family(root / f, f, seed=i + 11) for i, f in enumerate(FAMILIES)}


@pytest.fixture(scope="module")
def hf_models(checkpoints: dict[str, Path]) -> dict:
    return hf_models_of(checkpoints)


def run_mixed(runner: ModelRunner, chunk: int, seed: int = 1) -> list[Req]:
    """Three requests, prompts longer than every window, arriving so decodes and chunks share steps."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, runner.config.vocab_size, (n,), generator=g).tolist() for n in (23, 9, 31)]
    tables = interleaved_tables(3, 16, 64)
    reqs = [Req(rid, p, t, a) for rid, p, t, a in zip("abc", prompts, tables, (0, 2, 5), strict=True)]
    drive(runner, reqs, chunk=chunk, new_tokens=6)
    return reqs


def assert_equals_hf(reqs: list[Req], hf) -> None:
    with torch.no_grad():
        for r in reqs:
            ref = hf(torch.tensor([r.tokens])).logits[0]
            assert len(r.rows) == 6
            assert max_rel_error(r.rows, ref) < TOL, r.rid


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("chunk", [3, 8, 64])
def test_mixed_chunked_steps_equal_hf(checkpoints, hf_models, family: str, chunk: int) -> None:
    runner = ModelRunner.from_pretrained(str(checkpoints[family]), num_blocks=64, block_size=4)
    assert runner.config.family == family.split("-")[0]
    assert_equals_hf(run_mixed(runner, chunk), hf_models[family])


@pytest.mark.parametrize("family", ["gemma2", "gemma3", "mistral"])
def test_the_torch_backend_equals_hf_too(checkpoints, hf_models, family: str) -> None:
    runner = ModelRunner.from_pretrained(str(checkpoints[family]), num_blocks=64, block_size=4,
                                         attention_backend="torch")
    assert_equals_hf(run_mixed(runner, 5), hf_models[family])


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_greedy_generation_equals_hf(checkpoints, hf_models, family: str) -> None:
    runner = ModelRunner.from_pretrained(str(checkpoints[family]), num_blocks=64, block_size=4)
    llm = LLM.from_engine(LLMEngine(runner, EngineConfig(prefill_chunk=4, max_batch_tokens=16, threads=1)))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, runner.config.vocab_size, (n,), generator=g).tolist() for n in (13, 20)]
    outs = llm.generate(prompts,
                        SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    with torch.no_grad():
        for p, out in zip(prompts, outs, strict=True):
            x = torch.tensor([p])
            ref = hf_models[family].generate(x, attention_mask=torch.ones_like(x), max_new_tokens=10,
                                             do_sample=False, eos_token_id=None)
            assert out.token_ids == ref[0, len(p):].tolist()


def test_each_switch_changes_the_logits(checkpoints) -> None:
    # Guards the HF comparisons: a family switch the model ignored would show here as equal logits.
    from dataclasses import replace

    from mixserve.core.batch import ForwardBatch, ForwardSeq
    from mixserve.model.attention import get_backend
    from mixserve.model.decoder import DecoderModel
    from mixserve.model.loader import load_weights

    cfg, sd, _ = load_weights(checkpoints["gemma2"])
    batch_ids = torch.arange(3, 40)
    base = None
    for change in ({}, {"attn_softcap": 0.0}, {"final_softcap": 0.0}, {"layer_windows": ()},
                   {"attn_scale": None}, {"embed_scale": 1.0}):
        model = DecoderModel(replace(cfg, **change), torch.float32)
        model.load_hf_weights(sd, "x")
        runner = ModelRunner(model, None, num_blocks=16, block_size=4, attention=get_backend("auto", "cpu"),
                             model_name="x", cuda_graphs=False, max_num_seqs=4)
        logits = runner.forward(ForwardBatch([ForwardSeq("x", batch_ids.tolist(), 0, list(range(10)))]))
        if base is None:
            base = logits
        else:
            assert not torch.allclose(base, logits, atol=1e-4), change


def test_an_unknown_architecture_names_the_supported_ones(tmp_path: Path) -> None:
    import json

    from mixserve.model.hf_loader import read_config

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["FalconForCausalLM"]}))
    with pytest.raises(ModelLoadError, match="unsupported architecture.*Falcon.*supported: .*Qwen3For"):
        read_config(tmp_path)


def _longrope(head_dim: int) -> dict:
    g = torch.Generator().manual_seed(7)
    short, long = (1 + torch.rand(head_dim // 2, generator=g) * k for k in (0.5, 8.0))
    return {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": short.tolist(),
            "long_factor": long.tolist(), "original_max_position_embeddings": 16}


def test_phi3_longrope_tables_equal_hf_on_both_sides_of_the_original_context(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from mixserve.model.loader import load_model

    path = make_tiny_family(tmp_path, "phi3", rope_parameters=_longrope(16),
                            original_max_position_embeddings=16)
    ours = load_model(path).model.rotary
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).model.rotary_emb
    x = torch.zeros(1, dtype=torch.float32)
    for positions in (torch.arange(0, 16), torch.arange(16, 40)):  # HF switches on the longest position
        cos, sin = hf(x, positions[None])
        assert torch.allclose(ours.cos[positions], cos[0, :, :8], atol=1e-6)
        assert torch.allclose(ours.sin[positions], sin[0, :, :8], atol=1e-6)
    assert ours.cos[0, 0].item() > 1.0  # cos(0) times the attention factor: the scale is there


def test_phi3_longrope_within_the_original_context_equals_hf(tmp_path: Path) -> None:
    path = make_tiny_family(tmp_path, "phi3", rope_parameters=_longrope(16),
                            original_max_position_embeddings=16)
    from transformers import AutoModelForCausalLM

    runner = ModelRunner.from_pretrained(str(path), num_blocks=64, block_size=4)
    assert runner.config.rope_scaling.attention_factor > 1.0
    reqs = [Req("a", list(range(5, 14)), list(range(8)), 0),
            Req("b", list(range(40, 45)), list(range(8, 16)), 1)]
    drive(runner, reqs, chunk=3, new_tokens=6)  # 15 and 11 positions: all below the original 16
    assert_equals_hf(reqs, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval())


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_is_as_close_to_fp32_as_hf_bf16(checkpoints, hf_models, family: str) -> None:
    # bf16 rounds at other places than HF's bf16 forward (packed GEMM blocking, our attention), so it cannot
    # equal it bit for bit; it must be about as close to the fp32 reference: a mean error no worse than 1.5x
    # HF's, each row no worse than 2x HF's worst, each plus 2^-8 (one bf16 rounding of the largest logit),
    # which keeps the bound meaningful where a 3-layer model's errors are all near one rounding.
    import copy

    runner = ModelRunner.from_pretrained(str(checkpoints[family]), num_blocks=64, block_size=4,
                                         dtype="bfloat16")
    reqs = run_mixed(runner, 5, seed=2)
    ref_model = hf_models[family]
    hf_bf16 = copy.deepcopy(ref_model).to(torch.bfloat16)
    ours, theirs = [], []
    with torch.no_grad():
        for r in reqs:
            x = torch.tensor([r.tokens])
            ref, hf = ref_model(x).logits[0], hf_bf16(x).logits[0].float()
            for pos, row in r.rows:
                scale = ref[pos].abs().max()
                ours.append(float((row.float() - ref[pos]).abs().max() / scale))
                theirs.append(float((hf[pos] - ref[pos]).abs().max() / scale))
    slack = 2.0 ** -8
    assert sum(ours) / len(ours) <= 1.5 * sum(theirs) / len(theirs) + slack, (ours, theirs)
    assert max(ours) <= 2 * max(theirs) + slack, (max(ours), max(theirs))
