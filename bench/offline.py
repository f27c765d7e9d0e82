"""Workload W offline: mixserve fp32 and bf16 against HF transformers' static batches, one process each.

32 requests, prompt lengths uniform in 64..512 (random.Random(0)), 64 output tokens each, ignore_eos,
greedy, on the default model. Each system runs in a process of its own (bench/offline_run.py), one after
the other, so mixserve's thread binding cannot touch HF's run: mixserve fp32, mixserve bf16, HF fp32
(static batches of 8 sorted by length), and vLLM-CPU fp32 and bf16 with `--vllm PYTHON` (the python of a
vLLM venv made by ../shared/peers/setup_vllm.sh; its WORK folder is the venv's parent's parent unless
`--vllm-work` says). Prints the floors (bench/floors.py) first, then one table with output tok/s, the
ratios and the issue's targets, and how many of the requests' greedy tokens equal HF's; writes the whole
as JSON (`--out`, bench/results/offline.json by default). `make bench-offline`.
`--rounds N` runs the whole plan N times in turn (a machine's speed can move over minutes:
docs/decisions/interleaved-rounds.md): the table is each system's median run, and each round's ratios are
printed below it.

Targets (issue "CPU fast path"): mixserve fp32 >= 3.0x HF fp32; on a CPU with AVX512-BF16 or AMX,
mixserve bf16 >= 1.8x mixserve fp32 (on AVX2-only CPUs bf16 has no native dot product: reported only).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from bench.argv import engine_config, without, write_report  # noqa: E402
from bench.floors import floors, has_fast_bf16, model_config  # noqa: E402
from bench.offline_run import NUM_REQUESTS, OUTPUT_TOKENS  # noqa: E402
from mixserve.config import add_engine_flags  # noqa: E402

HERE = Path(__file__).resolve().parent
PEERS = HERE.parents[1] / "shared" / "peers"
TARGET_FP32_VS_HF, TARGET_BF16_VS_FP32 = 3.0, 1.8


OWN_FLAGS = {"--vllm": 1, "--vllm-work": 1, "--timeout": 1, "--out": 1, "--skip-hf": 0, "--skip-bf16": 0,
             "--rounds": 1}


def child_argv(argv: list[str]) -> list[str]:
    """argv without this script's own flags: the engine flags and the workload size, for offline_run.py."""
    return without(argv, OWN_FLAGS)


