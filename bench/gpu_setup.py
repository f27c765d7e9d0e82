"""The GPU bench's setup sections: a random model of the Llama-3.2-1B shape, the device's ceilings, the
runner, whether the Triton kernels run."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch
from gpu_common import BLOCK_SIZE, Bench, attention_note, row


def write_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level tokenizer with one token per id ("t123"), so any sampled id detokenizes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2",
                                   pad_token="t0")
    fast.save_pretrained(str(path))


def setup_model(bench: Bench) -> None:
    """Random weights in HF's LlamaForCausalLM, saved as a folder our loader reads; HF model kept."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(**bench.shape, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    try:
        cfg._attn_implementation = "sdpa"
    except Exception:  # noqa: BLE001 - a read-only attribute in some versions: their default is sdpa anyway
        pass
    with torch.device(bench.device):
        hf = LlamaForCausalLM(cfg).to(bench.dtype).eval()
    path = Path(tempfile.mkdtemp(prefix="gpu_bench_llama_"))
    hf.save_pretrained(str(path))
    write_tokenizer(path, cfg.vocab_size)
    bench.model_dir, bench.hf = path, hf
    params = sum(p.numel() for p in hf.parameters())
    row("model", f"{params / 1e9:.3f} B params", "", f"{path} ({bench.dtype}, {bench.device})")


def measure_ceilings(bench: Bench) -> None:
    """Device copy bandwidth (bytes read + written) and the bf16 matmul rate, measured here."""
    n = (1 << 30) if bench.device.type == "cuda" else (1 << 26)
    src = torch.empty(n // 2, dtype=torch.bfloat16, device=bench.device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    bench.sync()
    reps = 20 if bench.device.type == "cuda" else 3
    t0 = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    bench.sync()
    bench.copy_gbs = 2 * n * reps / (time.perf_counter() - t0) / 1e9
    del src, dst
    m = 8192 if bench.device.type == "cuda" else 512
    a = torch.randn(m, m, dtype=torch.bfloat16, device=bench.device)
    b = torch.randn(m, m, dtype=torch.bfloat16, device=bench.device)
    a @ b
    bench.sync()
    reps = 20 if bench.device.type == "cuda" else 2
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    bench.sync()
    bench.matmul_tflops = 2 * m ** 3 * reps / (time.perf_counter() - t0) / 1e12
    row("device copy", f"{bench.copy_gbs:,.0f} GB/s", "PERF.md: 4,168 GB/s")
    row(f"bf16 matmul {m}^3", f"{bench.matmul_tflops:,.0f} TFLOP/s", "PERF.md: 778 TFLOP/s")


def load_runner(bench: Bench) -> None:
    from mixserve.runner.model_runner import ModelRunner

    t0 = time.monotonic()
    num_blocks = 256 * 34 + 64 if not bench.tiny else 512
    bench.runner = runner = ModelRunner.from_pretrained(
        str(bench.model_dir), num_blocks=num_blocks, block_size=BLOCK_SIZE, device=str(bench.device),
        dtype=bench.dtype, attention_backend="gpu" if bench.tiny else "auto",  # tiny: gpu on a CPU
        cuda_graphs=bench.cuda_graphs, max_num_seqs=256)
    row("runner", f"loaded in {time.monotonic() - t0:.1f} s", "", attention_note(runner))


def kernels_row(bench: Bench) -> None:
    """Whether the fused Triton kernels run here (they need CUDA and triton)."""
    from mixserve import kernels

    probe = torch.empty(0, device=bench.device)
    on = kernels.use_triton(probe)
    version = "missing"
    if kernels.triton_importable():
        import triton

        version = triton.__version__
    reason = getattr(bench.runner, "kernels_off_reason", None)
    note = f"self-check FAILED, turned off: {reason}" if reason else "MIXSERVE_TRITON=0 turns them off"
    row("triton kernels", "on" if on else "off", "", f"triton {version}; {note}")
