"""The C++ layer ops of the CPU set (mixserve/model/cpu/layer_ops.py) against the torch set they replace, on
the native build and the AVX2 one (conftest.py)."""

from __future__ import annotations

import pytest
import torch

from mixserve.model import ops
from mixserve.model.cpu import layer_ops
from mixserve.model.rope import apply_rotary

pytestmark = pytest.mark.usefixtures("kernel_build")

# fp32: only the order of float operations differs. bf16: we round once where torch rounds after each op,
# so results may differ by one bf16 ulp (2^-8 relative) on values of magnitude up to a few.
TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: {"rtol": 2 ** -7, "atol": 2 ** -6}}
ROWS = (1, 5, 200)  # 200 rows x 576 takes the threaded path


def _randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", ROWS)
def test_rms_norm_and_the_fused_residual_add(dtype: torch.dtype, rows: int) -> None:
    x, res = _randn(rows, 576, dtype=dtype, seed=1), _randn(rows, 576, dtype=dtype, seed=2)
    w = _randn(576, dtype=dtype, seed=3)
    torch.testing.assert_close(layer_ops.rms_norm(x, w, 1e-5), ops.rms_norm(x, w, 1e-5), **TOL[dtype])
    want_norm, want_sum = ops.add_rms_norm(x, res, w, 1e-5)
    residual = res.clone()
    got_norm, got_sum = layer_ops.add_rms_norm(x, residual, w, 1e-5)
    assert got_sum is residual  # the sum went into the residual stream in place
    torch.testing.assert_close(got_sum, want_sum, rtol=0, atol=0)  # one rounding either way
    torch.testing.assert_close(got_norm, want_norm, **TOL[dtype])


def test_rms_norm_of_strided_rows() -> None:
    x = _randn(6, 2 * 64, dtype=torch.float32, seed=4)[:, :64]  # rows 128 apart
    w = _randn(64, dtype=torch.float32, seed=5)
    torch.testing.assert_close(layer_ops.rms_norm(x, w, 1e-6), ops.rms_norm(x, w, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", ROWS)
def test_silu_and_mul(dtype: torch.dtype, rows: int) -> None:
    gate_up = 4 * _randn(rows, 2 * 1536, dtype=dtype, seed=rows)  # gates well into both tails
    torch.testing.assert_close(layer_ops.silu_and_mul(gate_up), ops.silu_and_mul(gate_up), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", ROWS)
def test_gelu_tanh_and_mul(dtype: torch.dtype, rows: int) -> None:
    gate_up = 4 * _randn(rows, 2 * 1536, dtype=dtype, seed=rows + 1)  # gates well into both tails
    got = layer_ops.gelu_tanh_and_mul(gate_up)
    torch.testing.assert_close(got, ops.gelu_tanh_and_mul(gate_up), **TOL[dtype])
    assert not torch.allclose(got, layer_ops.silu_and_mul(gate_up), **TOL[dtype])  # not SiLU by another name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_in_place_on_a_strided_view_at_absolute_positions(dtype: torch.dtype) -> None:
    t, hq, hkv, d = 7, 9, 3, 64
    qkv = _randn(t, (hq + 2 * hkv) * d, dtype=dtype, seed=6)
    qk = qkv[:, : (hq + hkv) * d].view(t, hq + hkv, d)  # strides (row of qkv, d, 1), as the layer has it
    v_before = qkv[:, (hq + hkv) * d :].clone()
    angles = torch.outer(torch.arange(4096, dtype=torch.float32), torch.rand(d // 2) * 0.5)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    positions = torch.tensor([0, 1, 2, 900, 901, 4095, 17])
    want = apply_rotary(qk.clone(), cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))
    layer_ops.rotary_(qk, cos, sin, positions)
    torch.testing.assert_close(qk, want, **TOL[dtype])
    assert torch.equal(qkv[:, (hq + hkv) * d :], v_before)  # v's columns untouched


def test_the_runner_runs_the_cpp_ops_on_the_cpu(tiny_model_dir) -> None:
    from mixserve import ModelRunner

    runner = ModelRunner.from_pretrained(str(tiny_model_dir), num_blocks=8, block_size=4)
    assert runner.ops.add_rms_norm is layer_ops.add_rms_norm
    assert runner.ops.silu_and_mul is layer_ops.silu_and_mul
