"""Greedy agreement of one setting with float32 `none` on the default model (or --model): per prompt, the
tokens before the first difference.

Not a test. Run: .venv/bin/python bench/greedy_agreement.py --quantization auto --dtype bfloat16
8 chat prompts x 64 greedy tokens (ignore_eos), each setting in the same process; prints the common-prefix
tokens of all prompts and how many prompts came out identical.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from mixserve import LLM, SamplingParams  # noqa: E402

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
           "Explain photosynthesis briefly.", "List three uses of Python.", "Who wrote Hamlet?",
           "Describe a cat in one paragraph.", "How do airplanes fly?", "Give me a recipe for pancakes."]


def greedy(model: str | None, tokens: int, **settings: str) -> list[list[int]]:
    llm = LLM(model, num_blocks=512, block_size=16, device="cpu", enable_prefix_caching=False, **settings)
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": t}]) for t in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a GGUF file or HF folder (default: the default model)")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    want = greedy(args.model, args.tokens, quantization="none", dtype="float32")
    got = greedy(args.model, args.tokens, quantization=args.quantization, dtype=args.dtype)
    same = [common_prefix(g, w) for g, w in zip(got, want, strict=True)]
    total, identical = sum(len(w) for w in want), sum(s == len(w) for s, w in zip(same, want, strict=True))
    print(f"quantization={args.quantization} dtype={args.dtype} against none float32: {sum(same)}/{total} "
          f"tokens before the first difference, {identical}/{len(want)} prompts identical")


if __name__ == "__main__":
    main()
