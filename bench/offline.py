"""Workload W offline: mixserve's LLM.generate against Hugging Face transformers' batched generate.

32 requests, prompt lengths uniform in 64..512 (random.Random(0)), 64 output tokens each, ignore_eos,
greedy, on the default model. HF runs static batches of 8 sorted by length, fp32, in the same process.
Prints output tokens/s of both and the ratio. `make bench-offline`; `--dtype bfloat16` for our bf16.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from mixserve.config import ConfigError, add_engine_flags, config_from_args  # noqa: E402

NUM_REQUESTS, MIN_LEN, MAX_LEN, OUTPUT_TOKENS, HF_BATCH = 32, 64, 512, 64, 8


def workload_w(vocab_size: int) -> list[list[int]]:
    """The prompts of workload W: random token ids (no special tokens), lengths uniform in 64..512."""
    rng = random.Random(0)
    lengths = [rng.randint(MIN_LEN, MAX_LEN) for _ in range(NUM_REQUESTS)]
    return [[rng.randrange(100, vocab_size - 100) for _ in range(n)] for n in lengths]


def load_mixserve(cfg):
    from mixserve.engine.llm import LLM
    from mixserve.engine.llm_engine import LLMEngine

    return LLM.from_engine(LLMEngine.from_config(cfg))


def run_mixserve(llm, prompts: list[list[int]]) -> tuple[float, float, list[list[int]]]:
    """Wall and CPU seconds for LLM.generate of the whole workload (after a short warm-up), the tokens."""
    from mixserve import SamplingParams

    params = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0.0, ignore_eos=True)
    llm.generate([prompts[0][:64]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    start, cpu = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    assert all(len(o.token_ids) == OUTPUT_TOKENS for o in outs)
    return elapsed, cpu, [o.token_ids for o in outs]


def run_hf(prompts: list[list[int]], threads: int) -> tuple[float, float, list[list[int]]]:
    """Wall and CPU seconds for HF generate, static batches of 8 sorted by length (left padded), fp32."""
    import torch
    from transformers import AutoModelForCausalLM

    from mixserve.model.loader import default_model_path

    if threads:
        torch.set_num_threads(threads)
    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model.eval()
    pad = 0
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    outputs: list[list[int]] = [[] for _ in prompts]

    def batch_generate(idx: list[int], new_tokens: int) -> torch.Tensor:
        width = max(len(prompts[i]) for i in idx)
        ids = torch.tensor([[pad] * (width - len(prompts[i])) + prompts[i] for i in idx])
        mask = torch.tensor([[0] * (width - len(prompts[i])) + [1] * len(prompts[i]) for i in idx])
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad)
        return out[:, width:]

    batch_generate(order[:1], 4)  # warm-up
    start, cpu = time.perf_counter(), time.process_time()
    for b in range(0, len(order), HF_BATCH):
        idx = order[b : b + HF_BATCH]
        for i, row in zip(idx, batch_generate(idx, OUTPUT_TOKENS).tolist(), strict=True):
            outputs[i] = row
    return time.perf_counter() - start, time.process_time() - cpu, outputs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_flags(parser)
    parser.add_argument("--skip-hf", action="store_true", help="only run mixserve")
    args = parser.parse_args(argv)
    try:
        cfg = config_from_args(args).engine
    except ConfigError as e:
        print(f"offline: {e}", file=sys.stderr)
        return 2
    llm = load_mixserve(cfg)
    prompts = workload_w(llm.engine.vocab_size)
    total_out = NUM_REQUESTS * OUTPUT_TOKENS
    print(f"workload W: {NUM_REQUESTS} requests, {sum(map(len, prompts))} prompt tokens, "
          f"{total_out} output tokens, greedy, ignore_eos; engine: prefill_chunk={cfg.prefill_chunk} "
          f"max_batch_tokens={cfg.max_batch_tokens} max_num_seqs={cfg.max_num_seqs} threads={cfg.threads}")
    ours_s, ours_cpu, ours_tokens = run_mixserve(llm, prompts)
    dtype = str(llm.engine.runner.dtype).removeprefix("torch.")
    del llm  # give its memory back before HF loads
    rows = [("mixserve LLM.generate", dtype, ours_s, ours_cpu)]
    hf_tokens = None
    if not args.skip_hf:
        hf_s, hf_cpu, hf_tokens = run_hf(prompts, cfg.threads)
        rows.append(("HF generate, static batches of 8", "float32", hf_s, hf_cpu))
    # CPU seconds too: on a shared machine wall time depends on the neighbours as much as on the code
    print(f"{'system':<34} {'dtype':<9} {'wall s':>8} {'cpu s':>8} {'output tok/s':>13}")
    for name, dt, secs, cpu in rows:
        print(f"{name:<34} {dt:<9} {secs:>8.1f} {cpu:>8.1f} {total_out / secs:>13.1f}")
    if hf_tokens is not None:
        wall, cpu = rows[1][2] / rows[0][2], rows[1][3] / rows[0][3]
        print(f"ratio mixserve/HF: {wall:.2f}x (wall), {cpu:.2f}x (cpu)")
        same = sum(a == b for a, b in zip(ours_tokens, hf_tokens, strict=True))
        print(f"requests with identical greedy tokens: {same}/{NUM_REQUESTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
