"""What the bench sends: request specs with arrival offsets, random or from a file, and workload M."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

# Random prompts draw token ids from [TOKEN_LOW, vocab_size): low ids hold special tokens in most
# vocabularies, and 32,000 is a size nearly every Llama-family vocabulary reaches.
TOKEN_LOW = 100
DEFAULT_VOCAB_SIZE = 32000


@dataclass(frozen=True)
class RequestSpec:
    """One request of a workload: when to send it (seconds after the start), what, and its class."""

    index: int
    arrival_s: float
    prompt: list[int] | str
    prompt_len: int  # token count for token-id prompts; -1 when the prompt is text of unknown length
    output_len: int
    kind: str = "short"  # "short" | "long": the classes PERF.md's workload M table reports


def poisson_arrivals(n: int, rate: float, rng: random.Random) -> list[float]:
    """Offsets of n arrivals at `rate` per second (first at 0); rate inf sends all at once."""
    if rate <= 0:
        raise ValueError("request rate must be > 0 (inf sends everything at once)")
    offsets, t = [], 0.0
    for i in range(n):
        if i > 0 and rate != float("inf"):
            t += rng.expovariate(rate)
        offsets.append(t)
    return offsets


def random_tokens(n: int, vocab_size: int, rng: random.Random) -> list[int]:
    """n random token ids from the ordinary part of a vocabulary of vocab_size."""
    low = TOKEN_LOW if vocab_size > 2 * TOKEN_LOW else 0
    return [rng.randrange(low, vocab_size) for _ in range(n)]


def _input_len(base: int, spread: float, rng: random.Random) -> int:
    lo, hi = max(1, round(base * (1 - spread))), max(1, round(base * (1 + spread)))
    return rng.randint(lo, hi)


def random_workload(
    num_requests: int,
    request_rate: float,
    *,
    input_len: int = 128,
    input_len_range: float = 0.0,
    output_len: int = 64,
    long_prompt_fraction: float = 0.0,
    long_input_len: int = 1500,
    long_output_len: int | None = None,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    seed: int = 0,
) -> list[RequestSpec]:
    """Random token-id prompts, Poisson arrivals; round(fraction * n) of them are long prompts."""
    if not 0.0 <= long_prompt_fraction <= 1.0:
        raise ValueError("long_prompt_fraction must be within [0, 1]")
    rng = random.Random(seed)
    arrivals = poisson_arrivals(num_requests, request_rate, rng)
    long_ids = set(rng.sample(range(num_requests), round(long_prompt_fraction * num_requests)))
    specs = []
    for i, arrival in enumerate(arrivals):
        is_long = i in long_ids
        n = long_input_len if is_long else _input_len(input_len, input_len_range, rng)
        out = (long_output_len or output_len) if is_long else output_len
        specs.append(RequestSpec(i, arrival, random_tokens(n, vocab_size, rng), n, out,
                                 "long" if is_long else "short"))
    return specs


def workload_m(
    *,
    num_short: int = 48,
    short_rate: float = 2.0,
    short_input: tuple[int, int] = (32, 128),
    short_output: int = 64,
    num_long: int = 4,
    long_input_len: int = 1500,
    long_output: int = 8,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    seed: int = 0,
) -> list[RequestSpec]:
    """PERF.md's workload M: short Poisson requests, long prompts at evenly spaced fractions of the span."""
    rng = random.Random(seed)
    short_arrivals = poisson_arrivals(num_short, short_rate, rng)
    span = short_arrivals[-1] if short_arrivals else 0.0
    rows: list[tuple[float, list[int], int, str]] = []
    for arrival in short_arrivals:
        n = rng.randint(*short_input)
        rows.append((arrival, random_tokens(n, vocab_size, rng), short_output, "short"))
    # 4 long prompts land at 20/40/60/80% of the span: between short arrivals, never at the edges.
    for k in range(1, num_long + 1):
        rows.append((span * k / (num_long + 1), random_tokens(long_input_len, vocab_size, rng),
                     long_output, "long"))
    rows.sort(key=lambda r: r[0])
    return [RequestSpec(i, a, p, len(p), o, kind) for i, (a, p, o, kind) in enumerate(rows)]


def load_dataset(
    path: str | Path, num_requests: int, request_rate: float, *, output_len: int = 64, seed: int = 0
) -> list[RequestSpec]:
    """Requests from a JSONL file of {"prompt": text or token ids, "output_len"?, "kind"?} lines.

    The first num_requests lines are used (all when num_requests <= 0), with Poisson arrivals.
    """
    lines = [ln for ln in Path(path).read_text().splitlines() if ln.strip()]
    if num_requests > 0:
        lines = lines[:num_requests]
    rng = random.Random(seed)
    arrivals = poisson_arrivals(len(lines), request_rate, rng)
    specs = []
    for i, (line, arrival) in enumerate(zip(lines, arrivals, strict=True)):
        row = json.loads(line)
        prompt = row["prompt"]
        if not isinstance(prompt, str | list):
            raise ValueError(f"{path}: line {i + 1}: prompt must be text or a list of token ids")
        n = len(prompt) if isinstance(prompt, list) else -1
        specs.append(RequestSpec(i, arrival, prompt, n, int(row.get("output_len", output_len)),
                                 str(row.get("kind", "short"))))
    return specs


def shared_prefix_workload(
    num_requests: int,
    request_rate: float,
    *,
    prefix_len: int = 512,
    num_prefixes: int = 1,
    question_len: tuple[int, int] = (16, 48),
    output_len: int = 32,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    seed: int = 0,
) -> list[RequestSpec]:
    """Chat with a long system prompt: each request is one of `num_prefixes` shared prefixes of
    prefix_len tokens (round robin) followed by a short question of its own; Poisson arrivals.
    What prefix caching is for: with it, only the question is prefilled once a prefix has been seen."""
    if num_prefixes < 1 or prefix_len < 0:
        raise ValueError("num_prefixes must be >= 1 and prefix_len >= 0")
    rng = random.Random(seed)
    prefixes = [random_tokens(prefix_len, vocab_size, rng) for _ in range(num_prefixes)]
    specs = []
    for i, arrival in enumerate(poisson_arrivals(num_requests, request_rate, rng)):
        prompt = prefixes[i % num_prefixes] + random_tokens(rng.randint(*question_len), vocab_size, rng)
        specs.append(RequestSpec(i, arrival, prompt, len(prompt), output_len, "short"))
    return specs
