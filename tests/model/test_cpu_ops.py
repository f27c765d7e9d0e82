"""The CPU layer ops (mixserve/model/ops.py): prepacked MKL (float32) and oneDNN linears against F.linear, the
runner's choice of ops, the fallback without oneDNN, and the CPU feature check behind the bf16 log line."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from mixserve.model import ops
from mixserve.model.cpu import mkl_linear
from tests.model.bf16_check import assert_bf16_linear_close

ROWS = (1, 3, 4, 17, 64, 300)  # 1 and 3: below fp32's F.linear threshold; the rest packed
# float32 takes MKL's packed GEMM on an AVX-512 CPU, oneDNN's on an AVX2 one (mkl_linear.unavailable)
MKL_HERE = mkl_linear.unavailable() is None
FP32_SET = "cpu-mkl-float32+cpp" if MKL_HERE else "cpu-onednn-float32+cpp"
FP32_PACKED = mkl_linear.MklPacked if MKL_HERE else ops.PackedWeight


def _weights(n: int, k: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    return w, (0.1 * torch.randn(n, generator=g)).to(dtype)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_f_linear_fp32(rows: int, bias: bool) -> None:
    cpu = ops.cpu_ops(torch.float32)
    assert cpu.name == FP32_SET
    w, b = _weights(960, 576, torch.float32)
    packed = cpu.pack(w)
    assert isinstance(packed, FP32_PACKED)
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows))
    want = F.linear(x, w, b if bias else None)
    got = cpu.linear(x, packed, b if bias else None)
    # Only the summation order differs from MKL's sgemm: a few ulps of fp32 on K=576 products.
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    mkl = mkl_linear.pack(w)  # MKL's path itself, whichever the CPU takes
    torch.testing.assert_close(mkl_linear.linear(x, mkl, b if bias else None), want, rtol=1e-5, atol=1e-5)
    # A strided input (a view of wider rows) gives the same
    wide = torch.cat([x, torch.ones(rows, 7)], dim=1)[:, :576]
    torch.testing.assert_close(cpu.linear(wide, packed, None), F.linear(x, w), rtol=1e-5, atol=1e-5)
    # The oneDNN path (bf16's, and float32's where MKL is missing): every row count through oneDNN itself
    dnn = ops._pack(w, dtype=torch.float32)
    assert dnn.packed.is_mkldnn
    torch.testing.assert_close(ops._packed_linear(x, dnn, b if bias else None), want, rtol=1e-5, atol=1e-5)
    raw = torch.ops.mkldnn._linear_pointwise(x, dnn.packed, b if bias else None, "none", [], "")
    torch.testing.assert_close(raw, want, rtol=1e-5, atol=1e-5)


def test_without_mkl_float32_takes_onednn(monkeypatch) -> None:
    monkeypatch.setattr(mkl_linear, "unavailable", lambda: "no MKL here")
    cpu = ops.cpu_ops(torch.float32)
    assert cpu.name == "cpu-onednn-float32+cpp"
    assert isinstance(cpu.pack(torch.ones(8, 8)), ops.PackedWeight)


def test_mkl_packed_gemm_passes_its_start_up_check_here() -> None:
    assert mkl_linear.broken() is None
    # taken on Intel's AVX-512 CPUs; on others oneDNN's is faster, and the reason names the CPU
    cpu = ops.cpu_features()
    intel_avx512 = cpu.vendor == "GenuineIntel" and cpu.capability.startswith("AVX512")
    assert MKL_HERE == intel_avx512
    assert intel_avx512 or ("slower than oneDNN's" in mkl_linear.unavailable()
                            and cpu.capability in mkl_linear.unavailable())


@pytest.mark.parametrize("rows", ROWS)
def test_packed_linear_bf16_within_bf16_rounding(rows: int) -> None:
    cpu = ops.cpu_ops(torch.bfloat16)
    w, b = _weights(3072, 576, torch.bfloat16)
    packed = cpu.pack(w)
    if ops.mkldnn_linear_available(torch.bfloat16) is None:
        assert packed.min_rows == 2  # bf16: packed from 2 rows (1 row is a GEMV)
    else:  # oneDNN has no bf16 linear without AVX-512 (or AVX-NE-CONVERT): torch's set, plain weights
        assert cpu.name == "torch" and packed is w
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    # fp32 accumulation, then one rounding of the output to bf16 (2^-8 relative) and of the bias add:
    # a few bf16 ulps of the output's scale (|y| ~ 1 here).
    assert_bf16_linear_close(cpu.linear(x, packed, b), x, w, b, tol=1.6e-2, mean_tol=4e-3)


def test_the_lm_head_is_packed_from_two_rows() -> None:
    # (one row is a GEMV on the plain weight, whatever its size; the threshold then only matters from 2)
    w, _ = _weights(49152, 576, torch.float32)
    assert ops._pack(w, dtype=torch.float32).min_rows == 2  # (oneDNN's float32 path)
    assert ops._pack(w[:960], dtype=torch.float32).min_rows == ops._MIN_ROWS[torch.float32]


def test_the_runner_packs_the_tiny_model_on_cpu(tiny_model_dir: Path) -> None:
    from mixserve.runner import ModelRunner

    runner = ModelRunner.from_pretrained(str(tiny_model_dir), num_blocks=8, block_size=4)
    assert runner.ops.name == FP32_SET
    assert runner.model.ops is runner.ops
    assert runner.cpu_features is not None
    layer = runner.model.layers[0]
    for w in (layer.packed.qkv, layer.packed.o_proj, layer.mlp.packed.gate_up, layer.mlp.packed.down):
        assert isinstance(w, FP32_PACKED)
    assert isinstance(runner.model.head.lm_head, FP32_PACKED)
    # The parameters (state dict, weight bytes) are still just the loaded weights, once each.
    names = [n for n, _ in runner.model.named_parameters()]
    assert not any("packed" in n or "head." in n for n in names)


def test_fp16_on_cpu_runs_the_torch_ops_without_a_warning(recwarn: pytest.WarningsRecorder) -> None:
    assert ops.cpu_ops(torch.float16) is ops.torch_ops()
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


def test_without_onednn_the_cpu_falls_back_to_f_linear_with_one_warning(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    with pytest.warns(RuntimeWarning, match="oneDNN") as caught:
        chosen = ops.select_ops(torch.device("cpu"), torch.float32, 576)
    assert len(caught) == 1
    assert chosen is ops.torch_ops()


def test_missing_mkldnn_ops_fall_back(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(*args: object) -> None:
        raise AttributeError("'_OpNamespace' 'mkldnn' object has no attribute '_reorder_linear_weight'")

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", missing)
    reason = ops.mkldnn_linear_available(torch.float32)
    assert reason is not None and "AttributeError" in reason
    with pytest.warns(RuntimeWarning, match="_reorder_linear_weight"):
        assert ops.cpu_ops(torch.float32) is ops.torch_ops()


@pytest.mark.parametrize(
    ("flags", "fast"),
    [("fpu sse2 avx2 fma", False), ("avx2 avx512f avx512_bf16", True),
     ("avx2 avx512f amx_bf16 amx_tile", True)],
)
def test_cpu_features_and_the_bf16_log_line(tmp_path: Path, flags: str, fast: bool,
                                            caplog: pytest.LogCaptureFixture) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: test\nflags\t\t: {flags}\n\n"
                    f"processor\t: 1\nvendor_id\t: AuthenticAMD\nflags\t: {flags}\n")
    features = ops.cpu_features.__wrapped__(str(info))
    assert features.fast_bf16 is fast and features.vendor == "AuthenticAMD"
    with caplog.at_level(logging.WARNING, logger="mixserve"):
        assert ops.log_bf16_on_cpu(features, torch.float32) is False  # fp32: nothing to say
        assert ops.log_bf16_on_cpu(features, torch.bfloat16) is not fast
    lines = [r.getMessage() for r in caplog.records if r.name == "mixserve"]
    if fast:
        assert lines == []
    else:
        assert len(lines) == 1 and "AVX512-BF16 or AMX" in lines[0] and "not faster" in lines[0]


@pytest.mark.parametrize(("vendor", "capability", "mkl"), [
    ("GenuineIntel", "AVX512", True), ("GenuineIntel", "AVX2", False), ("AuthenticAMD", "AVX512", False),
    ("AuthenticAMD", "AVX2", False), ("", "AVX512", False)])
def test_mkl_takes_the_float32_linears_only_on_intels_avx512_cpus(
        monkeypatch: pytest.MonkeyPatch,
        vendor: str, capability: str, mkl: bool) -> None:
    if mkl_linear.broken() is not None:
        pytest.skip(f"MKL's packed GEMM is not usable in this torch: {mkl_linear.broken()}")
    fake = ops.CpuFeatures(avx512_bf16=False, amx_bf16=False, capability=capability, vendor=vendor)
    monkeypatch.setattr(ops, "cpu_features", lambda: fake)
    why = mkl_linear.unavailable.__wrapped__()  # the cached answer is this CPU's
    assert (why is None) == mkl
    assert mkl or (capability in why and (vendor or "vendor unknown") in why)


def test_this_machines_flags_are_read() -> None:
    features = ops.cpu_features()
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    assert features.amx_bf16 == (" amx_bf16" in flags)
    assert features.avx512_bf16 == (" avx512_bf16" in flags)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_runner_says_once_why_bf16_is_slow_on_an_avx2_cpu(tiny_model_dir: Path, dtype: str,
                                                              monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    from mixserve.runner import model_runner

    avx2 = ops.CpuFeatures(avx512_bf16=False, amx_bf16=False, capability="AVX2")
    monkeypatch.setattr(model_runner, "cpu_features", lambda: avx2)
    with caplog.at_level(logging.INFO, logger="mixserve"):
        runner = model_runner.ModelRunner.from_pretrained(str(tiny_model_dir), num_blocks=8, block_size=4,
                                                          dtype=dtype)
    assert runner.cpu_features is avx2
    lines = [r.getMessage() for r in caplog.records if "bfloat16 on this CPU" in r.getMessage()]
    assert len(lines) == (1 if dtype == "bfloat16" else 0)
    if lines:
        assert "AVX2" in lines[0] and "float32" in lines[0]
