"""The check the CPU bf16 linear tests share: a bf16 result against float32 sums of the same bf16 inputs."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def assert_bf16_linear_close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor,
                             tol: float, mean_tol: float) -> None:
    """got = a bf16 linear of bf16 x, w, b: within `tol` of F.linear in float32 on the same inputs (each
    element), and within `mean_tol` on average (a rounding, not a wrong sum, should separate them)."""
    assert got.dtype == torch.bfloat16
    exact = F.linear(x.float(), w.float(), b.float())
    torch.testing.assert_close(got.float(), exact, rtol=tol, atol=tol)
    assert float((got.float() - exact).abs().mean()) < mean_tol
