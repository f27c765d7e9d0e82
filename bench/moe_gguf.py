"""A random Qwen3-MoE GGUF at a chosen shape, quantized by llama.cpp, for `bench/quant.py --model FILE`.

Run: .venv/bin/python bench/moe_gguf.py --out DIR --llama-quantize PATH [--type Q4_K_M] [--hidden 1024]
[--layers 16] [--experts 32] [--top-k 8] [--moe-intermediate 384]. Writes DIR/hf (a transformers checkpoint,
weights ~ N(0, 1/fan_in)), DIR/moe-f32.gguf (tests/gguf_writer.py: the layout llama.cpp's converter writes,
experts stacked in 3D) and DIR/moe-TYPE.gguf (`llama-quantize`), and prints their sizes. Files already there
are reused. Not a test: the shape is a scaled-down Qwen3-30B-A3B (many small experts, top-8).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the tokenizer and GGUF writer


def write_hf(folder: Path, args: argparse.Namespace) -> None:
    import transformers as tf

    from tests.tiny_model import _hf_tokenizer, _random_model

    tok = _hf_tokenizer()
    cfg = tf.Qwen3MoeConfig(vocab_size=len(tok), hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                            num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                            num_key_value_heads=max(1, args.hidden // 256), head_dim=64,
                            num_experts=args.experts, num_experts_per_tok=args.top_k,
                            moe_intermediate_size=args.moe_intermediate, norm_topk_prob=True,
                            decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=4096,
                            rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    model = _random_model(cfg, seed=0)
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--llama-quantize", required=True, help="llama.cpp's llama-quantize binary")
    ap.add_argument("--type", default="Q4_K_M")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--moe-intermediate", type=int, default=384)
    args = ap.parse_args()
    folder, f32 = args.out / "hf", args.out / "moe-f32.gguf"
    out = args.out / f"moe-{args.type}.gguf"
    if not (folder / "config.json").exists():
        print(f"writing {folder}", flush=True)
        write_hf(folder, args)
    if not f32.exists():
        from tests.gguf_writer import write_gguf

        print(f"writing {f32}", flush=True)
        write_gguf(folder, f32)
    if not out.exists():
        cmd = [str(Path(args.llama_quantize).expanduser()), str(f32), str(out), args.type]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            print(f"llama-quantize failed (rc {proc.returncode}): {proc.stderr.strip()[-500:]}")
            return 1
    for path in (f32, out):
        print(f"{path}: {path.stat().st_size / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
