"""The GPU bench's end-to-end section: LLM.generate against HF generate_batch on the same prompts."""

from __future__ import annotations

import gc
import time

import torch
from gpu_common import (
    BLOCK_SIZE,
    HF_CB_CONFIGS,
    HF_GENERATION,
    OUR_ENGINE,
    Bench,
    attention_note,
    row,
    shim_jsonschema,
)


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