def run_ours(system: str, dtype: str, argv: list[str], timeout: float) -> dict[str, Any]:
    """bench/offline_run.py for one system in a child process (its progress bar on our stderr)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        # argv first, so our --dtype (the last one given) wins over one the caller passed
        cmd = [sys.executable, str(HERE / "offline_run.py"), system, *child_argv(argv), "--dtype", dtype,
               "--result", str(out)]
        subprocess.run(cmd, check=True, timeout=timeout, stdin=subprocess.DEVNULL)
        return json.loads(out.read_text())


def run_vllm(python: str, work: str, dtype: str, timeout: float) -> dict[str, Any]:
    """../shared/peers/vllm_w.py through vllm_env.sh (both cores bound, offline); its last JSON line."""
    script = (f'export WORK="$1"; . "{PEERS}/vllm_env.sh"; '
              f'exec "$2" "{PEERS}/vllm_w.py" "$1" --dtype "$3"')
    done = subprocess.run(["bash", "-c", script, "vllm", work, python, dtype], check=True, timeout=timeout,
                          stdout=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("{")][-1]
    r = json.loads(line)
    return {"system": "vllm", "dtype": dtype, "wall_s": r["wall_s"], "cpu_s": None,
            "output_tokens": round(r["output_tok_per_s"] * r["wall_s"]), "tokens": None}


def verdict(ratio: float | None, target: float, of: str) -> str:
    if ratio is None:
        return "-"
    return f">= {target:.1f}x {of}: {'met' if ratio >= target else 'MISSED'}"


def table(rows: list[dict[str, Any]], fast_bf16: bool) -> tuple[list[str], dict[str, Any]]:
    """The printed table and the ratios, from the rows (tok/s from output tokens / wall)."""
    for r in rows:
        r["output_tok_per_s"] = r["output_tokens"] / r["wall_s"]
    by = {(r["system"], r["dtype"]): r["output_tok_per_s"] for r in rows}
    hf, ours32 = by.get(("hf", "float32")), by.get(("mixserve", "float32"))
    lines = [f"{'system':<36} {'dtype':<9} {'wall s':>7} {'cpu s':>7} {'out tok/s':>10} "
             f"{'x HF':>6} {'x ours fp32':>11}  target"]
    ratios: dict[str, Any] = {}
    names = {"mixserve": "mixserve LLM.generate", "hf": "HF generate, static batches of 8",
             "vllm": "vLLM-CPU LLM.generate, both cores"}
    for r in rows:
        tps = r["output_tok_per_s"]
        x_hf = tps / hf if hf else None
        x_ours = tps / ours32 if ours32 else None
        target = ""
        if (r["system"], r["dtype"]) == ("mixserve", "float32"):
            target = verdict(x_hf, TARGET_FP32_VS_HF, "HF")
            ratios["mixserve_fp32_vs_hf"] = x_hf
        elif (r["system"], r["dtype"]) == ("mixserve", "bfloat16"):
            ratios["mixserve_bf16_vs_fp32"] = x_ours
            target = (verdict(x_ours, TARGET_BF16_VS_FP32, "ours fp32") if fast_bf16
                      else "none: no AVX512-BF16/AMX, bf16 is emulated (converted to fp32 for each product)")
        elif r["system"] == "vllm":
            ratios[f"vllm_{r['dtype']}_vs_hf"] = x_hf
        cpu = "-" if r["cpu_s"] is None else f"{r['cpu_s']:.1f}"
        lines.append(f"{names[r['system']]:<36} {r['dtype']:<9} {r['wall_s']:>7.1f} {cpu:>7} {tps:>10.1f} "
                     f"{'-' if x_hf is None else f'{x_hf:.2f}':>6} "
                     f"{'-' if x_ours is None else f'{x_ours:.2f}':>11}  {target}")
    return lines, ratios


def median_runs(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (system, dtype), in first-seen order: its median run by wall time (of an even count, the
    slower middle one)."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["system"], r["dtype"]), []).append(r)
    return [dict(sorted(g, key=lambda r: r["wall_s"])[len(g) // 2], runs=len(g)) for g in groups.values()]


def same_tokens(rows: list[dict[str, Any]], dtype: str) -> int | None:
    """Requests whose greedy tokens (mixserve at dtype) equal HF fp32's exactly."""
    ours = next((r["tokens"] for r in rows if (r["system"], r["dtype"]) == ("mixserve", dtype)), None)
    hf = next((r["tokens"] for r in rows if r["system"] == "hf"), None)
    if ours is None or hf is None:
        return None
    return sum(a == b for a, b in zip(ours, hf, strict=True))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    add_engine_flags(parser)  # passed on to the mixserve runs (--prefill-chunk, --threads, ...)
    parser.add_argument("--skip-hf", action="store_true", help="only run mixserve")
    parser.add_argument("--skip-bf16", action="store_true", help="only mixserve fp32 (and HF)")
    parser.add_argument("--vllm", metavar="PYTHON", help="a vLLM-CPU venv's python: adds vLLM's rows")
    parser.add_argument("--vllm-work", metavar="DIR", help="setup_vllm.sh's WORK (default: PYTHON/../..)")
    parser.add_argument("--num-requests", type=int, default=NUM_REQUESTS, help="the first N requests of W")
    parser.add_argument("--output-tokens", type=int, default=OUTPUT_TOKENS)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per system at most")
    parser.add_argument("--rounds", type=int, default=1, help="run every system this many times, in turn")
    parser.add_argument("--out", default=str(HERE / "results" / "offline.json"))
    args = parser.parse_args(argv)
    cfg = engine_config(args, "offline")
    if cfg is None:
        return 2
    import torch

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    model = model_config(cfg.model or None)
    floor32 = floors(model, torch.float32)
    floor16 = floors(model, torch.bfloat16, copy_gb_s=floor32.copy_bandwidth_gb_s)
    fast_bf16 = has_fast_bf16(floor32.cpu_flags)
    print("\n".join([*floor32.lines(), *floor16.lines()[2:]]), flush=True)
    print(f"workload W: {args.num_requests} requests, {args.output_tokens} output tokens each, greedy, "
          f"ignore_eos; engine: prefill_chunk={cfg.prefill_chunk} max_batch_tokens={cfg.max_batch_tokens} "
          f"threads={cfg.threads or 'all cores'}", flush=True)
    plan: list[tuple[str, str]] = [("mixserve", "float32")]
    plan += [] if args.skip_bf16 else [("mixserve", "bfloat16")]
    plan += [] if args.skip_hf else [("hf", "float32")]
    plan += [("vllm", d) for d in ("float32", "bfloat16")] if args.vllm else []
    plan = plan * max(1, args.rounds)
    rows: list[dict[str, Any]] = []
    for i, (system, dtype) in enumerate(plan, 1):
        print(f"[{i}/{len(plan)}] {system} {dtype} ...", flush=True)
        start = time.perf_counter()
        try:
            if system == "vllm":
                work = args.vllm_work or str(Path(args.vllm).absolute().parents[2])  # WORK/vllm/bin/python
                rows.append(run_vllm(args.vllm, work, dtype, args.timeout))
            else:
                rows.append(run_ours(system, dtype, argv, args.timeout))
            rows[-1]["round"] = (i - 1) * args.rounds // len(plan) + 1 if args.rounds > 1 else 1
        except (subprocess.SubprocessError, OSError, ValueError, IndexError) as e:
            print(f"[{i}/{len(plan)}] {system} {dtype} failed: {e}", file=sys.stderr)
            continue
        print(f"[{i}/{len(plan)}] {system} {dtype}: {rows[-1]['output_tokens'] / rows[-1]['wall_s']:.1f} "
              f"output tok/s ({time.perf_counter() - start:.0f} s with loading)", flush=True)
    for r in rows:  # every run's rate in the JSON, not only the median runs'
        r["output_tok_per_s"] = r["output_tokens"] / r["wall_s"]
    lines, ratios = table(median_runs(rows), fast_bf16)
    if args.rounds > 1:
        ratios["rounds"] = []
        for k in range(1, args.rounds + 1):
            _, each = table([dict(r) for r in rows if r["round"] == k], fast_bf16)
            ratios["rounds"].append(each)
            lines.append(f"round {k}: " + ", ".join(f"{name} {v:.2f}" for name, v in each.items() if v))
    for dtype in ("float32", "bfloat16"):
        same = same_tokens(rows, dtype)
        if same is not None:
            ratios[f"same_greedy_tokens_{dtype}"] = same
            lines.append(f"mixserve {dtype} greedy tokens equal to HF fp32's: {same}/{args.num_requests} "
                         "requests")
    print("\n".join(lines))
    report = {"settings": {**vars(args), "load_average": os.getloadavg()},
              "floors": {"float32": dataclasses.asdict(floor32), "bfloat16": dataclasses.asdict(floor16)},
              "fast_bf16": fast_bf16, "targets": {"mixserve_fp32_vs_hf": TARGET_FP32_VS_HF,
                                                  "mixserve_bf16_vs_fp32": TARGET_BF16_VS_FP32},
              "ratios": ratios, "rows": [{k: v for k, v in r.items() if k != "tokens"} for r in rows]}
    write_report(args.out, report)
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
