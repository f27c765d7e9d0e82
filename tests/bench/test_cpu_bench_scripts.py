"""The pure parts of the CPU bench scripts: bench/floors.py's counts, the flag plumbing, the trace reading.

The measurements themselves (copy, GEMM, throughput) are the scripts' business and are not timed here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench import floors, offline, serve_overhead
from tests.tiny_model import make_tiny_llama


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_parameter_count_from_the_config_equals_the_models(tmp_path: Path, tie: bool, fmt: str) -> None:
    from transformers import AutoModelForCausalLM

    hf_dir = make_tiny_llama(tmp_path / "hf", tie_word_embeddings=tie)
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir))
    expected = sum(p.numel() for p in model.parameters())  # HF counts a tied lm_head once too
    path = hf_dir
    if fmt == "gguf":
        path = make_tiny_llama(tmp_path / "g", fmt="gguf", tie_word_embeddings=tie)
    cfg = floors.model_config(str(path))
    assert floors.parameter_count(cfg) == expected
    assert floors.weight_bytes(cfg, torch.bfloat16) == 2 * expected


def test_gemm_shapes_are_the_fused_qkv_and_gate_up(tiny_model_dir: Path) -> None:
    cfg = floors.model_config(str(tiny_model_dir))
    shapes = dict((name, (k, n)) for name, k, n in floors.model_gemm_shapes(cfg))
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    assert shapes == {"qkv": (cfg.hidden_size, qkv), "gate_up": (cfg.hidden_size, 2 * cfg.intermediate_size)}


def test_the_few_row_rate_is_of_the_gate_up_shape_at_a_row_count_it_tries(tiny_model_dir: Path) -> None:
    from mixserve.model.cpu import few_row_linear

    cfg = floors.model_config(str(tiny_model_dir))
    rate = floors.few_row_rate(cfg, min_seconds=0.01)
    if few_row_linear.panel_width() == 0:
        assert rate is None
        return
    assert rate is not None and rate.rows in floors.FEW_ROWS and rate.flops_per_s > 0
    assert (rate.k, rate.n) == (cfg.hidden_size, 2 * cfg.intermediate_size)


def test_onednn_linear_computes_x_times_w_transposed() -> None:
    x, w = torch.randn(8, 16), torch.randn(24, 16)
    torch.testing.assert_close(floors.onednn_linear(x, w), x @ w.T, rtol=1e-4, atol=1e-4)


def test_cpu_flags_name_every_flag_the_benches_depend_on() -> None:
    flags = floors.cpu_flags()
    assert all(isinstance(flags[f], bool) for f in floors.CPU_FLAGS)
    assert flags["torch_capability"] == torch.backends.cpu.get_cpu_capability()
    assert floors.has_fast_bf16({"avx512_bf16": False, "amx_bf16": True})
    assert not floors.has_fast_bf16({"avx2": True, "avx512_bf16": False, "amx_bf16": False})


def test_offline_passes_only_engine_and_workload_flags_to_its_children() -> None:
    argv = ["--threads", "2", "--vllm", "/v/bin/python", "--out=/tmp/x.json", "--skip-hf",
            "--num-requests", "4", "--vllm-work", "/w", "--timeout", "9", "--prefill-chunk=64", "--skip-bf16",
            "--rounds", "3"]
    assert offline.child_argv(argv) == ["--threads", "2", "--num-requests", "4", "--prefill-chunk=64"]


def test_offline_rounds_report_each_systems_median_run() -> None:
    rows = [{"system": s, "dtype": "float32", "wall_s": w, "round": k}
            for k, (a, b) in enumerate([(10.0, 30.0), (14.0, 33.0), (12.0, 31.0)], 1)
            for s, w in (("mixserve", a), ("hf", b))]
    mid = offline.median_runs(rows)
    assert [(r["system"], r["wall_s"], r["round"], r["runs"]) for r in mid] == [
        ("mixserve", 12.0, 3, 3), ("hf", 31.0, 3, 3)]
    assert offline.median_runs(rows[:4])[0]["wall_s"] == 14.0  # of two runs, the slower


def test_serve_overhead_server_gets_no_workload_flags() -> None:
    argv = ["--num-requests", "8", "--rounds", "2", "--dtype", "bfloat16", "--output-tokens=4", "--out", "x"]
    eng = serve_overhead.without(argv, serve_overhead.OWN_FLAGS)
    assert eng == ["--num-requests", "8", "--dtype", "bfloat16", "--output-tokens=4"]
    assert serve_overhead.without(eng, serve_overhead.WORKLOAD_FLAGS) == ["--dtype", "bfloat16"]


def test_decode_steps_reads_only_full_decode_steps(tmp_path: Path) -> None:
    def step(t: float, dur: float, decodes: int, prefill: int = 0) -> str:
        return json.dumps({"time": t, "duration_s": dur, "decode_tokens": decodes, "prefill_tokens": prefill})

    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join([step(0.0, 0.5, 0, 256),    # prefill: not a decode step
                                step(1.0, 0.1, 4, 0),      # full decode steps, 0.2 s apart
                                step(1.2, 0.1, 4, 0),
                                step(1.4, 0.3, 4, 0),      # the last: a duration but no period
                                step(2.0, 0.05, 2, 0)]) + "\n")  # two sequences left: not counted
    got = serve_overhead.decode_steps(trace, 4)
    assert got["steps"] == 3 and got["duration_p50_s"] == pytest.approx(0.1)
    assert got["period_p50_s"] == pytest.approx(0.2)


def test_workload_m_times_the_long_prompt_alone_on_prompts_the_server_has_not_cached():
    # M's own long prompts sit in the prefix cache after M: timing one of them "alone" measured a cache hit
    from bench import workload_m
    from mixserve.bench.workload import DEFAULT_VOCAB_SIZE
    from mixserve.bench.workload import workload_m as make_m

    m = make_m(num_short=48, short_rate=2.0, short_input=(32, 128), short_output=64,
               long_input_len=workload_m.LONG_LEN, long_output=8, vocab_size=DEFAULT_VOCAB_SIZE, seed=0)
    in_m = {tuple(s.prompt[:16]) for s in m if s.kind == "long"}
    alone = workload_m.alone_specs()
    firsts = {tuple(s.prompt[:16]) for s in alone}
    assert len(firsts) == len(alone) == workload_m.ALONE_REPEATS  # no two share even a first block
    assert not firsts & in_m
    assert all(len(s.prompt) == workload_m.LONG_LEN and s.output_len == 1 for s in alone)
