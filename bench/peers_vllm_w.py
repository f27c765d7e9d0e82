"""Workload W through vLLM-CPU's offline LLM.generate on any HF folder, one JSON line out (bench/families.py).

Run with a vLLM venv's python after sourcing ../shared/peers/vllm_env.sh (setup_vllm.sh makes both):
`peers_vllm_w.py --model DIR [--dtype float32|bfloat16] [--num-requests 32] [--output-tokens 64]`.
The prompts are bench/offline_run.py's (random.Random(0), 32 prompts of 64..512 token ids in 100..vocab-100,
the first N of them), the vocabulary read from DIR/config.json; greedy, ignore_eos, after a short warm-up.
Modelled on ../shared/peers/vllm_w.py (which is fixed to SmolLM2). Imports nothing of mixserve: it runs in
vLLM's venv.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

NUM_REQUESTS, MIN_LEN, MAX_LEN, OUTPUT_TOKENS = 32, 64, 512, 64


def workload_w(vocab_size: int, num_requests: int = NUM_REQUESTS) -> list[list[int]]:
    """bench/offline_run.py's workload_w, copied (that module imports mixserve); a test keeps them equal."""
    rng = random.Random(0)
    lengths = [rng.randint(MIN_LEN, MAX_LEN) for _ in range(NUM_REQUESTS)]
    return [[rng.randrange(100, vocab_size - 100) for _ in range(n)] for n in lengths][:num_requests]


def vocab_size(model: str) -> int:
    raw = json.loads((Path(model) / "config.json").read_text())
    return int(raw.get("text_config", raw)["vocab_size"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="an HF folder (config.json, safetensors, tokenizer)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--num-requests", type=int, default=NUM_REQUESTS)
    ap.add_argument("--output-tokens", type=int, default=OUTPUT_TOKENS)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--skip-tokenizer-init", action="store_true",
                    help="no tokenizer: token ids in and out (for a folder without one)")
    a = ap.parse_args()
    from vllm import LLM, SamplingParams

    prompts = workload_w(vocab_size(a.model), a.num_requests)
    llm = LLM(model=a.model, dtype=a.dtype, max_model_len=a.max_model_len, max_num_seqs=32, seed=0,
              skip_tokenizer_init=a.skip_tokenizer_init)
    detok = not a.skip_tokenizer_init
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, detokenize=detok)
    llm.generate([{"prompt_token_ids": prompts[0][:64]}], warm, use_tqdm=False)
    sp = SamplingParams(temperature=0.0, max_tokens=a.output_tokens, ignore_eos=True, detokenize=detok)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    print(json.dumps(dict(system="vllm", dtype=a.dtype, model=a.model, wall_s=wall, output_tokens=n,
                          prompt_tokens=sum(map(len, prompts)), output_tok_per_s=n / wall)), flush=True)


if __name__ == "__main__":  # vLLM spawns its engine process
    main()
