"""Fused Triton ops (mixserve/kernels: norm, activation, rope) against PyTorch, and the model's fused path.

On a CUDA machine they run on the GPU, bfloat16 included. Without CUDA they run on CPU tensors through
Triton's interpreter (TRITON_INTERPRET=1, set in tests/conftest.py), so shapes stay small; bfloat16 is
left out there: the interpreter's bfloat16 is broken.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from mixserve.core.batch import ForwardBatch, ForwardSeq  # noqa: E402
from mixserve.kernels import activation  # noqa: E402
from mixserve.kernels.activation import silu_and_mul, silu_and_mul_reference  # noqa: E402
from mixserve.kernels.norm import (  # noqa: E402
    add_rms_norm,
    add_rms_norm_reference,
    rms_norm,
    rms_norm_reference,
)
from mixserve.kernels.rope import rotary_qk_, rotary_qk_reference  # noqa: E402
from mixserve.model import ops as model_ops  # noqa: E402
from mixserve.model.rope import apply_rotary  # noqa: E402

ON_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_CUDA else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_CUDA else [])
EPS = 1e-5


def _rows(tokens: int, hidden: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """(T, H) rows whose scales span 1e-3 .. 3, so eps matters on the small ones."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-3, 0.5, tokens).unsqueeze(1)
    return (torch.randn(tokens, hidden, generator=g) * scale).to(DEVICE, dtype)


def _weight(hidden: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(99)
    return (1.0 + 0.3 * torch.randn(hidden, generator=g)).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "hidden"), [(1, 576), (37, 96), (5, 8192)])
def test_rms_norm_matches_the_model(dtype: torch.dtype, tokens: int, hidden: int) -> None:
    x, w = _rows(tokens, hidden, dtype, seed=1), _weight(hidden, dtype)
    expected = model_ops.rms_norm(x, w, EPS)
    assert torch.equal(rms_norm_reference(x, w, EPS), expected)
    out = rms_norm(x, w, EPS)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "hidden"), [(1, 96), (37, 576)])
def test_add_rms_norm_adds_in_the_dtype_then_normalises(dtype: torch.dtype, tokens: int, hidden: int) -> None:
    x, residual, w = _rows(tokens, hidden, dtype, 2), _rows(tokens, hidden, dtype, 3), _weight(hidden, dtype)
    x_before, residual_before = x.clone(), residual.clone()
    out, residual_out = add_rms_norm(x, residual, w, EPS)
    assert torch.equal(residual_out, x_before + residual_before)  # rounded once, like the eager add
    torch.testing.assert_close(out, model_ops.rms_norm(x_before + residual_before, w, EPS))
    ref_out, ref_residual = add_rms_norm_reference(x_before, residual_before, w, EPS)
    assert torch.equal(ref_residual, residual_out)
    assert torch.equal(ref_out, model_ops.rms_norm(ref_residual, w, EPS))
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)  # inputs left alone


def test_rms_norm_reads_rows_by_their_stride() -> None:
    wide = _rows(7, 200, torch.float32, seed=4)
    x = wide[:, 50:146]  # (7, 96), row stride 200
    w = _weight(96, torch.float32)
    torch.testing.assert_close(rms_norm(x, w, EPS), model_ops.rms_norm(x.contiguous(), w, EPS))


def test_norm_rejects_what_it_cannot_read() -> None:
    w = _weight(96, torch.float32)
    with pytest.raises(ValueError, match="contiguous rows"):
        rms_norm(torch.zeros(96, 4, device=DEVICE).t(), w, EPS)
    with pytest.raises(ValueError, match="above the kernel"):
        rms_norm(torch.zeros(1, 8200, device=DEVICE), torch.ones(8200, device=DEVICE), EPS)
    with pytest.raises(ValueError, match="must match"):
        half = torch.zeros(2, 96, device=DEVICE, dtype=torch.float16)
        add_rms_norm(torch.zeros(2, 96, device=DEVICE), half, w, EPS)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "inter", "max_block"), [(1, 576, 1024), (37, 96, 1024), (3, 96, 64)])
def test_silu_and_mul_matches_eager(dtype: torch.dtype, tokens: int, inter: int, max_block: int,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(activation, "MAX_BLOCK", max_block)  # 64: two column programs, the last ragged
    g = torch.Generator().manual_seed(5)
    gate_up = (3 * torch.randn(tokens, 2 * inter, generator=g)).to(DEVICE, dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    assert torch.equal(silu_and_mul_reference(gate_up), expected)
    out = silu_and_mul(gate_up)
    assert out.shape == (tokens, inter) and out.dtype == dtype
    torch.testing.assert_close(out, expected)


def _tables(max_pos: int, half: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """RotaryTable-style cos/sin (max_pos, D/2) in the model dtype."""
    inv = 1.0 / (10000.0 ** (torch.arange(half, dtype=torch.float32) / half))
    angles = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv)
    return angles.cos().to(DEVICE, dtype), angles.sin().to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "q_heads", "kv_heads", "head_dim"), [(1, 4, 2, 16), (37, 6, 2, 24)])
