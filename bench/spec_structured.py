"""Does n-gram speculation pay under a JSON schema? Off against `ngram`, one process, rounds interleaved.

Not a test. 8 chat prompts ask the default model for a list of people as JSON, under a schema of at least
30 {name, age, city} objects: the keys and separators repeat, so drafts copy them. Greedy, 160 output tokens
each (EOS ignored until the grammar ends it), sent single stream (one after another) and all 8 at once.
Per setting: output tok/s over the wall time, and drafts accepted per drafted token. The two engines share
one loaded model; each round runs them in turn, each going first in turn.

`flock /tmp/mixserve-bench.lock .venv/bin/python bench/spec_structured.py [--rounds 2] [--out FILE]`
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
sys.path.insert(0, str(Path(__file__).resolve().parent))
from argv import write_report  # noqa: E402
from floors import cpu_flags  # noqa: E402

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "city": {"type": "string"}}, "required": ["name", "age", "city"]}
SCHEMA = {"type": "object", "properties": {"people": {"type": "array", "items": PERSON, "minItems": 30}},
          "required": ["people"]}
TOPICS = ("a chess club", "a hospital ward", "a football team", "a startup", "a choir", "a school class",
          "a book club", "a research lab")
OUTPUT_TOKENS = 160


def prompts(tokenizer: Any) -> list[list[int]]:
    hf = tokenizer.hf
    chats = [[{"role": "user", "content": f"List the members of {t} as JSON: each one's name, age and city."}]
             for t in TOPICS]
    return [hf.encode(hf.apply_chat_template(c, add_generation_prompt=True, tokenize=False),
                      add_special_tokens=False) for c in chats]


def run(llm: Any, ids: list[list[int]], streams: int) -> dict[str, Any]:
    from mixserve import SamplingParams
    from mixserve.engine.sampling_params import StructuredOutput

    params = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0.0,
                            structured_output=StructuredOutput("json_schema", json.dumps(SCHEMA)))
    s0 = llm.engine.stats().scheduler
    start = time.perf_counter()
    outs = []
    for i in range(0, len(ids), streams):
        outs += llm.generate(ids[i : i + streams], params, use_tqdm=False)
    wall = time.perf_counter() - start
    assert all(o.text.startswith('{"people": [') for o in outs), outs[0].text[:80]  # the grammar held
    s1 = llm.engine.stats().scheduler
    drafted = s1.spec_num_draft_tokens - s0.spec_num_draft_tokens
    accepted = s1.spec_num_accepted_tokens - s0.spec_num_accepted_tokens
    tokens = sum(len(o.token_ids) for o in outs)
    return {"tok_per_s": tokens / wall, "tokens": tokens, "drafted": drafted, "accepted": accepted,
            "texts": [o.text for o in outs]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=None, help="write the runs as JSON here")
    args = parser.parse_args(argv)
    print("cpu:", json.dumps(cpu_flags()))
    from mixserve.config import EngineConfig
    from mixserve.engine.llm import LLM
    from mixserve.engine.llm_engine import LLMEngine

    off = LLMEngine.from_config(EngineConfig())
    on = LLMEngine(off.runner, EngineConfig(speculative="ngram"))  # the same loaded model
    llms = {"off": LLM.from_engine(off), "ngram": LLM.from_engine(on)}
    ids = prompts(off.tokenizer)
    for llm in llms.values():  # warm-up: grammar compile and the first pass over the shapes
        run(llm, ids[:2], 2)
    runs: list[dict[str, Any]] = []
    for r in range(args.rounds):
        for streams in (1, len(ids)):
            order = list(llms) if r % 2 == 0 else list(llms)[::-1]
            for name in order:
                res = run(llms[name], ids, streams)
                runs.append({"round": r, "setting": name, "streams": streams, **res})
                rate = f", accepted {res['accepted']}/{res['drafted']}" if res["drafted"] else ""
                print(f"round {r} {streams:>2} stream(s) {name:>5}: {res['tok_per_s']:6.1f} output tok/s, "
                      f"{res['tokens']} tokens{rate}", flush=True)
    same = all(a["texts"] == b["texts"] for a in runs for b in runs if a["streams"] == b["streams"])
    print(f"\noutputs equal with and without speculation: {same}")
    print(f"{'streams':>7} {'off tok/s':>10} {'ngram tok/s':>12} {'ratio':>6}")
    for streams in (1, len(ids)):
        mine = [x for x in runs if x["streams"] == streams]
        med = {n: statistics.median(x["tok_per_s"] for x in mine if x["setting"] == n) for n in llms}
        print(f"{streams:>7} {med['off']:10.1f} {med['ngram']:12.1f} {med['ngram'] / med['off']:5.2f}x")
    if args.out:
        write_report(args.out, {"cpu_flags": cpu_flags(), "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
