"""The start-up self-check passes on working kernels and names the first one that breaks."""

from __future__ import annotations

import pytest
import torch

from mixserve.kernels import norm, rope, self_check


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_working_kernels_pass(dtype: torch.dtype) -> None:
    assert self_check.self_check("cpu", dtype) is None


def test_a_wrong_kernel_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(norm, "rms_norm", lambda x, w, eps: torch.zeros_like(x))
    reason = self_check.self_check("cpu", torch.float32)
    assert reason is not None and reason.startswith("norms: AssertionError: rms_norm: relative error")


def test_a_kernel_that_fails_to_build_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object) -> None:
        raise RuntimeError("PassManager::run failed\n  (a multi-line compiler error)")

    monkeypatch.setattr(rope, "rotary_qk_", broken)
    reason = self_check.self_check("cpu", torch.float32)
    assert reason == "rope: RuntimeError: PassManager::run failed (a multi-line compiler error)"


def test_check_or_disable_turns_the_kernels_off(monkeypatch: pytest.MonkeyPatch) -> None:
    from mixserve import kernels

    monkeypatch.setattr(kernels, "use_triton", lambda t: True)  # as on a CUDA machine
    monkeypatch.setattr(norm, "rms_norm", lambda x, w, eps: torch.full_like(x, float("nan")))
    monkeypatch.setattr(kernels, "_enabled", True)
    message = "Triton kernels turned off, eager PyTorch ops run instead: norms"
    with pytest.warns(RuntimeWarning, match=message):
        assert self_check.check_or_disable("cpu", torch.float32) is not None
    assert kernels.enabled() is False
