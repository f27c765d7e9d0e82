"""Does keeping a GGUF's weights in their quantized blocks (`[engine] quantization = auto`) pay on this CPU?

Not a test. Run: .venv/bin/python bench/quant.py [--modes none,auto] [--steps 100] [--context 64]
[--threads 0] [--model FILE] [--llama-bench PATH] [--json PATH]. A mode: auto, none, int8, or one of them
with -i8a (int8_activations on), -bf16 (the model in bfloat16) and/or -body (auto-body: its decode steps
through the Python layer body, not the C++ layer stack), in that order: auto-i8a-bf16-body.
Per mode, side by side: the weight bytes one decoded token reads (each layer's linears and the LM head:
a QuantWeight's `.nbytes`, a float weight's parameter bytes; the embedding reads one row, so the table is
not counted again when the head is tied to it), single-stream ms per token and tok/s, and peak and steady
RSS. Timing: one process holds a runner per mode; after a --context-token prompt is prefilled, rounds of
one-token decode steps (at positions context, context + 1, ...) alternate between the modes, the order
reversed every other round, so the machine's noise falls on all of them alike; the median step is reported.
RSS: a fresh subprocess per mode (this script with --rss-only MODE), spawned before this process loads any
model: the baseline after the imports, ru_maxrss (peak; VmHWM if larger) and VmRSS after load + a prefill
and a decode (steady), with a KV cache of a few blocks; then the savings ratio (RSS_none - RSS_auto) /
(fp32 weight bytes - file bytes), target >= 70%. --llama-bench runs `PATH -m FILE -p 0 -n 128 -t THREADS`
once, after our timing (not interleaved with it), and adds its ms per token and ours / llama.cpp.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

import mixserve  # noqa: F401  (the baseline RSS: torch and mixserve imported)
from mixserve.core.batch import ForwardBatch, ForwardSeq
from mixserve.engine.threads import available_cores, bind_threads, set_threads
from mixserve.model.cpu import build
from mixserve.model.cpu.quant_linear import QuantWeight
from mixserve.model.loader import default_model_path
from mixserve.runner.model_runner import ModelRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))
from argv import write_report  # noqa: E402

FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "f16c", "fma")
BLOCK_SIZE, ROUND_STEPS, WARM_STEPS, RSS_BLOCKS = 16, 10, 3, 8
MB = 1e6
BODY = "-body"  # a mode's suffix: decode steps through the Python layer body (see `load`)
BF16 = "-bf16"  # before -body: the model in bfloat16 (dtype, the opt-in for speed), not float32
INT8_INPUTS = "-i8a"  # before -bf16: int8_activations on (inputs rounded to int8, integer dots)


def kb_mb(kb: int) -> float:
    return kb * 1024 / MB


def cpu_flags() -> str:
    """The flags the kernels depend on, as 'avx2+ avx512f- ...' from /proc/cpuinfo."""
    try:
        line = next(x for x in Path("/proc/cpuinfo").read_text().splitlines() if x.startswith("flags"))
        have = set(line.partition(":")[2].split())
    except (OSError, StopIteration):
        have = set()
    return " ".join(f + ("+" if f in have else "-") for f in FLAGS)


def proc_status_kb(key: str) -> int:
    """A line of /proc/self/status (VmRSS, VmHWM) in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def load(model: str, mode: str, num_blocks: int) -> ModelRunner:
    """A runner of `mode`; MODE-body: that mode with its decode steps run by the Python layer body instead
    of the C++ layer stack (model/cpu/decode_layers.py), to see what the stack saves; MODE-bf16[-body]: in
    bfloat16."""
    base = mode.removesuffix(BODY)
    dtype = "bfloat16" if base.endswith(BF16) else "float32"
    quantization = base.removesuffix(BF16)
    runner = ModelRunner.from_pretrained(model, num_blocks=num_blocks, block_size=BLOCK_SIZE, device="cpu",
                                         dtype=dtype, quantization=quantization.removesuffix(INT8_INPUTS),
                                         int8_activations=quantization.endswith(INT8_INPUTS))
    if mode.endswith(BODY):
        runner.model.stack = None
    return runner


def tensor_bytes(w: Any) -> int:
    return w.nbytes if isinstance(w, QuantWeight) else w.numel() * w.element_size()


def weight_bytes_per_token(runner: ModelRunner) -> int:
    """Bytes of weights one decode step reads: every layer's linears and the LM head (a MoE layer: the
    router and top_k / num_experts of its experts' bytes, what one token reads on average)."""
    model = runner.model
    total = tensor_bytes(model.lm_head)
    for layer in model.layers:
        total += tensor_bytes(layer.qkv) + tensor_bytes(layer.o_proj)
        mlp = layer.mlp
        if hasattr(mlp, "gate_up"):
            total += tensor_bytes(mlp.gate_up) + tensor_bytes(mlp.down)
        else:
            experts = sum(tensor_bytes(w) for pair in mlp.quantized for w in pair) or sum(
                tensor_bytes(p) for n, p in mlp.named_parameters() if n != "gate")
            total += tensor_bytes(mlp.gate) + experts * mlp.top_k // mlp.num_experts
    return total


