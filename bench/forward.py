"""tau(tokens): the time of one forward of T tokens on the default model, ours next to HF transformers'.

Not a test. Run: .venv/bin/python bench/forward.py [--max-tokens 2048] [--repeats 3] [--threads 0]
[--dtype bfloat16] [--no-hf] [--torch-ops] [--no-floors].
First the floors (bench/floors.py) and the CPU fast path's three criteria: one token <= 1.5x (weight bytes /
copy bandwidth); a decode step of 32 sequences at context 512 <= 2.0x its floor, the larger of its memory
floor ((weight bytes + the KV bytes it reads) / copy bandwidth) and its compute floor (its FLOPs / the
few-row linear's rate at its best shape: on an AVX2 CPU 32 rows are compute-bound); 256 tokens at >= 80% of
oneDNN's GEMM rate on the model's shapes. Set MIXSERVE_KERNEL_MARCH=haswell ATEN_CPU_CAPABILITY=avx2
ONEDNN_MAX_CPU_ISA=AVX2 to time the AVX2 code on an AVX-512 CPU (the AVX2 stand-in).
Each T is one prompt of T tokens prefilled whole from position 0 (ours: one ForwardBatch; HF: one
forward with logits_to_keep=1, so both compute the LM head on the last token only). Median of repeats,
the contenders timed in turns. --torch-ops adds our runner on the plain torch ops (F.linear on unpacked
weights: the CPU path before the prepacked oneDNN linears), side by side in this process.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from mixserve.core.batch import ForwardBatch, ForwardSeq
from mixserve.engine.threads import bind_threads, set_threads
from mixserve.model.loader import default_model_path
from mixserve.model.ops import torch_ops
from mixserve.runner.model_runner import ModelRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))
from floors import floors, gemm_rates  # noqa: E402

DECODE_SEQS, DECODE_CONTEXT, GEMM_TOKENS = 32, 512, 256


def medians_ms(fns: dict[str, Callable[[], object]], repeats: int,
               stat: Callable[[list[float]], float] = statistics.median) -> dict[str, float]:
    """Median (or `stat`) ms per contender, timed in turns (one call each per round): on a shared, noisy
    machine the load then falls on all of them alike."""
    for fn in fns.values():
        fn()  # warm-up: first-touch allocations, oneDNN primitive creation
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: 1000 * stat(ts) for name, ts in times.items()}


def decode_flops(cfg, parameters: int, seqs: int, context: int) -> float:
    """FLOPs of one decode step: every weight once per sequence (the LM head too), plus q.k and p.v over its
    context in every layer."""
    return 2.0 * parameters * seqs + 4.0 * seqs * context * cfg.num_heads * cfg.head_dim * cfg.num_layers


def layer_flops(cfg, tokens: int) -> float:
    """FLOPs of the decoder layers' GEMMs for `tokens` rows (attention and the LM head not counted)."""
    q, kv, h, i = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size, \
        cfg.intermediate_size
    return 2.0 * tokens * cfg.num_layers * (h * (q + 2 * kv) + q * h + h * 2 * i + i * h)


