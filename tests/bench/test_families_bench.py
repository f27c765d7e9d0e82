"""bench/families.py's parts: the checkpoints it writes load in mixserve and generate as transformers does,
the shapes it names are the real models', vLLM's runner draws offline_run.py's prompts, a failure is a row."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench import families, offline_run, peers_vllm_w
from mixserve import ModelRunner, SamplingParams
from mixserve.config import EngineConfig
from mixserve.engine import LLMEngine
from mixserve.engine.llm import LLM

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)
TINY_MOE = dict(TINY, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)


@pytest.mark.parametrize("family", list(families.FAMILIES))
def test_a_written_checkpoint_loads_and_generates_as_transformers_does(tmp_path: Path, family: str) -> None:
    from transformers import AutoModelForCausalLM

    layers = 6 if family == "gemma3" else 2  # one full layer after five sliding ones
    cfg = families.hf_config(family, layers, **(TINY_MOE if family == "qwen3_moe" else TINY))
    assert families.write_checkpoint(cfg, tmp_path / "ckpt")
    assert not families.write_checkpoint(cfg, tmp_path / "ckpt")  # there already: reused
    assert not (tmp_path / "ckpt.partial").exists()
    runner = ModelRunner.from_pretrained(str(tmp_path / "ckpt"), num_blocks=64, block_size=4)
    assert (runner.config.family, runner.config.num_layers, runner.config.vocab_size) == (family, layers, 512)
    llm = LLM.from_engine(LLMEngine(runner, EngineConfig(prefill_chunk=4, max_batch_tokens=16, threads=1)))
    prompts = [[5, 17, 300, 42, 9, 100, 7], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.float32).eval()
    with torch.no_grad():
        for p, out in zip(prompts, outs, strict=True):
            x = torch.tensor([p])
            ref = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=6, do_sample=False,
                              eos_token_id=None)
            assert out.token_ids == ref[0, len(p):].tolist()
    assert len(set(sum((o.token_ids for o in outs), []))) > 1  # the logits spread: not one token repeated


def test_the_tokenizer_decodes_every_id_of_the_vocabulary() -> None:
    tok = families.tokenizer(1000)
    assert len(tok) == 1000 and tok.eos_token_id == 2
    assert tok.decode([3, 999]) == "t3 t999" and tok.encode("t7 t998") == [7, 998]


def test_the_shapes_are_the_real_models_and_the_moe_counts_its_active_experts() -> None:
    total, active = families.parameter_counts(families.hf_config("qwen3"))
    assert total == active and 0.59e9 < total < 0.60e9  # Qwen3-0.6B, tied
    total, active = families.parameter_counts(families.hf_config("gemma3"))
    assert total == active and 0.99e9 < total < 1.01e9  # Gemma-3-1B's text model
    cfg = families.hf_config("gemma3")
    assert cfg.layer_types.count("full_attention") == 4 and cfg.layer_types[5] == "full_attention"
    cfg = families.hf_config("qwen3_moe")
    total, active = families.parameter_counts(cfg)
    assert cfg.num_experts >= 32 and 1e9 < total < 2e9 and active < total / 3


def test_the_moe_config_names_its_experts_as_qwen3_moe_checkpoints_do(tmp_path: Path) -> None:
    cfg = families.hf_config("qwen3_moe", 1, **TINY_MOE)
    families.write_checkpoint(cfg, tmp_path / "m")
    assert json.loads((tmp_path / "m" / "config.json").read_text())["num_experts"] == 8


def test_the_vllm_runner_draws_the_same_prompts_as_offline_run() -> None:
    for vocab in (49152, 151936, 262144):
        assert peers_vllm_w.workload_w(vocab, 32) == offline_run.workload_w(vocab, 32)
    assert peers_vllm_w.workload_w(1000, 3) == offline_run.workload_w(1000, 32)[:3]


def test_the_kv_cache_holds_the_whole_workload() -> None:
    cfg = families.hf_config("qwen3")  # 28 layers x 8 KV heads x 128: 229,376 bytes a token in fp32
    tokens = sum(map(len, offline_run.workload_w(cfg.vocab_size))) + 32 * 64
    assert families.kv_cache_gib(cfg, "float32", 32, 64) * 2**30 >= tokens * 229_376
    assert families.kv_cache_gib(cfg, "bfloat16", 32, 64) * 2**30 >= tokens * 229_376 // 2
    assert families.kv_cache_gib(cfg, "float32", 1, 1) == 1


def test_a_failed_run_is_a_row_with_its_one_line_error() -> None:
    stderr = ("Traceback (most recent call last):\n  File x\n"
              "(EngineCore pid=12) ] ValueError: Gemma3 is not supported on CPU\n"
              "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s)\n")
    assert families.error_line(stderr) == "ValueError: Gemma3 is not supported on CPU"
    rows = [{"system": "mixserve", "dtype": "float32", "wall_s": 2.0, "output_tokens": 100, "round": 1},
            {"system": "vllm", "dtype": "float32", "wall_s": 4.0, "output_tokens": 100, "round": 1},
            {"system": "vllm", "dtype": "bfloat16", "error": "ValueError: a | b", "round": 1}]
    lines = families.table(rows)
    assert lines[2] == "| mixserve | float32 | 2.0 | 50.0 | 2.00 | target >= 1.00: met |"
    assert lines[3] == "| vLLM-CPU | float32 | 4.0 | 25.0 | - |  |"
    assert lines[4] == "| vLLM-CPU | bfloat16 | - | - | - | failed: ValueError: a / b |"
