"""`mixserve simulate` against measured runs: issue 12's check, from a `bench sweep --repeats N` directory.

For each setting of the sweep (or those named): the runs' short TTFT and TPOT p50/p90 and long TTFT p50,
their mean, and the same figures from `mixserve simulate` on the same workload and settings, with the
cost model the runs' servers wrote on shutdown (the mean of their coefficients). A figure is "within"
when simulated/mean is inside 15% (p50s) or 25% (p90s), the issue's bounds. Prints markdown tables.

    .venv/bin/python bench/simulate_check.py bench/results/tpot-target/full-M-5 [--settings slug,slug]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

FIGURES = [  # (label, class, metric, percentile, bound)
    ("short TTFT p50", "short", "ttft_s", "p50", 0.15),
    ("short TTFT p90", "short", "ttft_s", "p90", 0.25),
    ("short TPOT p50", "short", "tpot_s", "p50", 0.15),
    ("short TPOT p90", "short", "tpot_s", "p90", 0.25),
    ("long TTFT p50", "long", "ttft_s", "p50", 0.15),
]
COEFFICIENTS = ("overhead_s", "per_token_s", "per_pair_s", "per_seq_s", "per_mixed_decode_s")


def figure(report: dict, cls: str, metric: str, pct: str) -> float:
    return float(report["classes"][cls][metric][pct])


def mean_cost_model(paths: list[Path], out: Path) -> None:
    """A cost model file whose coefficients are the mean of the runs' (no fit state: it predicts by them)."""
    models = [json.loads(p.read_text()) for p in paths]
    mean = {k: statistics.fmean(float(m.get(k, 0.0)) for m in models) for k in COEFFICIENTS}
    out.write_text(json.dumps({"format": models[0]["format"], **mean, "num_samples": 0}))


def simulate(run: dict, cost: Path, tmp: Path) -> dict:
    """`mixserve simulate` with the run's workload and scheduling settings; its JSON report."""
    s = run["settings"]
    out = tmp / "sim.json"
    cmd = [sys.executable, "-m", "mixserve", "simulate", "--workload", s["workload"],
           "--seed", str(s["seed"]), "--cost-model", str(cost),
           "--max-batch-tokens", str(s["max_batch_tokens"]), "--out", str(out)]
    if s.get("tpot_target_ms"):
        cmd += ["--tpot-target-ms", str(s["tpot_target_ms"])]
    else:
        cmd += ["--prefill-chunk", str(s["prefill_chunk"] if s["policy"] != "WholePrompt" else 0)]
    waiting_share = _flag(s.get("server_argv", []), "--waiting-share")
    if waiting_share is not None:
        cmd += ["--waiting-share", waiting_share]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.read_text())


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv[:-1] else None


def check(sweep_dir: Path, slug: str, tmp: Path) -> str:
    runs_paths = sorted(sweep_dir.glob(f"{slug}-r*.json")) or [sweep_dir / f"{slug}.json"]
    runs = [json.loads(p.read_text()) for p in runs_paths]
    # the servers' cost models: tmp/ as the sweep leaves them, steps/ as a committed result keeps them
    places = (sweep_dir / "tmp", sweep_dir / "steps")
    costs = [c for p in runs_paths for c in (d / f"{p.stem}.cost.json" for d in places) if c.exists()]
    cost = tmp / f"{slug}.cost.json"
    mean_cost_model(costs, cost)
    sim = simulate(runs[0], cost, tmp)
    head = " | ".join(f"run {i + 1} (ms)" for i in range(len(runs)))
    label = runs[0]["settings"]["label"]
    lines = [f"**{label}** ({len(runs)} runs; simulated on the mean of their cost models)",
             "", f"| figure | {head} | mean (ms) | simulated (ms) | sim/mean | within |",
             "|---|" + "---|" * (len(runs) + 4)]
    for name, cls, metric, pct, bound in FIGURES:
        vals = [1e3 * figure(r, cls, metric, pct) for r in runs]
        mean, simulated = statistics.fmean(vals), 1e3 * figure(sim, cls, metric, pct)
        ratio = simulated / mean if mean else float("nan")
        ok = "yes" if abs(ratio - 1) <= bound else "NO"
        cells = " | ".join(f"{v:.0f}" for v in vals)
        lines.append(f"| {name} | {cells} | {mean:.0f} | {simulated:.0f} | {ratio:.2f} | {ok} ({bound:.0%})"
                     " |")
    stalled = ", ".join(str(r["classes"]["short"]["stalled"]) for r in runs)
    lines += ["", f"stalled of 48, runs: {stalled}; simulated: {sim['classes']['short']['stalled']}", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sweep_dir", type=Path)
    ap.add_argument("--settings", default="", help="comma-separated slugs (default: every setting)")
    args = ap.parse_args()
    found = sorted(p.stem.removesuffix("-r1") for p in args.sweep_dir.glob("*-r1.json")) or sorted(
        p.stem for p in args.sweep_dir.glob("*.json") if p.stem != "sweep")
    slugs = [s for s in args.settings.split(",") if s] or found
    with tempfile.TemporaryDirectory() as tmp:
        for slug in slugs:
            print(check(args.sweep_dir, slug, Path(tmp)))


if __name__ == "__main__":
    main()
