"""The experts' C++ loop (cpu/moe_experts.py) against the Python loop it replaces: the same kernels, so the
same bits, for float32 and bf16 panels; experts with more rows than the few-row kernels take are left to the
Python loop, but float32 panels on AVX-512 take any rows; the C++ sort, gather and weighted sum equal torch's
bit for bit; and the loop is planned wherever the CPU ops packed the experts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mixserve import ModelRunner
from mixserve.model.cpu import few_row_linear, moe_experts
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
    if dtype == "bfloat16" and not _bf16_panels():
        pytest.skip("bf16 panels need AVX512-BF16 in the build")
    runner = ModelRunner.from_pretrained(str(moe_folder), num_blocks=16, block_size=4, dtype=dtype,
                                         device="cpu")
    native, python, _ = both_loops(runner, tokens)
    assert native.dtype == python.dtype == getattr(torch, dtype)
    assert torch.equal(native, python)


def _bf16_panels() -> bool:
    return few_row_linear.pack(torch.zeros(64, 64, dtype=torch.bfloat16)) is not None


def test_experts_past_the_few_row_kernels_fall_back(moe_folder: Path) -> None:
    dtype = "float32" if few_row_linear.panel_width() != moe_experts.F32_ANY_ROWS_WIDTH else "bfloat16"
    if dtype == "bfloat16" and not _bf16_panels():
        pytest.skip("float32 panels take any rows here, and bf16 ones need AVX512-BF16")
    runner = ModelRunner.from_pretrained(str(moe_folder), num_blocks=16, block_size=4, dtype=dtype,
                                         device="cpu")
    mlp = runner.model.layers[1].mlp
    most = min(int(w.max_rows) for w in (*mlp.native.gate_up, *mlp.native.down))
    tokens = 2 * most * mlp.num_experts // mlp.top_k  # about twice the rows an expert's kernels take
    native, python, experts = both_loops(runner, tokens)
    assert torch.equal(native, python)
    counts = torch.bincount(experts.flatten(), minlength=mlp.num_experts)
    assert int(counts.max()) > most  # so at least one expert took the Python loop's GEMMs


def test_float32_panels_take_a_prefill_chunks_rows(moe_folder: Path) -> None:
    if few_row_linear.panel_width() != moe_experts.F32_ANY_ROWS_WIDTH:
        pytest.skip("float32 panels take any rows on AVX-512 builds only")
    runner = ModelRunner.from_pretrained(str(moe_folder), num_blocks=16, block_size=4, dtype="float32",
                                         device="cpu")
    mlp = runner.model.layers[1].mlp
    tokens = 4 * 128 * mlp.num_experts // mlp.top_k  # past the 128 rows the dense linears send to panels
    native, python, experts = both_loops(runner, tokens)
    assert int(torch.bincount(experts.flatten()).max()) > 128
    x = torch.randn(tokens, runner.model.config.hidden_size)
    rows, bounds, _ = mlp.native.dispatch(x, experts)
    assert mlp.native.run(rows, bounds, torch.empty_like(rows)) == []  # no expert left to the Python loop
    # the Python loop's oneDNN GEMMs add in another order: close, not equal
    torch.testing.assert_close(native, python, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "top_k", "num_experts"), [(1, 8, 64), (7, 2, 8), (300, 8, 64), (5, 1, 3)])
def test_dispatch_and_combine_equal_torch(dtype: torch.dtype, tokens: int, top_k: int,
                                          num_experts: int) -> None:
    empty = (moe_experts.ExpertLinear * num_experts)()
    table = moe_experts.ExpertTable(empty, empty, dtype, hidden=48, inter=4, gelu=False, weights=[])
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 48, generator=g).to(dtype)
    experts = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(tokens)])
    rows, bounds, order = table.dispatch(x, experts)
    sorted_ids, torch_order = torch.sort(experts.flatten(), stable=True)
    assert torch.equal(order, torch_order)
    assert torch.equal(rows, x.index_select(0, torch_order // top_k))
    assert torch.equal(bounds, torch.searchsorted(sorted_ids, torch.arange(num_experts + 1)))
    out = torch.randn(rows.shape, generator=g).to(dtype)
    # Qwen3-MoE's weights in the model's dtype, Mixtral's in float32
    for weights_dtype in dict.fromkeys((dtype, torch.float32)):
        weights = torch.rand(tokens, top_k, generator=g).to(weights_dtype)
        scaled = (out * weights.flatten()[torch_order].unsqueeze(1)).to(dtype)
        expected = torch.zeros_like(x).index_add_(0, torch_order // top_k, scaled)
        assert torch.equal(table.combine(out, weights, order), expected)


def test_dispatch_refuses_an_expert_out_of_range() -> None:
    empty = (moe_experts.ExpertLinear * 4)()
    table = moe_experts.ExpertTable(empty, empty, torch.float32, hidden=8, inter=4, gelu=False, weights=[])
    with pytest.raises(ValueError, match="out of range"):
        table.dispatch(torch.zeros(2, 8), torch.tensor([[0, 1], [2, 4]]))
