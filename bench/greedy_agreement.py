"""Greedy agreement of one setting with float32 `none` on the default model (or --model): per prompt, the
tokens before the first difference.

Not a test. Run: .venv/bin/python bench/greedy_agreement.py --quantization auto --dtype bfloat16
8 chat prompts x 64 greedy tokens (ignore_eos), each setting in the same process; prints the common-prefix
tokens of all prompts and how many prompts came out identical; then, fed `none`'s tokens, the positions
where both rank the same token first and the mean KL divergence from `none`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402

from mixserve import LLM, SamplingParams  # noqa: E402
from mixserve.core.batch import ForwardBatch, ForwardSeq  # noqa: E402

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
           "Explain photosynthesis briefly.", "List three uses of Python.", "Who wrote Hamlet?",
           "Describe a cat in one paragraph.", "How do airplanes fly?", "Give me a recipe for pancakes."]


def greedy(model: str | None, tokens: int, **settings: object
           ) -> tuple[LLM, list[list[int]], list[list[int]]]:
    """The LLM, its prompts and its greedy tokens."""
    llm = LLM(model, num_blocks=512, block_size=16, device="cpu", enable_prefix_caching=False, **settings)
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": t}]) for t in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    return llm, prompts, [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def teacher_forced(llm: LLM, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Log-probabilities after the prompt (one prefill) and after each of `tokens` (decode steps)."""
    runner, table, seq, rows = llm.engine.runner, list(range(32)), list(prompt), []
    with torch.no_grad():
        rows.append(runner.forward(ForwardBatch([ForwardSeq("t", seq, 0, table)]))[0].float())
        for t in tokens[:-1]:
            seq.append(t)
            rows.append(runner.forward(ForwardBatch([ForwardSeq("t", [t], len(seq) - 1, table)]))[0].float())
    return torch.log_softmax(torch.stack(rows), dim=-1)


def forced_agreement(got: LLM, want: LLM, prompts: list[list[int]], tokens: list[list[int]]) -> str:
    """Fed `want`'s greedy tokens: the positions where both rank the same token first, and the mean KL."""
    top1, kl, count = 0, 0.0, 0
    for prompt, toks in zip(prompts, tokens, strict=True):
        g, w = teacher_forced(got, prompt, toks), teacher_forced(want, prompt, toks)
        top1 += int((g.argmax(-1) == w.argmax(-1)).sum())
        kl += float((w.exp() * (w - g)).sum(-1).sum())
        count += len(toks)
    return f"teacher-forced on its tokens: top-1 equal at {top1}/{count} positions, mean KL {kl / count:.2e}"


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a GGUF file or HF folder (default: the default model)")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--int8-activations", action="store_true", help="[engine] int8_activations on")
    args = ap.parse_args()
    ref, prompts, want = greedy(args.model, args.tokens, quantization="none", dtype="float32")
    llm, _, got = greedy(args.model, args.tokens, quantization=args.quantization, dtype=args.dtype,
                         int8_activations=args.int8_activations)
    same = [common_prefix(g, w) for g, w in zip(got, want, strict=True)]
    total, identical = sum(len(w) for w in want), sum(s == len(w) for s, w in zip(same, want, strict=True))
    print(f"quantization={args.quantization} dtype={args.dtype} int8_activations={args.int8_activations} "
          f"against none float32: {sum(same)}/{total} tokens before the first difference, "
          f"{identical}/{len(want)} prompts identical; " + forced_agreement(llm, ref, prompts, want))


if __name__ == "__main__":
    main()
