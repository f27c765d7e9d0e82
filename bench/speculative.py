"""Does n-gram speculation (`[engine] speculative = "ngram"`) pay on this CPU, and beside the peers'?

Not a test. Run: .venv/bin/python bench/speculative.py [--systems mixserve,llamacpp,vllm] [--rounds 2] [--out
bench/results/speculative.json] [--dtype bfloat16]. Two workloads of token-id prompts, the same ids to every
server: copy (16 chat prompts asking to copy a piece of the standard library's own Python source: the answer
repeats the prompt) and W (bench/offline_run.py's random-token prompts, 64 tokens each, EOS ignored: nothing
to copy). Each is sent single stream (the first 8 prompts one after another) and at 16 streams (every prompt,
16 in flight), greedy, through /v1/completions. Per system and setting (speculation off, then on): output
tok/s over the run's wall time, and the drafts accepted per drafted token where the server reports them
(/metrics, llama-server's timings). mixserve's two settings alternate over --rounds (a server per setting and
round); the peers run once per setting after ours. Servers: `mixserve serve`, llama-server
(../shared/peers/llamacpp_serve.sh, --spec-type ngram-simple), vLLM-CPU (vllm_serve.sh, method "ngram").
Prints the CPU's flags the kernels depend on.
"""

from __future__ import annotations

import argparse
import inspect
import json
import re
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from argv import write_report  # noqa: E402
from floors import cpu_flags  # noqa: E402
from offline_run import workload_w  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT.parent / "shared" / "peers"
WORK = Path.home() / "peers-work"
GGUF = WORK / "model" / "SmolLM2-135M-Instruct.Q4_1.gguf"
SPEC_TOKENS = 4
# What is copied: stdlib functions of a few dozen lines (the same text on every machine with this Python).
SOURCES = ("textwrap.dedent", "json.dumps", "shutil.copyfile", "shutil.move", "random.Random.choices",
           "functools.total_ordering", "heapq.nsmallest", "fnmatch.translate", "glob.glob",
           "tempfile.mkstemp", "difflib.get_close_matches", "copy.deepcopy", "csv.Sniffer.sniff",
           "ipaddress.ip_address", "shutil.copytree", "random.Random.sample")
COPY_CHARS, COPY_TOKENS, W_TOKENS, SINGLE = 1200, 256, 64, 8


def copy_prompts(tokenizer: Any) -> list[list[int]]:
    """A chat per source asking the model to copy it: token ids through the model's own chat template."""
    import importlib

    out = []
    for name in SOURCES:
        module, _, attr = name.partition(".")
        obj: Any = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
        src = inspect.getsource(obj)[:COPY_CHARS]
        msg = f"Copy the following Python code exactly:\n\n```python\n{src}\n```"
        out.append(tokenizer.apply_chat_template([{"role": "user", "content": msg}]))
    return out


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def run_load(base: str, model: str, prompts: list[list[int]], max_tokens: int, streams: int,
             ignore_eos: bool) -> dict:
    """Send every prompt, `streams` in flight; output tokens, wall seconds, and llama-server's drafts."""
    def one(ids: list[int]) -> dict:
        return post(f"{base}/v1/completions", {"model": model, "prompt": ids, "max_tokens": max_tokens,
                                               "temperature": 0, "ignore_eos": ignore_eos})

    t0 = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        replies = list(pool.map(one, prompts))
    wall = time.perf_counter() - t0
    tokens = sum(r["usage"]["completion_tokens"] for r in replies)
    drafted = sum(r.get("timings", {}).get("draft_n", 0) for r in replies)
    accepted = sum(r.get("timings", {}).get("draft_n_accepted", 0) for r in replies)
    return {"tokens": tokens, "wall_s": round(wall, 3), "tok_s": round(tokens / wall, 2),
            "drafted": drafted, "accepted": accepted}


def spec_counters(base: str, prefix: str) -> tuple[float, float]:
    """(draft tokens, accepted tokens) so far from a server's /metrics; (0, 0) if it has none."""
    try:
        text = urllib.request.urlopen(f"{base}/metrics", timeout=10).read().decode()
    except OSError:
        return 0.0, 0.0

    def total(name: str) -> float:
        return sum(float(m) for m in re.findall(rf"^{prefix}{name}(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M))

    return total("spec_decode_num_draft_tokens_total"), total("spec_decode_num_accepted_tokens_total")


def wait_ready(base: str, proc: subprocess.Popen, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            urllib.request.urlopen(f"{base}/v1/models", timeout=5).read()
            return
        except OSError:
            time.sleep(1)  # polling a process that is starting: nothing to wait on but the port
    raise RuntimeError(f"{base} not ready after {timeout_s} s")


def server_command(system: str, spec: bool, port: int, dtype: str = "auto", int8: bool = False) -> list[str]:
    if system == "mixserve":
        return [str(ROOT / ".venv/bin/mixserve"), "serve", "--port", str(port), "--max-model-len", "2048",
                "--speculative", "ngram" if spec else "", "--num-speculative-tokens", str(SPEC_TOKENS),
                "--dtype", dtype, "--int8-activations", "on" if int8 else "off"]
    if system == "llamacpp":
        extra = ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "4",
                 "--spec-ngram-simple-size-m", str(SPEC_TOKENS)] if spec else []
        return ["bash", str(PEERS / "llamacpp_serve.sh"), str(WORK), str(port), str(GGUF), "-np", "16",
                "-c", "32768", "-kvu", *extra]
    if system == "vllm":
        extra = ["--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": SPEC_TOKENS,
                                                     "prompt_lookup_max": 4, "prompt_lookup_min": 2})]
        return ["bash", str(PEERS / "vllm_serve.sh"), str(WORK), str(port), "--dtype", "float32",
                *(extra if spec else [])]
    raise ValueError(f"unknown system {system!r}")


