"""The whole CPU path as an AVX2-only CPU runs it, on any x86 machine: a child process with torch's kernels
held to AVX2 (ATEN_CPU_CAPABILITY), oneDNN's too (ONEDNN_MAX_CPU_ISA) and our kernels built for haswell,
runs the tiny model in float32 against HF transformers and in bfloat16 against our own float32 logits. It
covers what the runner picks there and nothing else covers on an AVX-512 machine: oneDNN's AVX2 GEMMs
beside our AVX2 panels, and bf16 without vdpbf16ps (torch's linears and ops, our attention widening K/V to
float32)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mixserve.model.cpu import build

AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MIXSERVE_KERNEL_MARCH": "haswell"}
ROOT = Path(__file__).resolve().parents[2]


def child(path: str) -> None:
    """In the AVX2 process: what runs is the AVX2 code, and its answers hold."""
    from mixserve import ModelRunner
    from mixserve.model import ops
    from tests.runner.drive import Req, drive, interleaved_tables
    from tests.runner.test_tiny_vs_hf import check_mixed_against_hf

    assert torch.backends.cpu.get_cpu_capability() == "AVX2"
    assert build.kernel_isa() == {"avx2"}, build.describe()
    check_mixed_against_hf(Path(path))  # fp32: oneDNN (AVX2) GEMMs, AVX2 panels, AVX2 attention and ops
    cpu = ops.cpu_ops(torch.float32)
    w, b = torch.randn(960, 576) / 24, torch.randn(960)
    packed = cpu.pack(w)
    assert packed.few is not None and packed.few.max_rows == 128
    for rows in (1, 6, 128, 129, 300):  # GEMV, AVX2 panels, then oneDNN's AVX2 GEMM
        x = torch.randn(rows, 576)
        torch.testing.assert_close(cpu.linear(x, packed, b), torch.nn.functional.linear(x, w, b),
                                   rtol=1e-5, atol=1e-5)
    runs = {}
    for dtype in ("float32", "bfloat16"):
        runner = ModelRunner.from_pretrained(path, num_blocks=64, block_size=4, dtype=dtype)
        assert runner.attention.name == "cpu"  # the C++ paged attention, built for haswell
        # float32: oneDNN's GEMMs, our panels and layer ops; bf16: oneDNN has no AVX2 bf16 linear, torch's set
        assert runner.ops.name == ("cpu-onednn-float32+cpp" if dtype == "float32" else "torch")
        g = torch.Generator().manual_seed(2)
        prompts = [torch.randint(0, runner.config.vocab_size, (n,), generator=g).tolist() for n in (19, 7)]
        reqs = [Req(rid, p, t, a) for rid, p, t, a in
                zip("ab", prompts, interleaved_tables(2, 16, 64), (0, 2), strict=True)]
        drive(runner, reqs, chunk=5, new_tokens=4)
        runs[dtype] = reqs
    compared = 0
    for f, b in zip(runs["float32"], runs["bfloat16"], strict=True):
        for (pos, row_f), (_, row_b) in zip(f.rows, b.rows, strict=True):
            if f.tokens[: pos + 1] != b.tokens[: pos + 1]:
                break  # greedy picks diverged: later rows see other tokens
            # bf16 weights and activations: a few bf16 ulps of the logits' scale, never a wrong sum
            assert float((row_b.float() - row_f).abs().max() / row_f.abs().max()) < 0.05
            compared += 1
    assert compared >= 2
    print("avx2 stand-in: ok")


@pytest.mark.skipif("avx2" not in build.cpu_flags().split() or build.available() is not None,
                    reason="needs an AVX2 CPU and the C++ kernels")
def test_the_avx2_path_runs_the_tiny_model_right(tiny_model_dir: Path) -> None:
    env = {**os.environ, **AVX2_ENV}
    done = subprocess.run([sys.executable, "-m", "tests.runner.test_avx2_stand_in", str(tiny_model_dir)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "avx2 stand-in: ok" in done.stdout


if __name__ == "__main__":
    child(sys.argv[1])
