#!/usr/bin/env python3
"""`mixserve simulate` beside a goodput sweep (`bench sweep --request-rate A,B,C --slo-mode`): each rate's
settings replayed on the cost model the SLO-mode server of that rate wrote on shutdown (start-up profile
plus every step it served), or with --own-fit each setting on its own servers' fits (the median over the
sweep's rounds), goodput measured against simulated. Prints a markdown table.

    .venv/bin/python bench/slo_simulate.py bench/results/slo --own-fit
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mixserve.bench.report import build_report  # noqa: E402
from mixserve.bench.simulate import SimSettings, simulate  # noqa: E402
from mixserve.bench.sweep import Setting  # noqa: E402
from mixserve.bench.workload import DEFAULT_VOCAB_SIZE, workload_m  # noqa: E402
from mixserve.core.cost_model import StepCostModel  # noqa: E402


def specs_of(w: dict) -> list:
    """Workload M as the sweep's report describes it."""
    return workload_m(num_short=w["short_requests"], short_rate=w["short_rate"],
                      short_input=tuple(w["short_prompt_tokens"]), short_output=w["short_output_tokens"],
                      long_input_len=w["long_prompt_tokens"], long_output=w["long_output_tokens"],
                      vocab_size=DEFAULT_VOCAB_SIZE, seed=w["seed"])


def settings_of(row: dict, slo_argv: str) -> SimSettings:
    """The scheduling settings of one sweep row (the SLO mode's from its server flags)."""
    slo = {}
    if row.get("slo_mode"):
        ms = dict(re.findall(r"--slo-(ttft|tpot)-ms (\S+)", row["slo_mode"] or slo_argv))
        slo = {"slo_ttft_ms": float(ms.get("ttft", 0)), "slo_tpot_ms": float(ms.get("tpot", 0))}
    return SimSettings(prefill_chunk=row["prefill_chunk"], max_batch_tokens=row["max_batch_tokens"],
                       tpot_target_ms=row["tpot_target_ms"], **slo)


def slug_of(row: dict) -> str:
    """The sweep's file name for a row's setting."""
    return Setting(row["prefill_chunk"], row["max_batch_tokens"], row["tpot_target_ms"],
                   row.get("slo_mode") or "").slug


def fits(rate_dir: Path, slug: str) -> list:
    """The cost model each run of `slug` wrote: one per round (`{slug}-r1`, ...) when the sweep repeated."""
    return [StepCostModel.load(f).coefficients for f in sorted((rate_dir / "tmp").glob(f"{slug}*.cost.json"))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sweep_dir")
    ap.add_argument("--own-fit", action="store_true",
                    help="replay each setting on the fit its own server wrote, not the SLO-mode server's")
    args = ap.parse_args()
    out = Path(args.sweep_dir)
    print("| rate | setting | goodput measured | simulated | sim / measured |\n|---|---|---|---|---|")
    for rate_dir in sorted(out.glob("rate*"), key=lambda p: float(p.name[4:])):
        sweep = json.loads((rate_dir / "sweep.json").read_text())
        opts = sweep["options"]
        slo_slug = slug_of(next(r for r in sweep["rows"] if r.get("slo_mode")))
        specs = specs_of(sweep["workload"])
        for row in sweep["rows"]:
            if "error" in row:
                continue
            sims = []
            for cost in fits(rate_dir, slug_of(row) if args.own_fit else slo_slug):
                run = simulate(specs, cost, settings_of(row, ""))
                sims.append(build_report(run.results, run.duration_s, slo_ttft=opts["slo_ttft"],
                                         slo_tpot=opts["slo_tpot"])["goodput"])
            sim = statistics.median(sims)
            ratio = f"{sim / row['goodput']:.2f}" if row["goodput"] else "-"
            print(f"| {rate_dir.name[4:]} | {row['setting']} | {row['goodput']:.3f} | {sim:.3f} | {ratio} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
