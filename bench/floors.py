"""The floors the CPU benches print, measured the same way by each of them (issue "CPU fast path").

- copy bandwidth: 2 x bytes / time of a 512 MiB torch copy (read + write), best of 5;
- weight bytes: the model's parameter count (from its config, no weights loaded) x the dtype's size;
- GEMM rate: oneDNN fp32 (or bf16) on the model's own QKV and gate/up shapes at 256 rows;
- few-row rate: our decode linear (the panels, mixserve/model/cpu/few_row_linear.py) at its best row count
  on the gate/up shape, the weight in cache: the FMA rate a compute-bound decode step can reach;
- CPU flags: avx2, avx512f, avx512_bf16, amx_bf16 from /proc/cpuinfo and torch's CPU capability, and the
  ISA the C++ kernels were built for ($MIXSERVE_KERNEL_MARCH=haswell: the AVX2 code on any x86 CPU).

bench/offline.py prints them; bench/forward.py can too (a script in bench/ has bench/ on sys.path, so
`from floors import ...`; with the repository root on sys.path, `from bench.floors import ...`):

    from floors import floors, model_config   # or cpu_flags, copy_bandwidth, weight_bytes, gemm_rates
    f = floors(model_config(None), torch.float32)    # measures: a few seconds
    print("\n".join(f.lines()))                      # all four, one line each; dataclasses.asdict(f) for JSON

`python bench/floors.py [--model PATH] [--dtype bfloat16]` prints them alone.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from mixserve.model.config import ModelConfig  # noqa: E402

CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
COPY_BYTES = 512 << 20
GEMM_ROWS = 256


def cpu_flags() -> dict[str, object]:
    """The CPU's model name, the flags the fast paths depend on (True/False) and torch's CPU capability."""
    flags: set[str] = set()
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                name = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break  # every core lists the same flags
    except OSError:  # not Linux: torch's capability below still says what its kernels use
        pass
    out: dict[str, object] = {"cpu": name}
    out.update({f: f in flags for f in CPU_FLAGS})
    out["torch_capability"] = torch.backends.cpu.get_cpu_capability()
    out["onednn"] = torch.backends.mkldnn.is_available()
    return out


def has_fast_bf16(flags: dict[str, object]) -> bool:
    """bf16 beats fp32 on a CPU only with native bf16 dot products (AVX512-BF16) or AMX tiles."""
    return bool(flags.get("avx512_bf16") or flags.get("amx_bf16"))


def copy_bandwidth(nbytes: int = COPY_BYTES, repeats: int = 5) -> float:
    """Bytes/s of a torch copy of nbytes, read and write counted (2 x bytes / time), best of repeats."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)  # ones, not empty: the pages must exist before timing
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch of dst's pages outside the timing
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best


def model_config(model: str | None) -> ModelConfig:
    """The model's shape from its GGUF metadata or config.json (None = the default model); no weights read."""
    import json

    from mixserve.model.gguf_file import read_gguf
    from mixserve.model.loader import resolve_model_path

    path = resolve_model_path(model)
    if path.suffix.lower() == ".gguf":
        meta, tensors = read_gguf(path)
        vocab = int(tensors["token_embd.weight"].shape[0])
        return ModelConfig.from_gguf(meta, str(path), vocab_size=vocab, tied="output.weight" not in tensors)
    where = path / "config.json" if path.is_dir() else path
    return ModelConfig.from_hf(json.loads(where.read_text()), str(where))


def parameter_count(cfg: ModelConfig) -> int:
    """Parameters of a Llama-family decoder of this shape (a tied lm_head counted once)."""
    h, hd = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    attn = h * (q + 2 * kv) + q * h + (q + 2 * kv if cfg.qkv_bias else 0)
    mlp = 3 * h * cfg.intermediate_size
    layer = attn + mlp + 2 * h  # two RMSNorm weights
    embed = cfg.vocab_size * h
    return embed * (1 if cfg.tie_word_embeddings else 2) + cfg.num_layers * layer + h


def weight_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes every forward reads at least once: all parameters at dtype's size."""
    return parameter_count(cfg) * torch.empty(0, dtype=dtype).element_size()


@dataclass(frozen=True)
class GemmRate:
    name: str
    rows: int
    k: int
    n: int
    flops_per_s: float


def model_gemm_shapes(cfg: ModelConfig) -> list[tuple[str, int, int]]:
    """(name, k, n) of the model's fused QKV and gate/up projections (out = x[rows, k] @ W[k, n])."""
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    return [("qkv", cfg.hidden_size, qkv), ("gate_up", cfg.hidden_size, 2 * cfg.intermediate_size)]


