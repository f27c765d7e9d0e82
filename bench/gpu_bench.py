#!/usr/bin/env python3
"""GPU bench (issue 6): mixserve against HF transformers and the H200's floors, in one run of < 5 minutes.

Random weights of the Llama-3.2-1B shape (bf16) are written to a temporary HF folder with a word-level
tokenizer (gpu_setup.py), then:
  1. correctness: our logits vs HF forward, chunk sizes 1, 7, 64 in mixed batches (a decoding sequence
     beside prefill chunks; chunk 1 is decode-only and runs from CUDA graphs) (gpu_steps.py);
  2. decode step time at batch 1/16/64/256 with 512 tokens of context vs (weights + KV read) / copy bandwidth,
     and at batch 1 and 64 the same step with the Triton kernels off (graphs of the eager ops, and no graphs);
  3. prefill throughput at chunk 512 and 2048 vs the measured bf16 matmul rate (512 also with FlexAttention
     as the packed kernel, and with the kernels off), and one step of 16 whole 512-token prompts;
  4. end to end: 64 x (512 in, 128 out, ignore_eos) through LLM.generate vs HF `generate_batch`
     (defaults, and ContinuousBatchingConfig(use_cuda_graph=True)); the better HF figure is the reference
     (gpu_e2e.py).
Each section is guarded (an error prints and the run goes on) and a global time guard skips what would
not fit. One table is printed last. Past runs' figures: bench/results/gpu_bench_runs.md.

    python3 bench/gpu_bench.py            # on the GPU machine
    python3 bench/gpu_bench.py --tiny     # a tiny model on the CPU: checks the script itself
    python3 bench/gpu_bench.py --small    # the tiny model on the GPU, full workloads (debugging)
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

import torch

# Run as `python3 bench/gpu_bench.py` from anywhere: mixserve is imported from this checkout, the sections
# from this folder (sys.path[0] when run as a script).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(1, str(Path(__file__).resolve().parent))

import gpu_common  # noqa: E402
from gpu_common import Bench, guarded, print_table  # noqa: E402
from gpu_e2e import end_to_end_hf, end_to_end_ours, summary  # noqa: E402
from gpu_setup import kernels_row, load_runner, measure_ceilings, setup_model  # noqa: E402
from gpu_steps import correctness, decode, prefill  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny model on the CPU (checks the script)")
    ap.add_argument("--small", action="store_true", help="tiny model on the GPU, full workloads (debugging)")
    ap.add_argument("--no-hf", action="store_true", help="skip HF generate_batch (step 4's reference)")
    ap.add_argument("--budget-s", type=float, default=float(os.environ.get("GPU_BENCH_BUDGET_S", 285)))
    ap.add_argument("--no-graphs", action="store_true", help="runner without CUDA graphs (debugging)")
    ap.add_argument("--rows-file", type=Path, help="append each result row to this file as it is measured")
    args = ap.parse_args()
    gpu_common.ROWS_FILE = args.rows_file
    # A kill (timeout) still prints what was measured.
    signal.signal(signal.SIGTERM, lambda *_: (print_table(), sys.exit(124)))
    bench = Bench(args.tiny, args.budget_s, small=args.small)
    bench.cuda_graphs = not args.no_graphs
    torch.set_grad_enabled(False)
    guarded("setup: model", bench, 0, setup_model)
    if bench.model_dir is None:
        print_table()
        return
    guarded("setup: ceilings", bench, 0, measure_ceilings)
    guarded("setup: runner", bench, 30, load_runner)
    guarded("setup: kernels", bench, 0, kernels_row)
    if bench.runner is not None:
        guarded("1. correctness", bench, 30, correctness)
        if bench.copy_gbs:
            guarded("2. decode", bench, 30, decode)
        if bench.matmul_tflops:
            guarded("3. prefill", bench, 30, prefill)
    guarded("4. e2e ours", bench, 40, end_to_end_ours)
    if not args.no_hf:
        guarded("4. e2e HF defaults", bench, 35, lambda b: end_to_end_hf(b, "defaults"))
        guarded("4. e2e HF cuda graphs", bench, 35, lambda b: end_to_end_hf(b, "cuda_graph"))
    summary(bench)
    print_table()


if __name__ == "__main__":
    main()