def measure(system: str, spec: bool, port: int, loads: dict[str, tuple], dtype: str,
            int8: bool = False) -> dict:
    """Start the server, warm it, run every load, stop it; the loads' figures."""
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(server_command(system, spec, port, dtype, int8), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_ready(base, proc)
        model = json.loads(urllib.request.urlopen(f"{base}/v1/models").read())["data"][0]["id"]
        run_load(base, model, [loads["copy-1"][0][0]], 16, 1, False)  # warm-up
        prefix = {"mixserve": "mixserve:", "vllm": "vllm:"}.get(system, "")
        out = {}
        for name, (prompts, max_tokens, streams, ignore_eos) in loads.items():
            before = spec_counters(base, prefix)
            row = run_load(base, model, prompts, max_tokens, streams, ignore_eos)
            after = spec_counters(base, prefix)
            if after[0] > before[0]:
                row["drafted"], row["accepted"] = after[0] - before[0], after[1] - before[1]
            out[name] = row
            print(f"  {system:9} {'ngram' if spec else 'off':5} {name:8} {row['tok_s']:8.1f} tok/s "
                  f"({row['tokens']} tokens, {row['wall_s']} s) drafts kept "
                  f"{row['accepted']:.0f}/{row['drafted']:.0f}", flush=True)
        return out
    finally:
        subprocess.run(["kill", "--", f"-{proc.pid}"], check=False)
        proc.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--systems", default="mixserve", help="comma-separated: mixserve, llamacpp, vllm")
    ap.add_argument("--rounds", type=int, default=2, help="alternations of mixserve's off and ngram")
    ap.add_argument("--port", type=int, default=8031)
    ap.add_argument("--out", default=None, help="write the JSON report here")
    ap.add_argument("--dtype", default="auto", help="mixserve's --dtype (bfloat16: the opt-in for speed)")
    ap.add_argument("--int8-activations", action="store_true", help="mixserve's --int8-activations on")
    args = ap.parse_args()
    from mixserve.model.loader import default_model_path
    from mixserve.model.tokenizer import load_tokenizer

    tok = load_tokenizer(default_model_path())
    copy, w = copy_prompts(tok), workload_w(len(tok.hf))
    loads = {"copy-1": (copy[:SINGLE], COPY_TOKENS, 1, False), "copy-16": (copy, COPY_TOKENS, 16, False),
             "W-1": (w[:SINGLE], W_TOKENS, 1, True), "W-16": (w, W_TOKENS, 16, True)}
    mean = statistics.mean(map(len, copy))
    print(f"cpu: {cpu_flags()}  prompts: copy {len(copy)} (mean {mean:.0f} tokens), W {len(w)}")
    runs: dict[str, dict[str, list[dict]]] = {}
    for system in args.systems.split(","):
        rounds = args.rounds if system == "mixserve" else 1
        for r in range(rounds):
            for spec in ((False, True) if r % 2 == 0 else (True, False)):
                key = f"{system} {'ngram' if spec else 'off'}"
                try:
                    result = measure(system, spec, args.port, loads, args.dtype, args.int8_activations)
                except (RuntimeError, OSError) as e:  # a peer that cannot serve this setting
                    print(f"  {key}: {e}", flush=True)
                    continue
                for name, row in result.items():
                    runs.setdefault(key, {}).setdefault(name, []).append(row)
    head = " ".join(f"{n:>14}" for n in loads)
    print(f"\n{'system':16} {head}   (tok/s, median of rounds; x: ngram/off)")
    summary: dict[str, dict[str, float]] = {}
    for key, per in runs.items():
        summary[key] = {n: statistics.median(x["tok_s"] for x in rows) for n, rows in per.items()}
        print(f"{key:16} " + " ".join(f"{summary[key][n]:14.1f}" for n in loads))
    for system in args.systems.split(","):
        off, on = summary.get(f"{system} off"), summary.get(f"{system} ngram")
        if off and on:
            print(f"{system + ' x':16} " + " ".join(f"{on[n] / off[n]:13.2f}x" for n in loads))
    if args.out:
        shapes = {n: {"prompts": len(v[0]), "max_tokens": v[1], "streams": v[2]} for n, v in loads.items()}
        write_report(args.out, {"cpu": cpu_flags(), "loads": shapes, "runs": runs, "summary": summary})


if __name__ == "__main__":
    main()