def onednn_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T through oneDNN (the kernel inductor's CPU linears use), not torch's default MKL sgemm."""
    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [None], "")


def gemm_rates(cfg: ModelConfig, dtype: torch.dtype = torch.float32, rows: int = GEMM_ROWS,
               min_seconds: float = 0.3) -> list[GemmRate]:
    """FLOP/s of oneDNN on each of the model's GEMM shapes at `rows` rows; best of 3 timed runs. Empty where
    oneDNN has no linear for `dtype` on this CPU (bf16 without AVX-512 or AVX-NE-CONVERT)."""
    from mixserve.model.ops import mkldnn_linear_available

    if mkldnn_linear_available(dtype) is not None:
        return []
    out = []
    for name, k, n in model_gemm_shapes(cfg):
        x, w = torch.randn(rows, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
        onednn_linear(x, w)  # oneDNN builds its primitive on the first call: keep it out of the timing
        start, calls = time.perf_counter(), 0
        while time.perf_counter() - start < min_seconds / 3 or calls < 3:  # calls per timed run
            onednn_linear(x, w)
            calls += 1
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            for _ in range(calls):
                onednn_linear(x, w)
            best = min(best, (time.perf_counter() - start) / calls)
        out.append(GemmRate(name, rows, k, n, 2 * rows * k * n / best))
    return out


FEW_ROWS = (6, 12, 24, 30, 36, 48)


def few_row_rate(cfg: ModelConfig, dtype: torch.dtype = torch.float32,
                 min_seconds: float = 0.1) -> GemmRate | None:
    """FLOP/s of the few-row kernel on the gate/up shape at the best of FEW_ROWS (best of 3 timed runs each),
    the weight in cache; None where the build packs no weight of this dtype."""
    from mixserve.model.cpu import few_row_linear

    _, k, n = model_gemm_shapes(cfg)[1]
    packed = few_row_linear.pack(torch.randn(n, k, dtype=dtype))
    if packed is None:
        return None
    best: GemmRate | None = None
    for rows in FEW_ROWS:
        x = torch.randn(rows, k, dtype=dtype)
        few_row_linear.linear(x, packed, None)
        calls, start = 0, time.perf_counter()
        while time.perf_counter() - start < min_seconds / 3 or calls < 3:
            few_row_linear.linear(x, packed, None)
            calls += 1
        seconds = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            for _ in range(calls):
                few_row_linear.linear(x, packed, None)
            seconds = min(seconds, (time.perf_counter() - start) / calls)
        rate = GemmRate("few-row", rows, k, n, 2 * rows * k * n / seconds)
        if best is None or rate.flops_per_s > best.flops_per_s:
            best = rate
    return best


def kernels_line() -> str:
    from mixserve.model.cpu import build

    return build.describe()


@dataclass(frozen=True)
class Floors:
    """The four floors of one machine and model at one dtype (`dataclasses.asdict` gives the JSON)."""

    cpu_flags: dict[str, object]
    torch_threads: int
    copy_bandwidth_gb_s: float
    parameters: int
    weight_bytes: int
    dtype: str
    gemms: list[GemmRate]
    few_row: GemmRate | None = None
    kernels: str = ""

    def lines(self) -> list[str]:
        """One printable line per floor."""
        flags = self.cpu_flags
        names = " ".join(f"{k}={'yes' if flags[k] else 'no'}" for k in CPU_FLAGS)
        gb = self.weight_bytes / 1e9
        gemm = ", ".join(f"{g.name} {g.rows}x{g.k}x{g.n} {g.flops_per_s / 1e9:.1f} GFLOP/s"
                         for g in self.gemms) or "none on this CPU"
        return [
            f"cpu: {flags['cpu']}; {names}; torch capability {flags['torch_capability']}, "
            f"oneDNN {'yes' if flags['onednn'] else 'no'}, {self.torch_threads} torch threads",
            f"copy bandwidth (2 x 512 MiB / time, best of 5): {self.copy_bandwidth_gb_s:.1f} GB/s",
            f"weights: {self.parameters:,} parameters x {self.dtype} = {gb:.3f} GB "
            f"(>= {1e3 * gb / self.copy_bandwidth_gb_s:.1f} ms a forward at the copy bandwidth)",
            f"oneDNN {self.dtype} GEMM at {GEMM_ROWS} rows: {gemm}",
            f"C++ kernels {self.kernels}; few-row linear at its best shape: " + (
                f"{self.few_row.rows}x{self.few_row.k}x{self.few_row.n} {self.few_row.flops_per_s / 1e9:.1f} "
                "GFLOP/s" if self.few_row else "none for this dtype"),
        ]


def floors(cfg: ModelConfig, dtype: torch.dtype = torch.float32, copy_gb_s: float | None = None) -> Floors:
    """All four floors, measured now (the copy and the GEMMs: a few seconds); `copy_gb_s` reuses a copy
    bandwidth measured already, so two dtypes' lines divide by the same figure."""
    return Floors(
        cpu_flags=cpu_flags(),
        torch_threads=torch.get_num_threads(),
        copy_bandwidth_gb_s=copy_gb_s or copy_bandwidth() / 1e9,
        parameters=parameter_count(cfg),
        weight_bytes=weight_bytes(cfg, dtype),
        dtype=str(dtype).removeprefix("torch."),
        gemms=gemm_rates(cfg, dtype),
        few_row=few_row_rate(cfg, dtype),
        kernels=kernels_line(),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a GGUF file or HF folder (default: the default model)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print("\n".join(floors(model_config(args.model), getattr(torch, args.dtype)).lines()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
