"""The GPU bench's step sections: 1. correctness against HF, 2. decode steps and 3. prefill steps against
the device's floors, the Triton kernels on and off side by side."""

from __future__ import annotations

import copy
import time

import torch
from gpu_common import BLOCK_SIZE, Bench, attention_note, kernels_and_attention, row, time_steps


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


def decode(bench: Bench) -> None:
    """Decode steps: CUDA graphs with the Triton kernels (the default), against graphs of the eager ops
    and against no graphs at all, side by side at the same batch."""
    from mixserve.model.attention.gpu import GpuAttention
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
        # Graphs hold what they captured: a second set, captured with the kernels off (dense decode).
        off = GpuAttention(decode_kernel="dense", packed_kernel="flex")
        off.configure(runner.config.num_heads, runner.config.num_kv_heads, runner.device)
        eager_ops_graphs = DecodeGraphs(decode_model_fn(runner.model, runner.kv_cache.layers, off), off,
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
                with kernels_and_attention(runner, kernels_on):
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

    for chunk, kernels_on, packed in chunks:
        def run(chunk: int = chunk) -> None:
            for start in range(0, prompt, chunk):
                batch = ForwardBatch([ForwardSeq("p", tokens[start:start + chunk], start, table)])
                runner.forward(batch).argmax(-1).tolist()

        with kernels_and_attention(runner, kernels_on, packed):
            run()  # compiles stay out of the timed run
            bench.sync()
            t0 = time.perf_counter()
            run()
            elapsed = time.perf_counter() - t0
            note_kernels = attention_note(runner)
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
