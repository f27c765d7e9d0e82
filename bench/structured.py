"""The cost of structured output: workload W with 1 in 4 requests under a JSON schema against none, in one
process (one loaded model), rounds interleaved so that a machine that turns slower hurts both alike.

W as bench/offline_run.py builds it (32 random-token prompts of 64..512, 64 greedy output tokens each,
ignore_eos). The schema asks for a list of at least 50 people, so a constrained request also runs to its
64 tokens (cut by max_tokens, "length") and both runs produce the same number of tokens. Prints one line
per run and a table of medians; the grammar's own time per step (fill + apply) is timed around the
engine's calls, a figure the machine's other load moves far less than the wall time.

`flock /tmp/mixserve-bench.lock .venv/bin/python bench/structured.py [engine flags] [--rounds N]`
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from bench.argv import engine_config  # noqa: E402
from bench.offline_run import NUM_REQUESTS, OUTPUT_TOKENS, workload_w  # noqa: E402
from mixserve.config import add_engine_flags  # noqa: E402

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "city": {"type": "string"}}, "required": ["name", "age", "city"]}
SCHEMA = {"type": "object", "properties": {"people": {"type": "array", "items": PERSON, "minItems": 50}},
          "required": ["people"]}
VARIANTS = ("none", "json")


class GrammarClock:
    """Times the engine's grammar calls (masks: the fill; apply: the mask) in seconds."""

    def __init__(self, grammars: Any) -> None:
        self.seconds = 0.0
        self.steps = 0
        fill = grammars.masks

        def timed_fill(rows: Any) -> Any:
            t = time.perf_counter()
            masks = fill(rows)
            self.seconds += time.perf_counter() - t
            if masks is not None:
                self.steps += 1
                apply = masks.apply

                def timed_apply(logits: Any) -> None:
                    t = time.perf_counter()
                    apply(logits)
                    self.seconds += time.perf_counter() - t

                masks.apply = timed_apply
            return masks

        grammars.masks = timed_fill


def run(llm: Any, prompts: list[list[int]], variant: str, output_tokens: int) -> dict[str, Any]:
    from mixserve import SamplingParams
    from mixserve.engine.sampling_params import StructuredOutput
    from mixserve.engine.structured import Grammars

    engine = llm.engine
    engine.grammars = Grammars(engine.tokenizer, engine.vocab_size, engine.eos_token_ids)
    clock = GrammarClock(engine.grammars)
    plain = SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True)
    spec = StructuredOutput("json_schema", json.dumps(SCHEMA))
    constrained = SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True,
                                 structured_output=spec)
    params = [constrained if variant != "none" and i % 4 == 0 else plain for i in range(len(prompts))]
    if variant != "none":  # the compiler and the grammar are built once per engine: not part of the run
        engine.grammars.compile(spec)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    texts = [o.text for o, p in zip(outs, params, strict=True) if p is constrained]
    assert all(t.startswith('{"people": ') for t in texts), texts[:1]  # the grammar held
    return {"variant": variant, "wall_s": wall, "output_tokens": tokens, "output_tok_per_s": tokens / wall,
            "constrained": len(texts), "grammar_s": clock.seconds, "grammar_steps": clock.steps,
            "steps": engine.stats().num_steps}


def summary(runs: list[dict[str, Any]]) -> list[str]:
    """Medians per variant; `vs none` is the median over rounds of json / none of the same round (the
    pairs run back to back, so the machine's slower minutes hit both), and the grammar's time per step
    and share of the wall time."""
    lines = [f"{'variant':>8} {'median wall s':>14} {'tok/s':>7} {'vs none (paired)':>17} "
             f"{'grammar ms/step':>16} {'grammar share':>14}"]
    base = {r["round"]: r["wall_s"] for r in runs if r["variant"] == "none"}
    for variant in VARIANTS:
        mine = [r for r in runs if r["variant"] == variant]
        wall = statistics.median(r["wall_s"] for r in mine)
        paired = statistics.median(r["wall_s"] / base[r["round"]] - 1 for r in mine)
        per_step = statistics.median(r["grammar_s"] / r["steps"] for r in mine) * 1e3
        share = statistics.median(r["grammar_s"] / r["wall_s"] for r in mine)
        lines.append(f"{variant:>8} {wall:14.2f} {mine[0]['output_tokens'] / wall:7.1f} {paired:+17.1%} "
                     f"{per_step:16.3f} {share:14.2%}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    add_engine_flags(parser)
    parser.add_argument("--num-requests", type=int, default=NUM_REQUESTS)
    parser.add_argument("--output-tokens", type=int, default=OUTPUT_TOKENS)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=None, help="write the runs as JSON here")
    args = parser.parse_args(argv)
    cfg = engine_config(args, "structured")
    if cfg is None:
        return 2
    from mixserve.engine.llm import LLM
    from mixserve.engine.llm_engine import LLMEngine

    llm = LLM.from_engine(LLMEngine.from_config(cfg))
    prompts = workload_w(llm.engine.vocab_size, args.num_requests)
    # warm-up: the whole workload once, untimed (the first pass over its shapes costs seconds more)
    run(llm, prompts, "none", args.output_tokens)
    runs = []
    steps_before = llm.engine.stats().num_steps
    for r in range(args.rounds):
        for variant in VARIANTS[r % 2:] + VARIANTS[: r % 2]:  # each variant goes first in turn
            res = run(llm, prompts, variant, args.output_tokens)
            res["steps"], steps_before = res["steps"] - steps_before, res["steps"]
            runs.append({"round": r, **res})
            print(f"round {r} {variant:>12}: {res['wall_s']:6.2f} s, {res['output_tok_per_s']:6.1f} output "
                  f"tok/s, {res['output_tokens']} tokens, grammar {res['grammar_s'] * 1e3:7.1f} ms over "
                  f"{res['grammar_steps']} of {res['steps']} steps", flush=True)
    print("\n" + "\n".join(summary(runs)))
    if args.out:
        Path(args.out).write_text(json.dumps({"settings": vars(args), "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
