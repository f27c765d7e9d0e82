"""The experts' C++ loop (cpu/moe_experts.py) against the Python loop it replaces: the same kernels, so the
same bits, for float32 and bf16 panels; experts with more rows than the few-row kernels take are left to the
Python loop; and the loop is planned wherever the CPU ops packed the experts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mixserve import ModelRunner
from mixserve.model.cpu import few_row_linear
from mixserve.model.moe import SparseMlp, route
from tests.gguf_writer import make_hf_folder


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if few_row_linear.panel_width() == 0:
        pytest.skip("no few-row panels in this build")
    return make_hf_folder(tmp_path_factory.mktemp("moe") / "hf", "qwen3moe")


def both_loops(runner: ModelRunner, tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer's experts on random rows: (C++ loop, Python loop, the experts each row chose)."""
    model = runner.model
    mlp = model.layers[1].mlp
    assert isinstance(mlp, SparseMlp) and mlp.native is not None  # planned for the CPU ops' packed experts
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, model.config.hidden_size, generator=g).to(model.dtype)
    with torch.inference_mode():
        logits = model.ops.linear(x, mlp.packed.router, None)
        weights, experts = route(logits, mlp.top_k, mlp.renormalise, mlp.weights_dtype)
        native = mlp.grouped(x, weights, experts, model.ops)
        table, mlp.native = mlp.native, None
        try:
            python = mlp.grouped(x, weights, experts, model.ops)
        finally:
            mlp.native = table
    return native, python, experts


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tokens", [1, 3, 17])
def test_native_loop_equals_the_python_loop(moe_folder: Path, dtype: str, tokens: int) -> None:
    if dtype == "bfloat16" and few_row_linear.pack(torch.zeros(64, 64, dtype=torch.bfloat16)) is None:
        pytest.skip("bf16 panels need AVX512-BF16 in the build")
    runner = ModelRunner.from_pretrained(str(moe_folder), num_blocks=16, block_size=4, dtype=dtype,
                                         device="cpu")
    native, python, _ = both_loops(runner, tokens)
    assert native.dtype == python.dtype == getattr(torch, dtype)
    assert torch.equal(native, python)


def test_experts_past_the_few_row_kernels_fall_back(moe_folder: Path) -> None:
    runner = ModelRunner.from_pretrained(str(moe_folder), num_blocks=16, block_size=4, dtype="float32",
                                         device="cpu")
    mlp = runner.model.layers[1].mlp
    most = min(int(w.max_rows) for w in (*mlp.native.gate_up, *mlp.native.down))
    tokens = 2 * most * mlp.num_experts // mlp.top_k  # about twice the rows an expert's kernels take
    native, python, experts = both_loops(runner, tokens)
    assert torch.equal(native, python)
    counts = torch.bincount(experts.flatten(), minlength=mlp.num_experts)
    assert int(counts.max()) > most  # so at least one expert took the Python loop's GEMMs