def test_rotary_in_place_on_views_of_one_qkv_buffer(dtype: torch.dtype, tokens: int, q_heads: int,
                                                     kv_heads: int, head_dim: int) -> None:
    g = torch.Generator().manual_seed(6)
    q_size, kv_size = q_heads * head_dim, kv_heads * head_dim
    qkv = torch.randn(tokens, q_size + 2 * kv_size, generator=g).to(DEVICE, dtype)
    q = qkv[:, :q_size].view(tokens, q_heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(tokens, kv_heads, head_dim)
    assert q.stride()[1:] == k.stride()[1:] == (head_dim, 1) and q.data_ptr() == qkv.data_ptr()
    cos, sin = _tables(100, head_dim // 2, dtype)
    positions = torch.randperm(100, generator=g)[:tokens]  # out of order
    positions[tokens // 2] = positions[0]  # and one repeated
    positions = positions.to(DEVICE)
    before = qkv.clone()
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    expected_q, expected_k = apply_rotary(q.clone(), c, s), apply_rotary(k.clone(), c, s)
    ref_q, ref_k = rotary_qk_reference(q, k, cos, sin, positions)
    assert torch.equal(ref_q, expected_q) and torch.equal(ref_k, expected_k)

    rotary_qk_(q, k, cos, sin, positions)
    torch.testing.assert_close(q, expected_q)
    torch.testing.assert_close(k, expected_k)
    assert torch.equal(qkv[:, q_size + kv_size :], before[:, q_size + kv_size :])  # v untouched


def test_rotary_on_separate_contiguous_q_and_k() -> None:
    g = torch.Generator().manual_seed(7)
    q, k = torch.randn(5, 3, 8, generator=g).to(DEVICE), torch.randn(5, 1, 8, generator=g).to(DEVICE)
    cos, sin = _tables(16, 4, torch.float32)
    positions = torch.tensor([9, 0, 15, 3, 3], device=DEVICE)
    expected_q, expected_k = rotary_qk_reference(q, k, cos, sin, positions)
    rotary_qk_(q, k, cos, sin, positions)
    torch.testing.assert_close(q, expected_q)
    torch.testing.assert_close(k, expected_k)


def _two_mixed_steps() -> list[ForwardBatch]:
    """Step 1: a 6-token prompt and a first chunk; step 2: a decode beside two chunks (positions unsorted)."""
    return [
        ForwardBatch([ForwardSeq("a", [5, 17, 42, 8, 99, 3], 0, [7, 2]),
                      ForwardSeq("b", [11, 12, 13, 14, 15], 0, [0, 5, 9])]),
        ForwardBatch([ForwardSeq("c", [21, 22, 23], 0, [4]),
                      ForwardSeq("a", [250], 6, [7, 2]),
                      ForwardSeq("b", [16, 17, 18, 19], 5, [0, 5, 9])]),
    ]


MODEL_TOLERANCE = {"float32": 2e-5, "float16": 5e-3, "bfloat16": 5e-2}


@pytest.mark.parametrize("dtype", ["float32", "float16"] + (["bfloat16"] if ON_CUDA else []))
def test_model_fused_path_matches_eager(tiny_model_dir: Path, dtype: str,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from mixserve.kernels import norm
    from mixserve.runner import ModelRunner

    runner = ModelRunner.from_pretrained(str(tiny_model_dir), num_blocks=12, block_size=4, device=DEVICE,
                                         dtype=dtype, attention_backend="torch", cuda_graphs=False)
    # Only the model's ops change (the runner decided them at start-up): the attention stays as it is.
    runner.model.prepare(model_ops.torch_ops())
    eager = [runner.forward(batch).clone() for batch in _two_mixed_steps()]

    calls = []
    real = norm.add_rms_norm
    monkeypatch.setattr(norm, "add_rms_norm", lambda *a: calls.append(1) or real(*a))
    runner.model.prepare(model_ops.triton_ops.__wrapped__())  # a fresh set: it takes the spy above
    fused = [runner.forward(batch).clone() for batch in _two_mixed_steps()]

    assert calls  # the fused path ran
    tol = dict(rtol=MODEL_TOLERANCE[dtype], atol=MODEL_TOLERANCE[dtype])
    for e, f in zip(eager, fused, strict=True):
        assert f.shape == e.shape
        torch.testing.assert_close(f, e, **tol)


@pytest.mark.skipif(ON_CUDA, reason="guards CPU-only machines")
def test_cpu_forward_never_imports_triton(tiny_model_dir: Path) -> None:
    code = (
        "import sys; from mixserve.runner import ModelRunner; from mixserve.core.batch import ForwardBatch, "
        "ForwardSeq\n"
        f"r = ModelRunner.from_pretrained({str(tiny_model_dir)!r}, num_blocks=4, block_size=4)\n"
        "r.forward(ForwardBatch([ForwardSeq('a', [1, 2, 3], 0, [0])]))\n"
        "assert 'triton' not in sys.modules, 'triton was imported on the CPU path'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_model_wider_than_the_norm_kernel_keeps_the_eager_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    from mixserve import kernels

    monkeypatch.setattr(kernels, "use_triton", lambda t: True)  # as on CUDA with triton
    cpu = torch.device("cpu")
    assert model_ops.select_ops(cpu, torch.float32, kernels.NORM_MAX_HIDDEN).triton
    wide = model_ops.select_ops(cpu, torch.float32, kernels.NORM_MAX_HIDDEN + 1)
    assert not wide.triton  # a row the norm kernel cannot hold: the eager layers run
