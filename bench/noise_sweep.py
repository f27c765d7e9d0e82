"""How often each setting stalls on a machine's measured step-time noise: `mixserve simulate --noise-from`
over many seeds, the issue-12 settings side by side, as one markdown table.

Not a test. Run (seconds, no weights):
    .venv/bin/python bench/noise_sweep.py --run-dir bench/results/tpot-target/full-M-8 [--seeds 20]

--run-dir takes a `bench sweep` output: the noise comes from its target runs' step traces
(tpot*.steps.jsonl in its steps/ folder, as committed, or tmp/, as the sweep leaves them) and the cost model
from its first target run's file (or --cost-model). Each
setting replays workload M (the bench's seed 0) once per noise seed. `--no-margin` also replays the
target as the engine planned it before the spread's margin (core/step_drift.py): side by side, the same
seeds. A real run adds HTTP and between-step time to each gap, which the replay leaves out
(docs/decisions/step-cost-per-sequence.md).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from mixserve.bench.report import build_report  # noqa: E402
from mixserve.bench.simulate import SimSettings, simulate  # noqa: E402
from mixserve.bench.step_noise import StepNoise  # noqa: E402
from mixserve.bench.workload import workload_m  # noqa: E402
from mixserve.core import step_drift  # noqa: E402
from mixserve.core.cost_model import StepCostModel  # noqa: E402

# (label, prefill_chunk, max_batch_tokens, tpot_target_ms): the sweep
SETTINGS = [("WholePrompt, budget 2048", 0, 2048, 0), ("chunk 256, budget 256", 256, 256, 0),
            ("chunk 256, budget 512", 256, 512, 0), ("chunk 256, budget 2048", 256, 2048, 0),
            ("target 400 ms, budget 2048", 256, 2048, 400)]


@contextmanager
def without_margin():
    """The budget as it planned before the spread's margin: the margin never has enough steps."""
    saved = step_drift.SPREAD_MIN_STEPS
    step_drift.SPREAD_MIN_STEPS = 1 << 60
    try:
        yield
    finally:
        step_drift.SPREAD_MIN_STEPS = saved


def replay(settings: SimSettings, cost, noise: StepNoise, seeds: int) -> list[tuple[int, float | None]]:
    """(short requests stalled, long prompts' TTFT p50) per seed."""
    specs = workload_m()
    out = []
    for seed in range(seeds):
        run = simulate(specs, cost, settings, noise, seed)
        classes = build_report(run.results, run.duration_s)["classes"]
        out.append((classes["short"]["stalled"], classes["long"]["ttft_s"]["p50"]))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", required=True, help="a `mixserve bench sweep` output with target runs")
    ap.add_argument("--cost-model", help="the cost model (default: the run dir's first target run's)")
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--targets", default="400", help="comma-separated targets in ms (default 400)")
    ap.add_argument("--no-margin", action="store_true", help="also each target without the margin")
    args = ap.parse_args()
    steps = Path(args.run_dir) / "steps"
    if not steps.is_dir():
        steps = Path(args.run_dir) / "tmp"
    traces = sorted(steps.glob("tpot*.steps.jsonl"))
    costs = sorted(steps.glob("tpot*.cost.json"))
    if not traces or not (costs or args.cost_model):
        print(f"noise_sweep: {steps} has no target run's trace and cost model", file=sys.stderr)
        return 2
    noise = StepNoise.from_traces(traces)
    cost = StepCostModel.load(args.cost_model or costs[0]).coefficients
    print(f"noise: {', '.join(t.name for t in traces)}; {noise.describe()}")
    print(f"cost model: {args.cost_model or costs[0]}; workload M, {args.seeds} noise seeds per setting\n")
    rows = [(label, SimSettings(prefill_chunk=c, max_batch_tokens=b), False)
            for label, c, b, t in SETTINGS if t == 0]
    for t in (float(x) for x in args.targets.split(",")):
        target = SimSettings(prefill_chunk=256, max_batch_tokens=2048, tpot_target_ms=t)
        rows.append((f"target {t:g} ms, budget 2048", target, False))
        if args.no_margin:
            rows.append((f"target {t:g} ms, budget 2048, no margin", target, True))
    print("| setting | seeds stalling none | stalled, median / max | long TTFT p50, median (s) "
          "| long / whole |")
    print("|---|---|---|---|---|")
    whole = None
    for label, settings, bare in rows:
        if bare:
            with without_margin():
                res = replay(settings, cost, noise, args.seeds)
        else:
            res = replay(settings, cost, noise, args.seeds)
        stalled = [s for s, _ in res]
        longs = statistics.median(x for _, x in res if x is not None)
        whole = whole or longs
        print(f"| {label} | {sum(s == 0 for s in stalled)} of {len(res)} | {statistics.median(stalled):g} / "
              f"{max(stalled)} | {longs:.2f} | {longs / whole:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