def fp32_bytes(runner: ModelRunner) -> int:
    """The model's unique parameters at 4 bytes each (of a `none` runner: every weight a parameter)."""
    return 4 * sum(p.numel() for p in runner.model.parameters())


def prefill(runner: ModelRunner, context: int) -> list[int]:
    """Prefill `context` tokens from position 0; the block table, with room for a round of decodes."""
    table = list(range(-(-(context + ROUND_STEPS) // BLOCK_SIZE)))
    ids = torch.randint(0, runner.config.vocab_size, (context,), generator=torch.Generator().manual_seed(0))
    runner.forward(ForwardBatch([ForwardSeq("p", ids.tolist(), 0, table)]))
    return table


def decode_round(runner: ModelRunner, context: int, table: list[int], steps: int) -> list[float]:
    """Seconds of each of `steps` one-token decode steps at positions context, context + 1, ..."""
    times = []
    for j in range(steps):
        batch = ForwardBatch([ForwardSeq("p", [(1000 + j) % runner.config.vocab_size], context + j, table)])
        t0 = time.perf_counter()
        runner.forward(batch)
        times.append(time.perf_counter() - t0)
    return times


def time_modes(runners: dict[str, ModelRunner], context: int, steps: int) -> dict[str, list[float]]:
    """Decode step seconds per mode, rounds of ROUND_STEPS alternating between the modes (ABBA order)."""
    tables = {m: prefill(r, context) for m, r in runners.items()}
    for m, r in runners.items():
        decode_round(r, context, tables[m], WARM_STEPS)
    times: dict[str, list[float]] = {m: [] for m in runners}
    rounds = -(-steps // ROUND_STEPS)
    for i in range(rounds):
        order = list(runners) if i % 2 == 0 else list(reversed(runners))
        n = min(ROUND_STEPS, steps - i * ROUND_STEPS)
        for m in order:
            times[m] += decode_round(runners[m], context, tables[m], n)
    return times


def rss_only(model: str, mode: str, context: int) -> None:
    """In a fresh process: baseline, peak and steady RSS of loading `mode`, as one JSON line on stdout."""
    baseline = proc_status_kb("VmRSS")
    runner = load(model, mode, max(RSS_BLOCKS, -(-(context + ROUND_STEPS) // BLOCK_SIZE)))
    table = prefill(runner, context)
    decode_round(runner, context, table, 1)
    maxrss, hwm = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, proc_status_kb("VmHWM")
    out = {"baseline_kb": baseline, "peak_kb": max(maxrss, hwm), "ru_maxrss_kb": maxrss, "vm_hwm_kb": hwm,
           "steady_kb": proc_status_kb("VmRSS"),
           "weight_bytes_per_token": weight_bytes_per_token(runner)}
    print(json.dumps(out))


def unbound() -> None:
    """A child back on all the cores: bind_threads pinned this thread, and a child inherits that."""
    os.sched_setaffinity(0, available_cores())


def measure_rss(model: str, mode: str, args: argparse.Namespace) -> dict[str, int]:
    """--rss-only MODE in a subprocess; its JSON line."""
    cmd = [sys.executable, __file__, "--rss-only", mode, "--model", model, "--threads", str(args.threads),
           "--context", str(args.context)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, preexec_fn=unbound)
    if proc.returncode != 0:
        raise SystemExit(f"--rss-only {mode} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def llama_bench(path: str, model: str, threads: int) -> float | None:
    """llama-bench's tok/s for tg128 on `model` (parsed from its markdown table), None after a line why."""
    cmd = [str(Path(path).expanduser()), "-m", model, "-p", "0", "-n", "128", "-t", str(threads)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=300,
                              preexec_fn=unbound)
    except (OSError, subprocess.TimeoutExpired) as e:
        print(f"llama-bench: {e}")
        return None
    for line in proc.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[-2] == "tg128":
            match = re.match(r"[\d.]+", cells[-1])
            if match:
                return float(match.group())
    print(f"llama-bench: no tg128 row (rc {proc.returncode}): {proc.stderr.strip()[-500:]}")
    return None


def print_table(rows: dict[str, dict[str, Any]], llama_ms: float | None) -> None:
    print(f"\n{'mode':<14} {'weight MB read/token':>20} {'ms/token':>9} {'GB/s':>6} {'tok/s':>7} "
          f"{'peak RSS MB':>12} {'steady RSS MB':>14}")
    for mode, r in rows.items():
        print(f"{mode:<14} {r['weight_bytes_per_token'] / MB:>20.1f} {r['ms_per_token']:>9.2f} "
              f"{r['weight_bytes_per_token'] / r['ms_per_token'] / MB:>6.1f} {1e3 / r['ms_per_token']:>7.1f} "
              f"{kb_mb(r['peak_kb']):>12.1f} {kb_mb(r['steady_kb']):>14.1f}")
    if llama_ms is not None:
        print(f"{'llama.cpp':<10} {'':>20} {llama_ms:>9.2f} {'':>6} {1e3 / llama_ms:>7.1f}  "
              "(tg128, run once after ours)")
        for mode, r in rows.items():
            print(f"  ours ({mode}) / llama.cpp ms per token: {r['ms_per_token'] / llama_ms:.2f}x")


def savings(rows: dict[str, dict[str, Any]], fp32: int, file_bytes: int) -> dict[str, float]:
    """(RSS_none - RSS_auto) / (fp32 weight bytes - file bytes), steady and peak; target >= 70%."""
    if "none" not in rows or "auto" not in rows or fp32 <= file_bytes:
        return {}
    none, auto = rows["none"], rows["auto"]
    out = {k: 1024 * (none[k] - auto[k]) / (fp32 - file_bytes) for k in ("steady_kb", "peak_kb")}
    print(f"fp32 weights {fp32 / MB:.1f} MB, file {file_bytes / MB:.1f} MB: RSS saved / (fp32 - file) = "
          f"{out['steady_kb']:.0%} steady, {out['peak_kb']:.0%} peak (target >= 70%: "
          f"{'met' if out['steady_kb'] >= 0.7 else 'MISSED'})")
    held = 1024 * (none["steady_kb"] - none["baseline_kb"])
    print(f"(none holds {held / MB:.0f} MB above its baseline = {held / fp32:.1f}x the fp32 weights: "
          "over 1x, copies besides the parameters (packed for the linears), so the ratio can pass 100%)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="none,auto",
                    help="comma-separated: auto, none, int8, MODE-bf16, MODE[-bf16]-body")
    ap.add_argument("--model", default=None, help="a GGUF file (default: the default model)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: one per core, bound)")
    ap.add_argument("--steps", type=int, default=100, help="timed decode steps per mode")
    ap.add_argument("--context", type=int, default=64, help="prompt tokens prefilled before the decodes")
    ap.add_argument("--llama-bench", default=None, help="llama-bench binary to run on the same file")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--rss-only", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.threads = set_threads(args.threads)
    bind_threads(args.threads)
    model = str(Path(args.model).expanduser() if args.model else default_model_path())
    if args.rss_only:
        rss_only(model, args.rss_only, args.context)
        return
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    print(f"cpu: {cpu_flags()}  kernels: {build.describe()}  threads {torch.get_num_threads()}")
    print(f"model {model}  context {args.context}  steps {args.steps} per mode (rounds of {ROUND_STEPS})")
    rows: dict[str, dict[str, Any]] = {m: measure_rss(model, m.removesuffix(BODY), args) for m in modes}
    for m, r in rows.items():
        print(f"rss {m}: baseline {kb_mb(r['baseline_kb']):.1f} MB  peak {kb_mb(r['peak_kb']):.1f} MB  "
              f"steady {kb_mb(r['steady_kb']):.1f} MB")
    blocks = -(-(args.context + ROUND_STEPS) // BLOCK_SIZE)
    runners = {m: load(model, m, blocks) for m in modes}
    times = time_modes(runners, args.context, args.steps)
    for m, r in rows.items():
        r["weight_bytes_per_token"] = weight_bytes_per_token(runners[m])
        r["ms_per_token"] = 1e3 * statistics.median(times[m])
        r["ms_min"], r["ms_p90"] = 1e3 * min(times[m]), 1e3 * statistics.quantiles(times[m], n=10)[-1]
    fp32 = fp32_bytes(runners["none"] if "none" in runners else load(model, "none", 1))
    del runners
    llama_ms = None
    if args.llama_bench:
        tok_s = llama_bench(args.llama_bench, model, args.threads)
        llama_ms = None if tok_s is None else 1e3 / tok_s
    print_table(rows, llama_ms)
    ratio = savings(rows, fp32, Path(model).stat().st_size)
    if args.json:
        write_report(args.json, {"cpu": cpu_flags(), "kernels": build.describe(), "threads": args.threads,
                                 "model": model, "context": args.context, "steps": args.steps, "modes": rows,
                                 "fp32_weight_bytes": fp32, "file_bytes": Path(model).stat().st_size,
                                 "rss_savings_ratio": ratio, "llama_cpp_ms_per_token": llama_ms})


if __name__ == "__main__":
    main()