def check_floors(runner: ModelRunner, repeats: int) -> None:
    """The three criteria, each measured here (best of `repeats`) against floors measured here."""
    f = floors(runner.config, runner.dtype)
    print("\n".join(f.lines()))
    bw = f.copy_bandwidth_gb_s * 1e9
    per_seq = -(-DECODE_CONTEXT // runner.block_size)
    need = max(DECODE_SEQS * per_seq, -(-GEMM_TOKENS // runner.block_size))
    if need > runner.num_blocks:
        print(f"(criteria skipped: they need {need} KV blocks)")
        return
    one = ForwardBatch([ForwardSeq("one", [1000], 0, [0])])
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(DECODE_SEQS)]
    decode = ForwardBatch([ForwardSeq(f"d{i}", [1000 + i], DECODE_CONTEXT - 1, t)
                           for i, t in enumerate(tables)])
    prefill = ForwardBatch([ForwardSeq("p", list(range(1000, 1000 + GEMM_TOKENS)), 0,
                                       list(range(-(-GEMM_TOKENS // runner.block_size))))])
    ms = medians_ms({"one": lambda: runner.forward(one), "decode": lambda: runner.forward(decode),
                     "prefill": lambda: runner.forward(prefill)}, repeats, min)
    kv_read = DECODE_SEQS * DECODE_CONTEXT * runner.kv_bytes_per_token
    one_floor = 1e3 * f.weight_bytes / bw
    dec_floor = 1e3 * (f.weight_bytes + kv_read) / bw
    dec_what = "memory"
    if f.few_row is not None:
        flops = decode_flops(runner.config, f.parameters, DECODE_SEQS, DECODE_CONTEXT)
        compute_ms = 1e3 * flops / f.few_row.flops_per_s
        if compute_ms > dec_floor:
            dec_floor, dec_what = compute_ms, "compute"
    gemms = f.gemms or gemm_rates(runner.config, torch.float32)  # (no oneDNN bf16 GEMM on an AVX2 CPU)
    gemm_rate = sum(g.flops_per_s for g in gemms) / len(gemms)
    rate = layer_flops(runner.config, GEMM_TOKENS) / (ms["prefill"] / 1e3)
    rows = [("1 token", f"{ms['one']:.1f} ms", f"{ms['one'] / one_floor:.2f}x of {one_floor:.1f} ms", 1.5,
             ms["one"] / one_floor),
            (f"decode {DECODE_SEQS} x ctx {DECODE_CONTEXT}", f"{ms['decode']:.1f} ms",
             f"{ms['decode'] / dec_floor:.2f}x of {dec_floor:.1f} ms ({dec_what})", 2.0,
             ms["decode"] / dec_floor),
            (f"{GEMM_TOKENS} tokens", f"{ms['prefill']:.1f} ms ({rate / 1e9:.0f} GFLOP/s in the layers)",
             f"{rate / gemm_rate:.0%} of {gemm_rate / 1e9:.0f} GFLOP/s", None, rate / gemm_rate)]
    for name, measured, against, limit, value in rows:
        met = value >= 0.8 if limit is None else value <= limit
        target = ">= 80%" if limit is None else f"<= {limit}x"
        print(f"{name:<22} {measured:<36} {against:<32} target {target}: {'met' if met else 'MISSED'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: one per core, bound)")
    ap.add_argument("--no-hf", action="store_true", help="time ours only")
    ap.add_argument("--dtype", default="float32", help="float32 or bfloat16, ours and HF's alike")
    ap.add_argument("--torch-ops", action="store_true",
                    help="also time a second runner on the plain torch ops (F.linear, no prepacking)")
    ap.add_argument("--no-floors", action="store_true", help="skip the floors and the three criteria")
    ap.add_argument("--min", action="store_true",
                    help="report the fastest repeat, not the median (on a busy machine)")
    args = ap.parse_args()
    bind_threads(set_threads(args.threads))  # as the engine runs the model: one thread bound per core

    block_size = 16
    num_blocks = max(args.max_tokens // block_size + 1, DECODE_SEQS * DECODE_CONTEXT // block_size)
    runner = ModelRunner.from_pretrained(None, num_blocks=num_blocks, block_size=block_size, device="cpu",
                                         dtype=args.dtype)
    base = None
    if args.torch_ops:
        base = ModelRunner.from_pretrained(None, num_blocks=num_blocks, block_size=block_size, device="cpu",
                                           dtype=args.dtype)
        base.model.prepare(torch_ops())
    hf = None
    if not args.no_hf:
        from transformers import AutoModelForCausalLM

        path = default_model_path()
        hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=runner.dtype)
        hf.eval()

    if not args.no_floors:
        check_floors(runner, max(args.repeats, 5))
    vocab = runner.config.vocab_size
    table = list(range(num_blocks))
    print(f"model {runner.model_name}  dtype {runner.dtype}  threads {torch.get_num_threads()}  "
          f"ops {runner.ops.name}  cpu {runner.cpu_features}  KV bytes per token {runner.kv_bytes_per_token}")
    print(f"{'T':>6} {'ours ms':>10} {'torch-ops':>10} {'t-ops/ours':>10} {'HF ms':>10} {'HF/ours':>8} "
          f"{'ours tok/s':>11}")
    t = 1
    while t <= args.max_tokens:
        ids = torch.randint(0, vocab, (t,), generator=torch.Generator().manual_seed(t)).tolist()
        batch = ForwardBatch([ForwardSeq("bench", ids, 0, table)])
        reps = args.repeats if t < 512 else max(1, args.repeats - 1)
        fns: dict[str, Callable[[], object]] = {"ours": lambda batch=batch: runner.forward(batch)}
        if base is not None:
            fns["base"] = lambda batch=batch, base=base: base.forward(batch)
        if hf is not None:
            x = torch.tensor([ids])

            def hf_forward(x=x):
                with torch.inference_mode():
                    hf(x, use_cache=False, logits_to_keep=1)

            fns["hf"] = hf_forward
        ms = medians_ms(fns, reps, min if args.min else statistics.median)
        ours, b, theirs = ms["ours"], ms.get("base", float("nan")), ms.get("hf", float("nan"))
        print(f"{t:>6} {ours:>10.1f} {b:>10.1f} {b / ours:>10.2f} {theirs:>10.1f} {theirs / ours:>8.2f} "
              f"{1000 * t / ours:>11.0f}", flush=True)
        t *= 2


if __name__ == "__main__":
    main()
