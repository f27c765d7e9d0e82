"""The whole CUDA path — the gpu attention backend (asked for as flex), fused model, every Triton kernel
(the varlen kernel for mixed steps, flash-decoding for decode-only ones) — run on the CPU through Triton's
interpreter, step by step equal to the plain PyTorch runner (torch attention, no kernels)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mixserve import kernels
from mixserve.core import ForwardBatch, ForwardSeq
from mixserve.runner import ModelRunner
from tests.kernels.test_fused_ops import _two_mixed_steps


def _steps() -> list[ForwardBatch]:
    """Two mixed steps, then a decode-only step (the gpu backend's Triton decode part)."""
    decodes = ForwardBatch([ForwardSeq("a", [31], 7, [7, 2]), ForwardSeq("b", [32], 9, [0, 5, 9]),
                            ForwardSeq("c", [33], 3, [4])])
    return [*_two_mixed_steps(), decodes]


def _run(path: Path, backend: str, ops: str) -> list[torch.Tensor]:
    runner = ModelRunner.from_pretrained(str(path), num_blocks=12, block_size=4, device="cpu",
                                         dtype="float32", attention_backend=backend, cuda_graphs=False)
    assert runner.ops.name.startswith(ops)
    return [runner.forward(batch).clone() for batch in _steps()]


def test_cuda_path_equals_the_torch_runner(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reference = _run(tiny_model_dir, "torch", "cpu")
    launched: list[str] = []
    from mixserve.kernels import paged_attention, varlen_attention

    for module, name in ((paged_attention, "paged_decode_attention"), (paged_attention, "store_kv"),
                         (varlen_attention, "paged_varlen_attention")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name,
                            lambda *a, _real=real, _name=name, **k: launched.append(_name) or _real(*a, **k))
    # As on CUDA with triton: the runner then picks the Triton layer ops at start-up too.
    monkeypatch.setattr(kernels, "use_triton", lambda t: True)
    cuda_path = _run(tiny_model_dir, "flex", "triton")
    assert {"paged_decode_attention", "store_kv", "paged_varlen_attention"} <= set(launched)
    for want, got in zip(reference, cuda_path, strict=True):
        torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-4)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
