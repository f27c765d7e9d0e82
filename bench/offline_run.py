"""One system on workload W, in a process of its own (bench/offline.py starts one per system).

`offline_run.py mixserve [engine flags] --result FILE` or `offline_run.py hf --result FILE`: runs the workload
after a short warm-up and writes {system, dtype, wall_s, cpu_s, output_tokens, tokens} as JSON to FILE.
A process per system so that mixserve's thread binding (and its allocator state) cannot touch HF's run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from bench.argv import engine_config  # noqa: E402
from mixserve.config import add_engine_flags  # noqa: E402

NUM_REQUESTS, MIN_LEN, MAX_LEN, OUTPUT_TOKENS, HF_BATCH = 32, 64, 512, 64, 8


def workload_w(vocab_size: int, num_requests: int = NUM_REQUESTS) -> list[list[int]]:
    """The prompts of workload W: random token ids (no special tokens), lengths uniform in 64..512.

    Always drawn for all 32 requests, so a smaller `num_requests` takes the first prompts of the same W.
    """
    rng = random.Random(0)
    lengths = [rng.randint(MIN_LEN, MAX_LEN) for _ in range(NUM_REQUESTS)]
    return [[rng.randrange(100, vocab_size - 100) for _ in range(n)] for n in lengths][:num_requests]


def run_mixserve(cfg: Any, num_requests: int, output_tokens: int) -> dict[str, Any]:
    """LLM.generate of the whole workload after a short warm-up; wall and CPU seconds, the tokens."""
    from mixserve import SamplingParams
    from mixserve.engine.llm import LLM
    from mixserve.engine.llm_engine import LLMEngine

    llm = LLM.from_engine(LLMEngine.from_config(cfg))
    prompts = workload_w(llm.engine.vocab_size, num_requests)
    params = SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True)
    llm.generate([prompts[0][:64]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    start, cpu = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params)  # its own progress bar, on stderr
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    tokens = [list(o.token_ids) for o in outs]
    return {"system": "mixserve", "dtype": str(llm.engine.runner.dtype).removeprefix("torch."),
            "wall_s": wall, "cpu_s": cpu, "output_tokens": sum(map(len, tokens)), "tokens": tokens,
            "threads": llm.engine.num_threads, "prompt_tokens": sum(map(len, prompts))}


def run_hf(threads: int, num_requests: int, output_tokens: int) -> dict[str, Any]:
    """HF generate, static batches of 8 sorted by length (left padded), fp32; torch threads unbound."""
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from mixserve.model.loader import default_model_path

    hf_logging.disable_progress_bar()  # its GGUF conversion bars would bury ours; that one reads only
    os.environ["TQDM_DISABLE"] = "1"  # tqdm's own default, so our bar below says disable=False
    torch.set_num_threads(threads or len(os.sched_getaffinity(0)))
    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model.eval()
    prompts = workload_w(model.config.vocab_size, num_requests)
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
    for b in tqdm(range(0, len(order), HF_BATCH), desc="HF batches", unit="batch", leave=False,
                  disable=False):
        idx = order[b : b + HF_BATCH]
        for i, row in zip(idx, batch_generate(idx, output_tokens).tolist(), strict=True):
            outputs[i] = row
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {"system": "hf", "dtype": "float32", "wall_s": wall, "cpu_s": cpu,
            "output_tokens": sum(map(len, outputs)), "tokens": outputs, "threads": torch.get_num_threads(),
            "prompt_tokens": sum(map(len, prompts))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("system", choices=["mixserve", "hf"])
    add_engine_flags(parser)
    parser.add_argument("--num-requests", type=int, default=NUM_REQUESTS)
    parser.add_argument("--output-tokens", type=int, default=OUTPUT_TOKENS)
    parser.add_argument("--result", required=True, help="where to write the JSON result")
    args = parser.parse_args(argv)
    cfg = engine_config(args, "offline_run")
    if cfg is None:
        return 2
    if args.system == "mixserve":
        result = run_mixserve(cfg, args.num_requests, args.output_tokens)
    else:
        result = run_hf(cfg.threads, args.num_requests, args.output_tokens)
    Path(args.result).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
