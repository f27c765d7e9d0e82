"""Does speculation pay offline, on this CPU? Speculation off, `ngram` and a draft model, one process.

Not a test. Two workloads of 8 chat prompts each, greedy, sent single stream (one after another) and all 8
at once:
- `json`: asks for a list of people as JSON under a schema of at least 30 {name, age, city} objects (160
  output tokens): the keys and separators repeat, so n-gram drafts copy them;
- `chat`: asks for a paragraph on a topic (128 output tokens, EOS ignored): little to copy.

Per setting: output tok/s over the wall time, and drafts accepted per drafted token. The engines share one
loaded model (a draft model is loaded once per engine that uses it); each round runs them in turn, each
going first in turn. `--model` is the target (default: the default model), `--draft` a draft model's path
(adds the `draft` setting).

`flock /tmp/mixserve-bench.lock .venv/bin/python bench/spec_offline.py [--workload json|chat] [--model M]
[--draft PATH] [--rounds 2] [--out FILE]`
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
GROUPS = ("a chess club", "a hospital ward", "a football team", "a startup", "a choir", "a school class",
          "a book club", "a research lab")
TOPICS = ("how tides work", "why the sky is blue", "how a bicycle stays upright", "what a compiler does",
          "how bees make honey", "why bread rises", "how a refrigerator cools", "what causes seasons")
ASK = {"json": ("List the members of {} as JSON: each one's name, age and city.", GROUPS),
       "chat": ("Explain {} in one paragraph.", TOPICS)}
OUTPUT_TOKENS = {"json": 160, "chat": 128}


def prompts(tokenizer: Any, workload: str) -> list[list[int]]:
    hf = tokenizer.hf
    text, subjects = ASK[workload]
    chats = [[{"role": "user", "content": text.format(t)}] for t in subjects]
    return [hf.encode(hf.apply_chat_template(c, add_generation_prompt=True, tokenize=False),
                      add_special_tokens=False) for c in chats]


def params_for(workload: str) -> Any:
    from mixserve import SamplingParams
    from mixserve.engine.sampling_params import StructuredOutput

    if workload == "chat":
        return SamplingParams(max_tokens=OUTPUT_TOKENS["chat"], temperature=0.0, ignore_eos=True)
    return SamplingParams(max_tokens=OUTPUT_TOKENS["json"], temperature=0.0,
                          structured_output=StructuredOutput("json_schema", json.dumps(SCHEMA)))


def run(llm: Any, ids: list[list[int]], streams: int, params: Any) -> dict[str, Any]:
    s0 = llm.engine.stats().scheduler
    start = time.perf_counter()
    outs = []
    for i in range(0, len(ids), streams):
        outs += llm.generate(ids[i : i + streams], params, use_tqdm=False)
    wall = time.perf_counter() - start
    if params.structured_output is not None:
        assert all(o.text.startswith('{"people": [') for o in outs), outs[0].text[:80]  # the grammar held
    s1 = llm.engine.stats().scheduler
    drafted = s1.spec_num_draft_tokens - s0.spec_num_draft_tokens
    accepted = s1.spec_num_accepted_tokens - s0.spec_num_accepted_tokens
    tokens = sum(len(o.token_ids) for o in outs)
    return {"tok_per_s": tokens / wall, "tokens": tokens, "drafted": drafted, "accepted": accepted,
            "texts": [o.text for o in outs]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--workload", choices=tuple(ASK), default="json")
    parser.add_argument("--model", default="", help="the target (default: the default model)")
    parser.add_argument("--draft", default="", help="a draft model's path: adds the `draft` setting")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=None, help="write the runs as JSON here")
    args = parser.parse_args(argv)
    print("cpu:", json.dumps(cpu_flags()))
    from mixserve.config import EngineConfig
    from mixserve.engine.llm import LLM
    from mixserve.engine.llm_engine import LLMEngine

    off = LLMEngine.from_config(EngineConfig(model=args.model))
    settings = {"off": "", "ngram": "ngram"} | ({"draft": args.draft} if args.draft else {})
    llms = {name: LLM.from_engine(LLMEngine(off.runner, EngineConfig(speculative=method)) if method else off)
            for name, method in settings.items()}  # the same loaded target
    ids, params = prompts(off.tokenizer, args.workload), params_for(args.workload)
    for llm in llms.values():  # warm-up: grammar compile and the first pass over the shapes
        run(llm, ids[:2], 2, params)
    runs: list[dict[str, Any]] = []
    for r in range(args.rounds):
        for streams in (1, len(ids)):
            order = list(llms)[r % len(llms):] + list(llms)[: r % len(llms)]
            for name in order:
                res = run(llms[name], ids, streams, params)
                runs.append({"round": r, "setting": name, "streams": streams, **res})
                rate = f", accepted {res['accepted']}/{res['drafted']}" if res["drafted"] else ""
                print(f"round {r} {streams:>2} stream(s) {name:>5}: {res['tok_per_s']:6.1f} output tok/s, "
                      f"{res['tokens']} tokens{rate}", flush=True)
    print(f"\n{'streams':>7} " + " ".join(f"{n + ' tok/s':>12}" for n in llms) + "   vs off, outputs equal")
    for streams in (1, len(ids)):
        mine = [x for x in runs if x["streams"] == streams]
        med = {n: statistics.median(x["tok_per_s"] for x in mine if x["setting"] == n) for n in llms}
        texts = {n: next(x["texts"] for x in mine if x["setting"] == n) for n in llms}
        ratios = ", ".join(f"{n} {med[n] / med['off']:.2f}x {texts[n] == texts['off']}"
                           for n in llms if n != "off")
        print(f"{streams:>7} " + " ".join(f"{med[n]:12.1f}" for n in llms) + f"   {ratios}")
    if args.out:
        write_report(args.out, {"cpu_flags": cpu_flags(), "settings": vars(args),
                                "runs": [{k: v for k, v in x.items() if k != "texts"} for x in runs]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
