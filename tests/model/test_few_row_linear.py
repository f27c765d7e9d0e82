"""The few-row linear (mixserve/model/cpu/few_row_linear.py): equal to F.linear at every row count it takes,
odd shapes included, in float32 (AVX-512 or AVX2 panels) and (on CPUs with AVX512-BF16; AMX tiles where there
are) bf16; the CPU ops send decode-sized GEMMs to it and bigger ones to MKL / oneDNN; without the kernel
(neither AVX-512 nor AVX2 with FMA) nothing is packed. Each test runs on the native build and the AVX2 one
(conftest.py): on the AVX2 build bf16 takes oneDNN's GEMM at every row count."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mixserve.model import ops
from mixserve.model.cpu import build, few_row_linear, mkl_linear
from tests.model.bf16_check import assert_bf16_linear_close

pytestmark = pytest.mark.usefixtures("kernel_build")


def bf16_panels() -> bool:
    """The loaded build packs bf16 weights (it has AVX512-BF16)."""
    return few_row_linear.pack(torch.ones(64, 64, dtype=torch.bfloat16)) is not None


@pytest.fixture
def panels() -> None:
    if few_row_linear.panel_width() == 0:
        pytest.skip("the few-row kernel needs AVX-512 or AVX2 with FMA")


def _case(n: int, k: int, rows: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=g) / k**0.5, 0.1 * torch.randn(n, generator=g),
            torch.randn(rows, k, generator=g))


@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (37, 45), (130, 7), (64, 64)])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 13, 31, 32])
def test_panels_equal_f_linear(panels: None, n: int, k: int, rows: int) -> None:
    w, b, x = _case(n, k, rows, seed=rows)
    packed = few_row_linear.pack(w)
    assert packed is not None and packed.panels.numel() % (few_row_linear.panel_width() * k) == 0
    # float32 sums in another order than MKL's: a few ulps of K products
    torch.testing.assert_close(few_row_linear.linear(x, packed, None), F.linear(x, w), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(few_row_linear.linear(x, packed, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    wide = torch.cat([x, torch.ones(rows, 5)], dim=1)[:, :k]  # rows of a wider tensor: stride > k
    got = few_row_linear.linear(wide, packed, None)
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-5)


# k a multiple of 32 takes AMX tiles where the CPU has them (up to 64 rows, in passes of 32), others the
# vdpbf16ps pass (8 rows beside oneDNN's AMX GEMM; 256 where the CPU has no AMX)
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (100, 64), (37, 46), (130, 8)])
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 8, 9, 16, 17, 31, 32, 33, 48, 50, 64])
def test_bf16_panels_within_one_bf16_rounding(n: int, k: int, rows: int) -> None:
    if not bf16_panels():
        assert "avx512_bf16" not in build.kernel_isa()  # only a build without vdpbf16ps packs no bf16
        pytest.skip("bf16 panels need AVX512-BF16 in the build")
    w, b, x = (t.to(torch.bfloat16) for t in _case(n, k, rows, seed=rows))
    packed = few_row_linear.pack(w)
    assert packed is not None
    amx = "amx_bf16" in build.kernel_isa()
    assert packed.max_rows == ((64 if k % 32 == 0 else 8) if amx else 256)
    # (the kernel takes any row count; max_rows is where the linears stop sending it rows)
    # products of two bf16 are exact in float32; the sums are float32's; one rounding to bf16 at the end
    # (2^-8 relative): within 1 bf16 ulp of |y| (~1 here) and far closer on average.
    assert_bf16_linear_close(few_row_linear.linear(x, packed, b), x, w, b, tol=8e-3, mean_tol=2e-3)


def test_odd_k_in_bf16_is_left_to_onednn() -> None:
    assert few_row_linear.pack(torch.ones(64, 45, dtype=torch.bfloat16)) is None  # vdpbf16ps takes k in pairs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_ops_route_few_rows_to_the_panels_and_more_to_the_gemm(
        panels: None, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    if dtype == torch.bfloat16 and ops.mkldnn_linear_available(dtype) is not None:
        # oneDNN has no bf16 linear here (AVX2, or held to it): the CPU set is torch's, weights stay plain
        cpu = ops.cpu_ops(dtype)
        assert cpu.name == "torch"
        w, b, _ = (t.to(dtype) for t in _case(960, 576, 1))
        x = torch.randn(7, 576).to(dtype)
        assert_bf16_linear_close(cpu.linear(x, cpu.pack(w), b), x, w, b, tol=8e-3, mean_tol=2e-3)
        return
    if dtype == torch.bfloat16 and not bf16_panels():
        # the AVX2 build: bf16 keeps oneDNN's linear at every row count, as exact as one rounding
        cpu = ops.cpu_ops(dtype)
        w, b, _ = (t.to(dtype) for t in _case(960, 576, 1))
        packed = cpu.pack(w)
        assert packed.few is None
        for rows in (1, 7, 32):
            x = torch.randn(rows, 576).to(dtype)
            assert_bf16_linear_close(cpu.linear(x, packed, b), x, w, b, tol=8e-3, mean_tol=2e-3)
        return
    cpu = ops.cpu_ops(dtype)
    w, b, _ = (t.to(dtype) for t in _case(960, 576, 1))
    packed = cpu.pack(w)
    fp32 = mkl_linear.MklPacked if mkl_linear.unavailable() is None else ops.PackedWeight
    assert isinstance(packed, fp32 if dtype == torch.float32 else ops.PackedWeight)
    assert packed.few is not None
    seen: list[int] = []
    real = few_row_linear.linear

    def spy(x: torch.Tensor, pw: few_row_linear.PanelWeight, bias: torch.Tensor | None) -> torch.Tensor:
        seen.append(x.shape[0])
        return real(x, pw, bias)

    monkeypatch.setattr(few_row_linear, "linear", spy)
    most = packed.few.max_rows
    for rows in (1, most, most + 1, most + 100):
        x = torch.randn(rows, 576).to(dtype)
        tol = 1e-5 if dtype == torch.float32 else 8e-3
        want = F.linear(x.float(), w.float(), b.float())
        torch.testing.assert_close(cpu.linear(x, packed, b).float(), want, rtol=tol, atol=tol)
    assert seen == [1, most]  # more rows than that run MKL's (oneDNN's) packed GEMM
    if dtype == torch.float32:  # 128 rows against oneDNN (few_row_simd.h), 32 where MKL takes the rest
        assert most == (mkl_linear.MKL_FEW_ROWS if fp32 is mkl_linear.MklPacked else 128)


def test_without_the_kernel_the_gemm_takes_every_row_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(few_row_linear, "panel_width", lambda: 0)
    w, b, x = _case(960, 576, 3)
    cpu = ops.cpu_ops(torch.float32)
    packed = cpu.pack(w)
    assert packed.few is None
    torch.testing.assert_close(cpu.linear(x, packed, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_float16_is_not_packed() -> None:
    assert few_row_linear.pack(torch.ones(64, 64, dtype=torch.float16)) is None
