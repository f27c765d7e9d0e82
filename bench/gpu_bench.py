#!/usr/bin/env python3
"""GPU bench (issue 6): mixserve against HF transformers and the H200's floors, in one run of < 5 minutes.

Random weights of the Llama-3.2-1B shape (bf16) are written to a temporary HF folder with a word-level
tokenizer, then:
  1. correctness: our logits vs HF forward, chunk sizes 1, 7, 64 in mixed batches (a decoding sequence
     beside prefill chunks; chunk 1 is decode-only and runs from CUDA graphs);
  2. decode step time at batch 1/16/64/256 with 512 tokens of context vs (weights + KV read) / copy bandwidth,
     and at batch 1 and 64 the same step with the Triton kernels off (graphs of the eager ops, and no graphs);
  3. prefill throughput at chunk 512 and 2048 vs the measured bf16 matmul rate (512 also kernels off), and
     one step of 16 whole 512-token prompts (the prefill step of section 4);
  4. end to end: 64 x (512 in, 128 out, ignore_eos) through LLM.generate vs HF `generate_batch`
     (defaults, and ContinuousBatchingConfig(use_cuda_graph=True)); the better HF figure is the reference.
Each section is guarded (an error prints and the run goes on) and a global time guard skips what would
not fit. One table is printed last.

    python3 bench/gpu_bench.py            # on the GPU machine
    python3 bench/gpu_bench.py --tiny     # a tiny model on the CPU: checks the script itself
    python3 bench/gpu_bench.py --small    # the tiny model on the GPU, full workloads (debugging)

The Triton kernels (mixserve/kernels: fused norms, RoPE, SwiGLU, store_kv, paged decode attention) came
after the last run and have not run on a GPU yet; the "triton kernels" row says whether they are on (a
failed start-up self-check turns them off and says why).

Last run, before the kernels (2026-11-30, H200, torch 2.11, commit abb39dd;
  copy 4,247 GB/s, bf16 matmul 780 TFLOP/s):
  correctness, max rel err vs HF bf16: 0.060 (chunks 1, 7, 64; judged since against HF fp32)
  decode ms/step (graph), ctx 512: b1 2.74 (4.7x floor), b16 3.94, b64 6.52 (7.8x), b256 16.1 (10.1x);
    b64 eager 18.4; a compiled "fused" decode attention was slower (b64 10.4) and is gone
  prefill tok/s: chunk 512 22,276 (6% of matmul), chunk 2048 47,374 (13%): launch-bound eager steps
  end to end 64 x (512 in, 128 out): 4,036 output tok/s (HF generate_batch not measured in that run)
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import os
import signal
import sys
import tempfile
import time
import traceback
import types
from pathlib import Path

import torch

# Run as `python3 bench/gpu_bench.py` from the repository root: mixserve is imported from this checkout.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

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
ROWS_FILE: Path | None = None  # --rows-file: each row appended as it is measured (survives a kill)


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


# ---- setup -----------------------------------------------------------------------------------------

def write_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level tokenizer with one token per id ("t123"), so any sampled id detokenizes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2",
                                   pad_token="t0")
    fast.save_pretrained(str(path))


def setup_model(bench: Bench) -> None:
    """Random weights in HF's LlamaForCausalLM, saved as a folder our loader reads; HF model kept."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(**bench.shape, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    try:
        cfg._attn_implementation = "sdpa"
    except Exception:  # noqa: BLE001 - a read-only attribute in some versions: their default is sdpa anyway
        pass
    with torch.device(bench.device):
        hf = LlamaForCausalLM(cfg).to(bench.dtype).eval()
    path = Path(tempfile.mkdtemp(prefix="gpu_bench_llama_"))
    hf.save_pretrained(str(path))
    write_tokenizer(path, cfg.vocab_size)
    bench.model_dir, bench.hf = path, hf
    params = sum(p.numel() for p in hf.parameters())
    row("model", f"{params / 1e9:.3f} B params", "", f"{path} ({bench.dtype}, {bench.device})")


