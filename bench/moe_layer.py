"""One MoE layer's forward and its parts at a step's token counts, with the page faults each forward takes.

Run: .venv/bin/python bench/moe_layer.py [--tokens 1,32,512] [--dtype float32] [--heap kept|defaults]
[--models-dir DIR]. The layer is layer 1 of a 2-layer random Qwen3-MoE at bench/families.py's 1.5B shape
(hidden 1024, 64 experts of width 256, top-8), written once under --models-dir. Per token count: the median
of the forward, of its parts where the experts' C++ path runs (route, dispatch, experts, combine) and the
minor page faults a forward takes. `--heap defaults` leaves glibc's thresholds as they are
(docs/decisions/keep-freed-memory.md); prints the CPU flags first.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402

from bench.families import hf_config, write_checkpoint  # noqa: E402
from bench.floors import cpu_flags, kernels_line  # noqa: E402


def timed(f: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(median seconds, median minor page faults) of `repeats` calls of f after two warm-up calls."""
    f(), f()
    times, faults = [], []
    for _ in range(repeats):
        before, start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return statistics.median(times), statistics.median(faults)


def parts_ms(mlp: Any, ops: Any, x: torch.Tensor, repeats: int) -> list[str]:
    """Median ms of the C++ path's parts on x: route, dispatch, the experts, combine."""
    from mixserve.model.moe import route

    def routed() -> tuple[torch.Tensor, torch.Tensor]:
        return route(ops.linear(x, mlp.packed.router, None), mlp.top_k, mlp.renormalise, mlp.weights_dtype)

    w, e = routed()
    rows, starts, order = mlp.native.dispatch(x, e)
    out = torch.empty_like(rows)
    steps = [routed, partial(mlp.native.dispatch, x, e), partial(mlp.native.run, rows, starts, out),
             partial(mlp.native.combine, out, w, order)]
    return [f"{timed(f, repeats)[0] * 1e3:.2f}" for f in steps]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1,32,512")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--heap", default="kept", choices=["kept", "defaults"])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--models-dir", type=Path, default=Path.home() / "peers-work" / "models")
    args = ap.parse_args()
    print(f"cpu: {cpu_flags()}; kernels {kernels_line()}; threads {torch.get_num_threads()}; "
          f"heap {args.heap}")
    folder = args.models_dir / "qwen3-moe-1.5b-random-2l"
    write_checkpoint(hf_config("qwen3_moe", 2), folder)
    from mixserve import ModelRunner
    from mixserve.runner import model_runner

    if args.heap == "defaults":
        model_runner.keep_freed_memory = lambda: False  # type: ignore[assignment]
    runner = ModelRunner.from_pretrained(str(folder), num_blocks=16, block_size=16, dtype=args.dtype,
                                         device="cpu")
    model = runner.model
    mlp, ops = model.layers[1].mlp, model.ops
    print("| tokens | forward ms | faults | route | dispatch | experts | combine |")
    print("|---|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for t in (int(s) for s in args.tokens.split(",")):
        x = (3 * torch.randn(t, model.config.hidden_size, generator=g)).to(model.dtype)
        with torch.inference_mode():
            forward, faults = timed(partial(mlp.forward, x, ops), args.repeats)
            parts = parts_ms(mlp, ops, x, args.repeats) if mlp.native is not None else ["-"] * 4
        print(f"| {t} | {forward * 1e3:.2f} | {faults:.0f} | " + " | ".join(parts) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
