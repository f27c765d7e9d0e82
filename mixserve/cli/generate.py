"""`mixserve generate`: one prompt through the engine; prints the completion, then TTFT, TPOT and tok/s."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from mixserve.config import ConfigError, add_engine_flags, config_from_args


def register(subparsers: Any) -> None:
    """Add the `generate` subcommand."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "generate", help="generate a completion for one prompt",
        description="Generate a completion for one prompt, then print TTFT, TPOT and tokens/s.",
    )
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--max-tokens", default="64", help="tokens to generate at most (default 64)")
    p.add_argument("--temperature", default="0", help="0 = greedy (default)")
    p.add_argument("--top-p", default="1.0")
    p.add_argument("--top-k", default="0")
    add_engine_flags(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Exit code 2 with one line on stderr for a bad config, flag or request."""
    try:
        cfg = config_from_args(args)
        params = _sampling_params(args)
    except (ConfigError, ValueError) as e:
        print(f"mixserve generate: {e}", file=sys.stderr)
        return 2
    # torch loads only now, so a bad flag is reported without the import's delay
    from mixserve.engine.llm_engine import LLMEngine, RequestError
    from mixserve.model.errors import ModelLoadError

    try:
        engine = LLMEngine.from_config(cfg.engine)
        tok = engine.tokenizer
        if args.chat:
            ids = tok.apply_chat_template([{"role": "user", "content": args.prompt}])
        else:
            ids = tok.encode(args.prompt)
        engine.add_request("generate-0", ids, params)
    except (ModelLoadError, RequestError, ValueError) as e:
        print(f"mixserve generate: {e}", file=sys.stderr)
        return 2
    output = None
    while engine.has_unfinished():
        for update in engine.step():
            sys.stdout.write(update.new_text)
            sys.stdout.flush()
            output = update.output or output
    engine.close()
    print()
    if output is not None:
        _print_timing(output.metrics)
    return 0


def _sampling_params(args: argparse.Namespace) -> Any:
    from mixserve.engine.sampling_params import SamplingParams

    values = {}
    for name, kind in (("max_tokens", int), ("temperature", float), ("top_p", float), ("top_k", int)):
        raw = getattr(args, name)
        try:
            values[name] = kind(raw)
        except ValueError:
            flag, what = "--" + name.replace("_", "-"), "an integer" if kind is int else "a number"
            raise ValueError(f"{flag}: must be {what}, got {raw!r}") from None
    return SamplingParams(**values)


def _print_timing(m: Any) -> None:
    n = len(m.token_times)
    total = (m.finished or m.token_times[-1]) - m.arrival if n else 0.0
    tpot = f"{m.tpot * 1000:.1f} ms" if m.tpot is not None else "-"
    ttft = f"{m.ttft * 1000:.1f} ms" if m.ttft is not None else "-"
    rate = n / total if total > 0 else 0.0
    print(f"TTFT {ttft}  TPOT {tpot}  {rate:.1f} tokens/s ({n} tokens)")