def measure_ceilings(bench: Bench) -> None:
    """Device copy bandwidth (bytes read + written) and the bf16 matmul rate, measured here."""
    n = (1 << 30) if bench.device.type == "cuda" else (1 << 26)
    src = torch.empty(n // 2, dtype=torch.bfloat16, device=bench.device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    bench.sync()
    reps = 20 if bench.device.type == "cuda" else 3
    t0 = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    bench.sync()
    bench.copy_gbs = 2 * n * reps / (time.perf_counter() - t0) / 1e9
    del src, dst
    m = 8192 if bench.device.type == "cuda" else 512
    a = torch.randn(m, m, dtype=torch.bfloat16, device=bench.device)
    b = torch.randn(m, m, dtype=torch.bfloat16, device=bench.device)
    a @ b
    bench.sync()
    reps = 20 if bench.device.type == "cuda" else 2
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    bench.sync()
    bench.matmul_tflops = 2 * m ** 3 * reps / (time.perf_counter() - t0) / 1e12
    row("device copy", f"{bench.copy_gbs:,.0f} GB/s", "PERF.md: 4,168 GB/s")
    row(f"bf16 matmul {m}^3", f"{bench.matmul_tflops:,.0f} TFLOP/s", "PERF.md: 778 TFLOP/s")


def load_runner(bench: Bench) -> None:
    from mixserve.runner.model_runner import ModelRunner

    t0 = time.monotonic()
    num_blocks = 256 * 34 + 64 if not bench.tiny else 512
    bench.runner = runner = ModelRunner.from_pretrained(
        str(bench.model_dir), num_blocks=num_blocks, block_size=BLOCK_SIZE, device=str(bench.device),
        dtype=bench.dtype, attention_backend="flex" if bench.tiny else "auto",  # tiny: eager flex on the CPU
        cuda_graphs=bench.cuda_graphs)
    note = ""
    if not hasattr(runner, "graphs") and bench.device.type == "cuda" and bench.cuda_graphs:
        attach_graphs(runner)
        note = " (attached by the bench: this runner has no graph support)"
    graphs = getattr(runner, "graphs", None)
    row("runner", f"loaded in {time.monotonic() - t0:.1f} s",
        "", f"attention={runner.attention.name}, cuda graphs={'on' if graphs is not None else 'off'}{note}")


def attach_graphs(runner) -> None:
    """Decode graphs around a runner without them; the bench never hands out the last block (scratch)."""
    from mixserve.runner.cuda_graph import DecodeGraphs, decode_model_fn

    runner.graphs = DecodeGraphs(decode_model_fn(runner.model, runner.kv_cache.layers), block_size=BLOCK_SIZE,
                                 max_num_seqs=256, scratch_block=runner.num_blocks - 1, device=runner.device)
    eager = runner.forward

    def forward(batch):
        graphs = runner.graphs
        if graphs is not None and graphs.key(batch) is not None:
            return graphs.run(batch)
        return eager(batch)

    runner.forward = forward


def attention_note(runner) -> str:
    reason = getattr(runner.attention, "fallback_reason", None)
    graphs = "on" if getattr(runner, "graphs", None) is not None else "off"
    if reason:
        return f"flex FAILED, fell back to torch_ref: {reason}; graphs {graphs}"
    attention = runner.attention
    kernels = ""
    if hasattr(attention, "packed_kernel_for"):
        probe = torch.empty(0, device=runner.device)
        packed, decode = attention.packed_kernel_for(probe), attention.decode_kernel_for(probe)
        kernels = f" (packed {packed}, decode {decode})"
    return f"attention={attention.name}{kernels}, graphs {graphs}"


# ---- 1. correctness --------------------------------------------------------------------------------

def correctness(bench: Bench) -> None:
    from mixserve.core import ForwardBatch, ForwardSeq

    runner, hf = bench.runner, bench.hf
    vocab = bench.shape["vocab_size"]
    lengths = [120, 97, 61, 33] if not bench.tiny else [30, 21, 13, 7]
    gen = torch.Generator().manual_seed(1)
    tokens = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]
    # The fp32 forward is the truth; HF's own bf16 forward shows how far bf16 alone moves the logits.
    hf32 = copy.deepcopy(hf).float()
    with torch.inference_mode():
        ref = [hf32(torch.tensor([t], device=bench.device)).logits[0].float() for t in tokens]
        ref16 = [hf(torch.tensor([t], device=bench.device)).logits[0].float() for t in tokens]
    del hf32
    bench.sync()  # an HF failure shows here, not inside our steps
    hf_err = max(float((ref16[i][p] - ref[i][p]).norm() / ref[i][p].norm())
                 for i, n in enumerate(lengths) for p in range(n))
    blocks_per_seq = -(-max(lengths) // BLOCK_SIZE)
    # Scattered block tables (every 4th block) so the paging is exercised.
    tables = [[i + 4 * j for j in range(blocks_per_seq)] for i in range(len(lengths))]
    for chunk in (1, 7, 64):
        done = [0] * len(lengths)
        errs, agree, rows, step = [], 0, 0, 0
        while any(d < n for d, n in zip(done, lengths, strict=True)):
            step += 1
            seqs, spans = [], []
            for i, (d, n) in enumerate(zip(done, lengths, strict=True)):
                if d >= n:
                    continue
                # Sequence 0 prefills 5 tokens, then decodes one token a step beside the others' chunks.
                take = (5 if d == 0 else 1) if i == 0 else min(chunk, n - d)
                seqs.append(ForwardSeq(f"s{i}", tokens[i][d:d + take], d, tables[i]))
                spans.append((i, d + take - 1))
                done[i] = d + take
            batch = ForwardBatch(seqs)
            try:
                logits = runner.forward(batch).float()
                bench.sync()
            except Exception as e:
                graphs = getattr(runner, "graphs", None)
                key = graphs.key(batch) if graphs is not None else None
                where = f"chunk {chunk} step {step}: (len, start) {[(len(s.tokens), s.start) for s in seqs]}"
                raise RuntimeError(f"{where}, graph key {key}: {type(e).__name__}: {e}") from e
            for r, (i, pos) in enumerate(spans):
                want = ref[i][pos]
                errs.append(float((logits[r] - want).norm() / want.norm()))
                agree += int(logits[r].argmax() == want.argmax())
                rows += 1
        worst = max(errs)
        ok = worst <= 1.5 * hf_err + 0.005  # within bf16's own reach: HF bf16 vs fp32, with a margin
        row(f"correctness chunk {chunk}", f"max rel err {worst:.4f}, mean {sum(errs) / len(errs):.4f}",
            f"HF bf16 vs fp32: max {hf_err:.4f}",
            f"{'PASS' if ok else 'FAIL'} (<= 1.5x HF's + 0.005); argmax = fp32's in {agree}/{rows} rows; "
            f"{attention_note(runner)}")


# ---- 2. decode -------------------------------------------------------------------------------------

def weight_bytes(bench: Bench) -> int:
    return sum(p.numel() * p.element_size() for p in bench.runner.model.parameters())


def decode_batch(size: int, ctx: int):
    """`size` decodes at position ctx (ctx tokens of context already cached), disjoint block tables."""
    from mixserve.core import ForwardBatch, ForwardSeq

    per_seq = -(-(ctx + 1) // BLOCK_SIZE)
    return ForwardBatch([ForwardSeq(f"d{i}", [5 + i], ctx, list(range(i * per_seq, (i + 1) * per_seq)))
                         for i in range(size)])


@contextlib.contextmanager
def triton_kernels(enabled: bool):
    """Run the body with mixserve's Triton kernels on or off (mixserve/kernels: MIXSERVE_TRITON)."""
    from mixserve import kernels

    before = kernels.enabled()
    kernels.set_enabled(enabled)
    try:
        yield
    finally:
        kernels.set_enabled(before)


def kernels_row(bench: Bench) -> None:
    """Whether the fused Triton kernels run here (they need CUDA and triton)."""
    from mixserve import kernels

    probe = torch.empty(0, device=bench.device)
    on = kernels.use_triton(probe)
    version = "missing"
    if kernels.triton_importable():
        import triton

        version = triton.__version__
    reason = getattr(bench.runner, "kernels_off_reason", None)
    note = f"self-check FAILED, turned off: {reason}" if reason else "MIXSERVE_TRITON=0 turns them off"
    row("triton kernels", "on" if on else "off", "", f"triton {version}; {note}")


def time_steps(bench: Bench, run, reps: int) -> float:
    """Seconds per call of run() after 3 warm-up calls (captures, compiles)."""
    for _ in range(3):
        run()
    bench.sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        run()
    return (time.perf_counter() - t0) / reps


def decode(bench: Bench) -> None:
    """Decode steps: CUDA graphs with the Triton kernels (the default), against graphs of the eager ops
    and against no graphs at all, side by side at the same batch."""
    from mixserve.runner.cuda_graph import DecodeGraphs, decode_model_fn

    runner = bench.runner
    ctx = 512 if not bench.tiny else 40
    kv_per_token = runner.kv_bytes_per_token
    wbytes = weight_bytes(bench)
    batches = (1, 16, 64, 256) if not bench.tiny else (1, 4)
    compare = (1, 64) if not bench.tiny else (4,)
    graphs = getattr(runner, "graphs", None)
    eager_ops_graphs = None
    if graphs is not None:
        # Graphs hold what they captured: a second set, captured with the kernels off.
        eager_ops_graphs = DecodeGraphs(decode_model_fn(runner.model, runner.kv_cache.layers),
                                        block_size=BLOCK_SIZE, max_num_seqs=graphs.ladder[-1],
                                        scratch_block=graphs.scratch_block, device=bench.device)
    reps = 30 if not bench.tiny else 3
    for b in batches:
        batch = decode_batch(b, ctx)
        modes = [("graph", graphs, True)] if graphs is not None else [("eager", None, True)]
        if b in compare:
            if eager_ops_graphs is not None:
                modes.append(("graph, kernels off", eager_ops_graphs, False))
            modes.append(("eager, kernels off", None, False))
        floor = (wbytes + b * (ctx + 1) * kv_per_token) / (bench.copy_gbs * 1e9)
        for mode, g, kernels_on in modes:
            runner.graphs = g
            try:
                with triton_kernels(kernels_on):
                    # As the engine does: read the sampled tokens back every step.
                    step = time_steps(bench, lambda b=batch: runner.forward(b).argmax(-1).tolist(), reps)
            finally:
                runner.graphs = graphs
            row(f"decode b{b} ctx{ctx} ({mode})", f"{step * 1e3:.3f} ms/step ({b / step:,.0f} tok/s)",
                f"floor {floor * 1e3:.3f} ms", f"{step / floor:.2f}x floor")


def prefill(bench: Bench) -> None:
    """One 4,096-token prompt in chunks of 512 and 2,048 (kernels on, and off at 512), then one step of
    16 whole 512-token prompts: the prefill step of the end-to-end run."""
    from mixserve.core import ForwardBatch, ForwardSeq

    runner, cfg = bench.runner, bench.shape
    prompt = 4096 if not bench.tiny else 256
    # (chunk, Triton kernels on, packed attention kernel): the last two rows take one piece away each.
    chunks = ([(512, True, "auto"), (2048, True, "auto"), (512, True, "flex"), (512, False, "auto")]
              if not bench.tiny else [(32, True, "auto"), (128, True, "auto")])
    table = list(range(-(-prompt // BLOCK_SIZE)))
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(3, cfg["vocab_size"], (prompt,), generator=gen).tolist()
    hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    embed = cfg["vocab_size"] * hidden
    layer_params = sum(p.numel() for p in bench.runner.model.parameters()) - embed

    def flops_of(seq_len: int, num_seqs: int, steps: int) -> float:
        # Matmuls: layers on every token, LM head once per sequence per step, attention QK^T and PV
        # (causal: half the square).
        tokens_in = seq_len * num_seqs
        return (2 * layer_params * tokens_in + 2 * embed * num_seqs * steps
                + 2 * 2 * layers * hidden * num_seqs * seq_len * seq_len / 2)

    def report(name: str, num_tokens: int, elapsed: float, flops: float, note: str) -> None:
        floor = flops / (bench.matmul_tflops * 1e12)
        row(name, f"{num_tokens / elapsed:,.0f} tok/s", f"matmul floor {num_tokens / floor:,.0f} tok/s",
            f"{flops / elapsed / 1e12:,.0f} TFLOP/s = {floor / elapsed:.0%} of measured matmul; {note}")

    attention = runner.attention
    default_packed = getattr(attention, "packed_kernel", None)
    for chunk, kernels_on, packed in chunks:
        def run(chunk: int = chunk) -> None:
            for start in range(0, prompt, chunk):
                batch = ForwardBatch([ForwardSeq("p", tokens[start:start + chunk], start, table)])
                runner.forward(batch).argmax(-1).tolist()

        if default_packed is not None:
            attention.packed_kernel = packed
        try:
            with triton_kernels(kernels_on):
                run()  # compiles stay out of the timed run
                bench.sync()
                t0 = time.perf_counter()
                run()
                elapsed = time.perf_counter() - t0
                note_kernels = attention_note(runner)
        finally:
            if default_packed is not None:
                attention.packed_kernel = default_packed
        flops = flops_of(prompt, 1, prompt // chunk)
        report(f"prefill chunk {chunk} ({prompt} tokens)", prompt, elapsed, flops,
               f"kernels {'on' if kernels_on else 'off'}; {note_kernels}")

    num_seqs, length = (16, 512) if not bench.tiny else (4, 32)
    per_seq = -(-length // BLOCK_SIZE)
    packed = ForwardBatch([ForwardSeq(f"p{i}", tokens[:length], 0,
                                      list(range(i * per_seq, (i + 1) * per_seq))) for i in range(num_seqs)])
    step = time_steps(bench, lambda: runner.forward(packed).argmax(-1).tolist(), 5)
    report(f"prefill step {num_seqs} x {length} (one step)", num_seqs * length, step,
           flops_of(length, num_seqs, 1), attention_note(runner))


# ---- 4. end to end ---------------------------------------------------------------------------------

def e2e_prompts(bench: Bench) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    n, length = bench.e2e["num_requests"], bench.e2e["prompt_len"]
    return [torch.randint(3, bench.shape["vocab_size"], (length,), generator=gen).tolist() for _ in range(n)]


def end_to_end_ours(bench: Bench) -> None:
    shim_jsonschema()  # before any mixserve.engine import: the package imports mixserve.config
    from mixserve.engine.llm import LLM
    from mixserve.engine.sampling_params import SamplingParams

    n, out_len = bench.e2e["num_requests"], bench.e2e["output_len"]
    per_req = -(-(bench.e2e["prompt_len"] + out_len) // BLOCK_SIZE)
    options = dict(OUR_ENGINE, num_blocks=n * per_req + 64, device=str(bench.device),
                   dtype="bfloat16" if bench.dtype == torch.bfloat16 else "float32")
    if bench.tiny:
        options.update(max_batch_tokens=64, prefill_chunk=32, attention_backend="flex")
    t0 = time.monotonic()
    llm = LLM(str(bench.model_dir), **options)
    load_s = time.monotonic() - t0
    params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
    prompts = e2e_prompts(bench)
    t0 = time.monotonic()
    llm.generate(prompts, params, use_tqdm=False)  # warm-up: compiles and graph captures of these shapes
    warm_s = time.monotonic() - t0
    bench.sync()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    produced = sum(len(o.token_ids) for o in outs)
    bench.ours_e2e = produced / elapsed
    row(f"e2e ours {n}x({bench.e2e['prompt_len']} in, {out_len} out)",
        f"{produced / elapsed:,.0f} output tok/s", "target 10,000",
        f"{elapsed:.2f} s, {produced} tokens; load {load_s:.0f} s, warm-up run {warm_s:.1f} s; {OUR_ENGINE}; "
        f"{attention_note(llm.engine.runner)}")
    del llm
    gc.collect()
    if bench.device.type == "cuda":
        torch.cuda.empty_cache()


def end_to_end_hf(bench: Bench, which: str) -> None:
    try:
        _end_to_end_hf(bench, which)
    finally:
        # generate_batch sizes its cache from free memory: hand this run's back before the next one.
        gc.collect()
        if bench.device.type == "cuda":
            torch.cuda.empty_cache()


def _end_to_end_hf(bench: Bench, which: str) -> None:
    from transformers import GenerationConfig

    out_len = bench.e2e["output_len"]
    gen_cfg = GenerationConfig(max_new_tokens=out_len, eos_token_id=2, pad_token_id=0, **HF_GENERATION)
    kwargs = {}
    if HF_CB_CONFIGS[which]:
        from transformers import ContinuousBatchingConfig

        kwargs["continuous_batching_config"] = ContinuousBatchingConfig(**HF_CB_CONFIGS[which])
    prompts = e2e_prompts(bench)
    bench.sync()
    t0 = time.perf_counter()
    # No inference_mode here: generate_batch runs its loop in another thread, outside that mode, and
    # its static tensors made in inference mode would refuse in-place updates there (seen on torch 2.11).
    with torch.no_grad():
        try:
            results = bench.hf.generate_batch(prompts, generation_config=gen_cfg, progress_bar=False,
                                              **kwargs)
        except TypeError:
            if not kwargs:
                raise
            # An older generate_batch without continuous_batching_config: options on the GenerationConfig.
            for key, value in HF_CB_CONFIGS[which].items():
                setattr(gen_cfg, key, value)
            t0 = time.perf_counter()
            results = bench.hf.generate_batch(prompts, generation_config=gen_cfg, progress_bar=False)
    bench.sync()
    elapsed = time.perf_counter() - t0
    produced = sum(len(r.generated_tokens) for r in results.values())
    rate = produced / elapsed
    bench.hf_e2e = max(getattr(bench, "hf_e2e", 0.0), rate)
    row(f"e2e HF generate_batch ({which})", f"{rate:,.0f} output tok/s", "PERF.md: 560 (defaults)",
        f"{elapsed:.2f} s wall incl. its warm-up, {produced} tokens; {HF_CB_CONFIGS[which] or 'defaults'}")


def summary(bench: Bench) -> None:
    ours, hf = getattr(bench, "ours_e2e", None), getattr(bench, "hf_e2e", None)
    if ours and hf:
        row("e2e ours / best HF generate_batch", f"{ours / hf:.1f}x", "target ~18x", "")


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny model on the CPU (checks the script)")
    ap.add_argument("--small", action="store_true", help="tiny model on the GPU, full workloads (debugging)")
    ap.add_argument("--no-hf", action="store_true", help="skip HF generate_batch (step 4's reference)")
    ap.add_argument("--budget-s", type=float, default=float(os.environ.get("GPU_BENCH_BUDGET_S", 285)))
    ap.add_argument("--no-graphs", action="store_true", help="runner without CUDA graphs (debugging)")
    ap.add_argument("--rows-file", type=Path, help="append each result row to this file as it is measured")
    args = ap.parse_args()
    global ROWS_FILE
    ROWS_FILE = args.rows_file
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
