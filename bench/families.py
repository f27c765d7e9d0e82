"""Workload W on random checkpoints of each family at real shapes, mixserve beside vLLM-CPU (issue 33).

Families: qwen3 (Qwen3-0.6B's shape), gemma3 (Gemma-3-1B's text model: 5 sliding layers of window 512 to 1
full), qwen3_moe (a Qwen3-MoE of ~1.5B parameters, 64 experts, top-8). Each checkpoint is written once by
transformers (from_config, weights ~ N(0, 1/fan_in) so logits spread, bf16 safetensors, a word-level
tokenizer over the whole vocabulary so both systems detokenize) under `--models-dir` (~/peers-work/models),
and reused. Then, per family, in `--rounds` interleaved rounds, one system at a time: mixserve through
bench/offline_run.py (LLM.generate, as bench/offline.py runs it) and vLLM-CPU through bench/peers_vllm_w.py
in its venv (both cores bound, ../shared/peers/vllm_env.sh), at each `--dtype`. Both get the same KV cache
(enough for the whole workload) and max_model_len 1024. Flags this script does not know go to mixserve's
engine (`--prefill-chunk 64`, ...). A run that fails is a row with its one-line error. Prints the CPU flags,
then a markdown table per family (median run of each system and dtype, mixserve / vLLM-CPU at the same dtype,
the issue's target mixserve >= vLLM-CPU); writes JSON to `--out`, logs under its folder's tmp/.
`--layers N` shrinks every model to N layers (a quick check of the plumbing, e.g.
`--layers 2 --num-requests 2 --output-tokens 8`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from bench.argv import write_report  # noqa: E402
from bench.floors import cpu_flags, kernels_line  # noqa: E402
from bench.offline import PEERS, median_runs  # noqa: E402
from bench.peers_vllm_w import workload_w  # noqa: E402

HERE = Path(__file__).resolve().parent
MAX_MODEL_LEN = 1024
NAMES = {"mixserve": "mixserve", "vllm": "vLLM-CPU"}
_QWEN3 = dict(vocab_size=151936, hidden_size=1024, num_attention_heads=16, head_dim=128, rms_norm_eps=1e-6,
              max_position_embeddings=40960, tie_word_embeddings=True,
              rope_parameters={"rope_type": "default", "rope_theta": 1e6})
# name -> (folder stem, transformers config class, architecture, fields); num_hidden_layers set apart
FAMILIES: dict[str, tuple[str, str, str, dict[str, Any]]] = {
    "qwen3": ("qwen3-0.6b", "Qwen3Config", "Qwen3ForCausalLM",
              dict(_QWEN3, num_hidden_layers=28, num_key_value_heads=8, intermediate_size=3072)),
    "gemma3": ("gemma-3-1b", "Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(vocab_size=262144, hidden_size=1152, num_hidden_layers=26, num_attention_heads=4,
                    num_key_value_heads=1, head_dim=256, intermediate_size=6912, rms_norm_eps=1e-6,
                    max_position_embeddings=32768, tie_word_embeddings=True, query_pre_attn_scalar=256,
                    sliding_window=512, rope_parameters={
                        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                        "full_attention": {"rope_type": "default", "rope_theta": 1e6}})),
    "qwen3_moe": ("qwen3-moe-1.5b", "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(_QWEN3, num_hidden_layers=24, num_key_value_heads=4, intermediate_size=3072,
                       num_experts=64, num_experts_per_tok=8, moe_intermediate_size=256, norm_topk_prob=True,
                       decoder_sparse_step=1, mlp_only_layers=[])),
}
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # pad, bos, eos: ids 0, 1, 2


def hf_config(family: str, layers: int | None = None, **overrides: Any) -> Any:
    """The transformers config of `family` at its real shape, or `layers` layers (or other `overrides`)."""
    import transformers

    _, cls, arch, fields = FAMILIES[family]
    fields = dict(fields, pad_token_id=0, bos_token_id=1, eos_token_id=2, **overrides)
    if layers:
        fields["num_hidden_layers"] = layers
    if family == "gemma3":  # every sixth layer full, as Gemma 3's sliding_window_pattern 6
        n = fields["num_hidden_layers"]
        fields["layer_types"] = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                 for i in range(n)]
    cfg = getattr(transformers, cls)(**fields)
    cfg.architectures = [arch]
    return cfg


def parameter_counts(cfg: Any) -> tuple[int, int]:
    """(total, active per token) parameters of the model `cfg` describes (a tied lm_head counted once;
    an expert's weights count top_k / num_experts of themselves as active); built on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    share = cfg.num_experts_per_tok / cfg.num_experts if hasattr(cfg, "num_experts_per_tok") else 1.0
    total = active = 0
    for name, p in model.named_parameters():
        total += p.numel()
        active += p.numel() * (share if ".experts." in name else 1)
    return total, round(active)


def tokenizer(vocab: int) -> Any:
    """A word-level tokenizer of `vocab` tokens ("t<id>"; the specials first): every id decodes."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {s: i for i, s in enumerate(SPECIAL_TOKENS)} | {f"t{i}": i for i in range(3, vocab)}  # after them
    tok = Tokenizer(models.WordLevel(words, unk_token=SPECIAL_TOKENS[0]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()  # joins words with spaces
    tok.add_special_tokens([AddedToken(s, special=True) for s in SPECIAL_TOKENS])
    pad, bos, eos = SPECIAL_TOKENS
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=pad, bos_token=bos, eos_token=eos,
                                   unk_token=pad)


def write_checkpoint(cfg: Any, folder: Path, seed: int = 0) -> bool:
    """A random checkpoint of `cfg` in `folder` (bf16 safetensors, config.json, tokenizer); False where one is
    there already. Written beside it and renamed, so an interrupted write is never reused."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    if (folder / "config.json").exists():
        return False
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    with torch.no_grad():  # N(0, 1/fan_in): activations keep their scale, the logits spread; norms as HF's
        for p in model.parameters():
            if p.dim() >= 2:  # the last dimension is the input one, the 3-D fused experts' too
                p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
    hf_logging.disable_progress_bar()
    model.save_pretrained(partial)
    raw = json.loads((partial / "config.json").read_text())
    if "num_local_experts" in raw:  # Qwen3-MoE checkpoints name it num_experts (transformers 5 maps both)
        raw["num_experts"] = raw["num_local_experts"]
        (partial / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    tokenizer(cfg.vocab_size).save_pretrained(partial)
    partial.rename(folder)
    return True


def kv_cache_gib(cfg: Any, dtype: str, num_requests: int, output_tokens: int) -> int:
    """GiB of KV cache that hold the whole workload at once (every layer's K and V of every token, +20%)."""
    tokens = sum(map(len, workload_w(cfg.vocab_size, num_requests))) + num_requests * output_tokens
    size = 4 if "32" in dtype else 2
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * size
    return max(1, math.ceil(1.2 * tokens * per_token / 2**30))


def error_line(stderr: str) -> str:
    """The one line that says why a child failed: the last exception line that is not a pointer to another."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    errs = [ln for ln in lines if re.search(r"(Error|Exception|error)\b:? ", ln) and "root cause" not in ln]
    return re.sub(r"^.*?\] ", "", (errs or lines or ["no output"])[-1])[:300]  # vLLM's "(EngineCore pid=1) ]"


def run_child(cmd: list[str], log: Path, timeout: float) -> tuple[str, str | None]:
    """(stdout, None) of a child, or (stdout, its one-line error); its stderr and stdout kept in `log`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(cmd, timeout=timeout, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    except subprocess.TimeoutExpired as e:
        log.write_text(e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or ""))
        return "", f"timed out after {timeout:.0f} s"
    log.write_text(done.stderr + "\n--- stdout ---\n" + done.stdout)
    return done.stdout, None if done.returncode == 0 else error_line(done.stderr)


def run_mixserve(folder: Path, dtype: str, args: argparse.Namespace, engine_argv: list[str], kv_gib: int,
                 log: Path) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, str(HERE / "offline_run.py"), "mixserve", "--model", str(folder),
               "--max-model-len", str(MAX_MODEL_LEN), "--cpu-kv-cache-gib", str(kv_gib), *engine_argv,
               "--dtype", dtype, "--num-requests", str(args.num_requests), "--output-tokens",
               str(args.output_tokens), "--result", str(out)]
        _, err = run_child(cmd, log, args.timeout)
        if err or not out.exists():
            return {"error": err or "no result written"}
        r = json.loads(out.read_text())
    return {k: r[k] for k in ("wall_s", "cpu_s", "output_tokens", "prompt_tokens", "threads")}


def run_vllm(folder: Path, dtype: str, args: argparse.Namespace, kv_gib: int, log: Path) -> dict[str, Any]:
    work = args.vllm_work or str(Path(args.vllm).absolute().parents[2])  # WORK/vllm/bin/python
    script = (f'export WORK="$1"; . "{PEERS}/vllm_env.sh"; export VLLM_CPU_KVCACHE_SPACE="$2"; shift 2; '
              'exec "$@"')
    cmd = ["bash", "-c", script, "vllm", work, str(kv_gib), args.vllm, str(HERE / "peers_vllm_w.py"),
           "--model", str(folder), "--dtype", dtype, "--num-requests", str(args.num_requests),
           "--output-tokens", str(args.output_tokens), "--max-model-len", str(MAX_MODEL_LEN)]
    stdout, err = run_child(cmd, log, args.timeout)
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    if err or not lines:
        return {"error": err or "no JSON line printed"}
    r = json.loads(lines[-1])
    return {k: r[k] for k in ("wall_s", "output_tokens", "prompt_tokens")}


def table(rows: list[dict[str, Any]]) -> list[str]:
    """The markdown table of one family: each system and dtype's median run, mixserve / vLLM-CPU."""
    done = median_runs([r for r in rows if "error" not in r])
    shown = {(r["system"], r["dtype"]) for r in done}
    failed = {(r["system"], r["dtype"]): r for r in rows if (r["system"], r["dtype"]) not in shown}
    vllm = {r["dtype"]: r["output_tokens"] / r["wall_s"] for r in done if r["system"] == "vllm"}
    out = ["| system | dtype | wall s | output tok/s | mixserve / vLLM | note |", "|---|---|---|---|---|---|"]
    for r in [*done, *failed.values()]:
        head = f"| {NAMES[r['system']]} | {r['dtype']} |"
        if "error" in r:
            out.append(f"{head} - | - | - | failed: {r['error'].replace('|', '/')} |")
            continue
        tps = r["output_tokens"] / r["wall_s"]
        ratio, note = "-", f"median of {r['runs']}" if r["runs"] > 1 else ""
        if r["system"] == "mixserve" and r["dtype"] in vllm:
            x = tps / vllm[r["dtype"]]
            ratio, note = f"{x:.2f}", f"target >= 1.00: {'met' if x >= 1 else 'MISSED'}; {note}".rstrip("; ")
        out.append(f"{head} {r['wall_s']:.1f} | {tps:.1f} | {ratio} | {note} |")
    rounds = sorted({r["round"] for r in rows})
    for k in rounds if len(rounds) > 1 else []:  # each round's ratios, as bench/offline.py prints them
        each = {(r["system"], r["dtype"]): r["output_tokens"] / r["wall_s"] for r in rows
                if r["round"] == k and "error" not in r}
        ratios = [f"{d} {tps / each[('vllm', d)]:.2f}" for (s, d), tps in each.items() if s == "mixserve"
                  and ("vllm", d) in each]
        out.append(f"round {k}: mixserve / vLLM " + (", ".join(ratios) or "-"))
    return out


def main(argv: list[str] | None = None) -> int:
    epilog = "other flags go to mixserve's engine (bench/offline_run.py --help)"
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False, epilog=epilog)
    parser.add_argument("--families", default=",".join(FAMILIES), help=f"comma-separated: {list(FAMILIES)}")
    parser.add_argument("--dtype", default="float32", help="comma-separated: float32,bfloat16")
    parser.add_argument("--num-requests", type=int, default=32, help="the first N requests of W")
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=1, help="run every system this many times, in turn")
    parser.add_argument("--layers", type=int, default=None, help="every model at N layers (a quick check)")
    parser.add_argument("--models-dir", default=str(Path.home() / "peers-work" / "models"))
    parser.add_argument("--skip-vllm", action="store_true", help="only mixserve")
    parser.add_argument("--vllm", metavar="PYTHON", default=str(Path.home() / "peers-work/vllm/bin/python"))
    parser.add_argument("--vllm-work", metavar="DIR", help="setup_vllm.sh's WORK (default: PYTHON/../..)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per run at most")
    parser.add_argument("--out", default=str(HERE / "results" / "families" / "families.json"))
    args, engine_argv = parser.parse_known_args(argv)
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    dtypes = [d.strip() for d in args.dtype.split(",") if d.strip()]
    if bad := [f for f in families if f not in FAMILIES]:
        parser.error(f"unknown families {bad}; known: {list(FAMILIES)}")
    flags = cpu_flags()
    print(f"cpu: {flags['cpu']}; " + " ".join(f"{k}={'yes' if v else 'no'}" for k, v in flags.items()
                                              if isinstance(v, bool)) +
          f"; torch capability {flags['torch_capability']}; C++ kernels {kernels_line()}; "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}", flush=True)
    print(f"workload W: {args.num_requests} requests, {args.output_tokens} output tokens each, greedy, "
          f"ignore_eos; dtypes {dtypes}; rounds {args.rounds}; engine flags {engine_argv or 'none'}",
          flush=True)
    logs = Path(args.out).parent / "tmp"
    report: dict[str, Any] = {"settings": {**vars(args), "engine_argv": engine_argv}, "cpu_flags": flags,
                              "families": {}}
    tables: list[str] = []
    for family in families:
        cfg = hf_config(family, args.layers)
        stem = FAMILIES[family][0] + "-random" + (f"-{args.layers}l" if args.layers else "")
        folder = Path(args.models_dir).expanduser() / stem
        start = time.perf_counter()
        wrote = write_checkpoint(cfg, folder)
        total, active = parameter_counts(cfg)
        head = (f"### {family}: {stem}, {cfg.num_hidden_layers} layers, {total / 1e9:.3f}B parameters "
                f"({active / 1e9:.3f}B active), {folder}")
        print(head + (f" (written in {time.perf_counter() - start:.0f} s)" if wrote else " (reused)"),
              flush=True)
        plan = [(s, d) for d in dtypes for s in ("mixserve", *(() if args.skip_vllm else ("vllm",)))]
        rows: list[dict[str, Any]] = []
        for k in range(1, args.rounds + 1):
            for system, dtype in plan:
                kv = kv_cache_gib(cfg, dtype, args.num_requests, args.output_tokens)
                log = logs / f"{stem}-{system}-{dtype}-r{k}.log"
                start = time.perf_counter()
                if system == "mixserve":
                    r = run_mixserve(folder, dtype, args, engine_argv, kv, log)
                else:
                    r = run_vllm(folder, dtype, args, kv, log)
                rows.append({"system": system, "dtype": dtype, "round": k, "kv_cache_gib": kv, **r})
                took = time.perf_counter() - start
                said = (f"failed: {r['error']}" if "error" in r else
                        f"{r['output_tokens'] / r['wall_s']:.1f} output tok/s, {r['wall_s']:.1f} s")
                print(f"  [{family} round {k}] {system} {dtype}: {said} ({took:.0f} s with loading; {log})",
                      flush=True)
        lines = [head, "", *table(rows), ""]
        print("\n".join(lines), flush=True)
        tables += lines
        report["families"][family] = {"folder": str(folder), "layers": cfg.num_hidden_layers,
                                      "parameters": total, "active_parameters": active, "rows": rows}
    if len(families) > 1:
        print("\n".join(["## all families", "", *tables]))
    write_report(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
