"""Is a kernel change faster? Two builds of the CPU kernel library on one model runner, in one process.

Not a test. Run: .venv/bin/python bench/kernel_ab.py --old REV [--new PATH] [--model FILE] [--mode auto]
[--rows 1] [--rounds 30]. On a noisy machine two processes minutes apart differ by more than most kernel
changes (up to 1.3x here), so both libraries are loaded into one process and rounds of 10 steps alternate
between them, ABBA, on the same runner and weights. REV: a git revision whose kernels are built from a
worktree of it (or a built .so); --new defaults to this checkout's build. --rows 1: one-token decode steps
(the C++ layer stack); --rows R > 1: the model's own layer linears alone, R input rows, ms per 120 calls.
The libraries' C ABI must match (SIGNATURES in mixserve/model/cpu/build.py). A mode as bench/quant.py's
(auto, auto-i8a, auto-bf16, none ...). Prints the CPU's flags and both libraries' names.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quant  # noqa: E402  (bench/quant.py: load, prefill, decode_round)

from mixserve.engine.threads import bind_threads, set_threads  # noqa: E402
from mixserve.model.cpu import build, decode_layers, few_row_linear, layer_ops  # noqa: E402
from mixserve.model.cpu import quant_linear as ql  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
USERS = (build, decode_layers, few_row_linear, layer_ops, ql)  # the modules that call load_library()


def built_at(rev: str) -> Path:
    """The kernel library built from revision `rev` (a worktree of it, removed after), or `rev` if a file."""
    if Path(rev).is_file():
        return Path(rev)
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(
            ["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(tree), rev], check=True
        )
        try:
            code = "from mixserve.model.cpu import build; build.load_library(); print(build.library_path())"
            done = subprocess.run(
                [sys.executable, "-c", code], cwd=tree, capture_output=True, text=True, check=True
            )
            return Path(done.stdout.strip().splitlines()[-1])
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=False)


def open_library(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    for name, argtypes in build.SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return lib


def use(lib: ctypes.CDLL) -> None:
    for module in USERS:
        module.load_library = lambda lib=lib: lib  # type: ignore[attr-defined]


def layer_linears_seconds(runner: object, rows: int, lib: ctypes.CDLL) -> float:
    """Seconds of one pass over every layer linear of the model (its QuantWeights) with `rows` input rows."""
    use(lib)
    weights = [
        w
        for layer in runner.model.layers  # type: ignore[attr-defined]
        for w in (layer.qkv, layer.o_proj, layer.mlp.gate_up, layer.mlp.down)
        if isinstance(w, ql.QuantWeight)
    ]
    xs = {w.k: torch.randn(rows, w.k) for w in weights}
    t0 = time.perf_counter()
    for w in weights:
        ql.linear(xs[w.k], w, None)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True, help="a git revision (or a built .so) to compare against")
    ap.add_argument("--new", default=None, help="a built .so (default: this checkout's kernels)")
    ap.add_argument("--model", default=None, help="a GGUF file (default: the default model)")
    ap.add_argument("--mode", default="auto", help="as bench/quant.py's --modes (one)")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    paths = {"old": built_at(args.old), "new": Path(args.new) if args.new else build.library_path()}
    if not args.new:
        build.load_library()  # built here first if this checkout's kernels are not yet
    print(f"cpu: {quant.cpu_flags()}  threads {set_threads(args.threads)}")
    bind_threads(torch.get_num_threads())
    libs = {k: open_library(p) for k, p in paths.items()}
    for k, p in paths.items():
        print(f"{k}: {p.name}")
    runner = quant.load(
        str(Path(args.model).expanduser()) if args.model else quant.default_model_path(), args.mode, 64
    )
    table = quant.prefill(runner, 64)

    def one_round(k: str) -> float:
        if args.rows > 1:
            return layer_linears_seconds(runner, args.rows, libs[k])
        use(libs[k])
        return statistics.median(quant.decode_round(runner, 64, table, quant.ROUND_STEPS))

    for k in libs:
        one_round(k)
    times: dict[str, list[float]] = {k: [] for k in libs}
    for i in range(args.rounds):
        for k in ("old", "new") if i % 2 == 0 else ("new", "old"):
            times[k].append(one_round(k))
    old, new = (statistics.median(times[k]) for k in ("old", "new"))
    what = "ms a decode step" if args.rows == 1 else f"ms per pass over the layer linears, {args.rows} rows"
    print(
        f"{args.mode}: old {old * 1e3:.2f}  new {new * 1e3:.2f} {what} (medians of {args.rounds} rounds, "
        f"ABBA)  new / old {new / old:.3f}"
    )


if __name__ == "__main__":
    main()
