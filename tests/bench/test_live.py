"""Live: the bench and the sweep against the real server (a subprocess) on the tiny random model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mixserve.bench.server import DEFAULT_SERVER_CMD, ServerProcess, free_port, server_command
from mixserve.bench.trace import read_step_trace
from mixserve.cli import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def workload_flags(model_dir: Path) -> list[str]:
    """6 requests at once, 2 of them long, random ids inside the tiny vocabulary; one chunk per token."""
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    return ["--workload", "random", "--num-requests", "6", "--request-rate", "inf", "--input-len", "20",
            "--output-len", "5", "--long-prompt-fraction", "0.34", "--long-input-len", "200",
            "--long-output-len", "3", "--vocab-size", str(vocab), "--logprobs", "0", "--no-progress"]


@pytest.mark.slow
def test_bench_against_the_real_server_writes_a_valid_report_and_png(tiny_model_dir, tmp_path, capsys):
    port, trace = free_port(), tmp_path / "steps.jsonl"
    argv = server_command(DEFAULT_SERVER_CMD, port=port, chunk=16, budget=64, trace=trace,
                          extra_args=f"--model {tiny_model_dir}")
    out, png = tmp_path / "result.json", tmp_path / "result.png"
    with ServerProcess(argv, port, tmp_path / "server.log", startup_timeout_s=240) as server:
        rc = main(["bench", "--url", server.url, "--out", str(out), "--plot", str(png), "--slo-ttft", "600",
                   *workload_flags(tiny_model_dir)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["completed"] == 6 and report["failed"] == 0, report["failures"]
    # the token counts come from the server's usage: exact prompt lengths (token-id prompts), ignore_eos
    by_kind = {r["kind"]: r for r in report["requests"]}
    assert (by_kind["long"]["prompt_tokens"], by_kind["long"]["completion_tokens"]) == (200, 3)
    assert (by_kind["short"]["prompt_tokens"], by_kind["short"]["completion_tokens"]) == (20, 5)
    assert report["total_output_tokens"] == 4 * 5 + 2 * 3
    assert report["chunks_per_token"] == 1.0  # with logprobs the server streams every token on its own
    assert report["classes"]["long"]["count"] == 2 and report["classes"]["short"]["count"] == 4
    assert report["ttft_s"]["count"] == 6 and report["itl_s"]["count"] == 4 * 4 + 2 * 2
    assert report["goodput"] == pytest.approx(report["request_throughput"])  # a 600 s SLO holds for all
    # the server's histograms saw exactly this run's requests and gaps (warm-up left out by the diff)
    check = report["server_check"]
    assert check["server_ttft_count"] == 6 and check["server_itl_count"] == 4 * 4 + 2 * 2
    assert check["ttft_ratio"] > 0 and check["itl_ratio"] > 0
    assert png.read_bytes()[:8] == PNG_MAGIC
    assert "TTFT mean/p50/p90/p99 (ms)" in capsys.readouterr().out
    steps = read_step_trace(trace)
    assert steps and all(s.decode_tokens + s.prefill_tokens <= 64 for s in steps)


@pytest.mark.slow
def test_sweep_runs_one_server_per_setting_and_writes_table_and_pictures(tiny_model_dir, tmp_path):
    rc = main(["bench", "sweep", "--prefill-chunk", "0,16", "--max-batch-tokens", "64",
               "--whole-prompt-budget", "0", "--server-args", f"--model {tiny_model_dir}",
               "--out-dir", str(tmp_path), *workload_flags(tiny_model_dir)])
    assert rc == 0
    summary = json.loads((tmp_path / "sweep.json").read_text())
    rows = summary["rows"]
    assert [r["setting"] for r in rows] == ["WholePrompt, budget 64", "chunk 16, budget 64"]
    assert all("error" not in r and r["completed"] == 6 and r["failed"] == 0 for r in rows)
    # WholePrompt lets a 200-token prompt run past a 64 budget alone; chunking keeps every step within it
    assert rows[0]["max_step_tokens"] >= 200 and rows[1]["max_step_tokens"] <= 64
    assert summary["machine"]["nproc"] >= 1
    md = (tmp_path / "sweep.md").read_text()
    assert "| chunk 16, budget 64 |" in md
    for name in ("ttft_cdf.png", "tpot_cdf.png", "timeline.png", "chunk16-b64.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG_MAGIC
    assert json.loads((tmp_path / "whole-b64.json").read_text())["steps"]["num_steps"] > 0
