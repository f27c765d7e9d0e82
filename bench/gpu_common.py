"""What the GPU bench's sections share (bench/gpu_bench.py runs them): shapes, the result rows, the guard,
the run's state, and the attention note each row carries."""

from __future__ import annotations

import contextlib
import sys
import time
import traceback
import types
from pathlib import Path

import torch

START = time.monotonic()

# Llama-3.2-1B shape (random weights; no rope scaling, which does not change the cost).
LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=8192,
                rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=8192,
            rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)

# Step 4, kept here so the comparison can be rerun as it was.
E2E_GPU = dict(num_requests=64, prompt_len=512, output_len=128)
E2E_TINY = dict(num_requests=4, prompt_len=40, output_len=6)
# A budget of 8,192 tokens packs 16 whole 512-token prompts into one step: 4 prefill steps instead of 16,
# so the per-step cost of eager mixed steps (launches, block-mask building) is paid 4 times, not 16.
OUR_ENGINE = dict(max_num_seqs=64, max_batch_tokens=8192, prefill_chunk=512, block_size=16)
HF_GENERATION = dict(do_sample=False)  # plus max_new_tokens = output_len
HF_CB_CONFIGS = {"defaults": {}, "cuda_graph": {"use_cuda_graph": True}}

BLOCK_SIZE = 16
ROWS: list[tuple[str, str, str, str]] = []  # (what, measured, reference, note)
ROWS_FILE: Path | None = None  # --rows-file (main sets it): each row appended as it is measured


class Bench:
    """Shared state of one run: device, shapes, the model folder, measured ceilings."""

    def __init__(self, tiny: bool, budget_s: float, small: bool = False):
        self.tiny = tiny  # the CPU check: tiny model and tiny workloads
        self.small = small  # tiny model, full workloads, on the GPU: a quick debugging run
        self.budget_s = budget_s
        self.device = torch.device("cpu" if tiny or not torch.cuda.is_available() else "cuda")
        self.dtype = torch.float32 if self.device.type == "cpu" else torch.bfloat16
        self.shape = TINY if tiny or small else LLAMA_1B
        self.e2e = E2E_TINY if tiny else E2E_GPU
        self.copy_gbs: float | None = None
        self.matmul_tflops: float | None = None
        self.model_dir: Path | None = None
        self.hf = None
        self.runner = None
        self.cuda_graphs = True

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - START)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()


def row(what: str, measured: str, reference: str = "", note: str = "") -> None:
    ROWS.append((what, measured, reference, note))
    print(f"  {what}: {measured}  {reference}  {note}", flush=True)
    if ROWS_FILE is not None:
        with ROWS_FILE.open("a", encoding="utf-8") as f:
            f.write(" | ".join((what, measured, reference, note)) + "\n")


def guarded(name: str, bench: Bench, min_left_s: float, fn) -> None:
    """Run one section; an error or a lack of time becomes a table row, never the end of the run."""
    if bench.left() < min_left_s:
        row(name, "skipped", "", f"time guard: {bench.left():.0f} s left < {min_left_s:.0f} s")
        return
    print(f"== {name} ({bench.left():.0f} s left)", flush=True)
    t0 = time.monotonic()
    try:
        fn(bench)
    except Exception as e:  # noqa: BLE001 - one failing section must not lose the others
        traceback.print_exc()
        row(name, "ERROR", "", f"{type(e).__name__}: {' '.join(str(e).split())[:300]}")
    print(f"   ({time.monotonic() - t0:.1f} s)", flush=True)

def shim_jsonschema() -> None:
    """The GPU machine has no jsonschema; mixserve.config imports it at module level (lead/config owner:
    make it lazy). Our options are valid (checked on the CPU machine), so a no-op validator stands in."""
    try:
        import jsonschema  # noqa: F401
    except ImportError:
        stub = types.ModuleType("jsonschema")

        class Draft202012Validator:
            def __init__(self, schema):
                self.schema = schema

            def iter_errors(self, data):
                return iter(())

        stub.Draft202012Validator = Draft202012Validator
        stub.ValidationError = Exception
        sys.modules["jsonschema"] = stub
        print("note: jsonschema missing here; runtime.toml validation skipped (stub)", flush=True)

def attention_note(runner) -> str:
    """The attention backend and its parts (which kernels ran), whether graphs are on."""
    attention = runner.attention
    reason = getattr(attention, "fallback_reason", None)
    graphs = "on" if getattr(runner, "graphs", None) is not None else "off"
    if reason:
        return f"flex FAILED, fell back to per-sequence SDPA: {reason}; graphs {graphs}"
    parts = ""
    if hasattr(attention, "parts"):
        decode, packed = attention.parts(runner.device)
        parts = f" (packed {packed.name}, decode {decode.name})"
    return f"attention={attention.name}{parts}, graphs {graphs}"


@contextlib.contextmanager
def kernels_and_attention(runner, kernels_on: bool, packed: str = "auto"):
    """Run the body with mixserve's Triton kernels on or off (MIXSERVE_TRITON) and, where that or `packed`
    differs from the runner's own, a GpuAttention composed for it (a backend picks its kernels once)."""
    from mixserve import kernels
    from mixserve.model.attention.gpu import GpuAttention

    before, own = kernels.enabled(), runner.attention
    kernels.set_enabled(kernels_on)
    try:
        if (not kernels_on or packed != "auto") and isinstance(own, GpuAttention):
            runner.attention = GpuAttention(packed_kernel=packed)
            runner.attention.configure(runner.config.num_heads, runner.config.num_kv_heads, runner.device)
        yield runner.attention
    finally:
        kernels.set_enabled(before)
        runner.attention = own


def time_steps(bench: Bench, run, reps: int) -> float:
    """Seconds per call of run() after 3 warm-up calls (captures, compiles)."""
    for _ in range(3):
        run()
    bench.sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        run()
    return (time.perf_counter() - t0) / reps


def print_table() -> None:
    headers = ("what", "measured", "reference / floor", "note")
    widths = [max(len(h), *(len(r[i]) for r in ROWS)) for i, h in enumerate(headers)]
    widths[3] = min(widths[3], 90)
    line = " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))
    print("\n" + line)
    print("-+-".join("-" * w for w in widths))
    for r in ROWS:
        print(" | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
    print(f"\ntotal {time.monotonic() - START:.0f} s; torch {torch.__version__}, "
          f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}", flush=True)
