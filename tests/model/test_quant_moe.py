"""A mixture-of-experts GGUF file whose experts are quantized (as llama.cpp writes Qwen3-MoE and Mixtral):
with `auto` the experts stay in their blocks, no float copy of them is made, and the model answers as the
same file dequantized (`none`) does."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import quants

from mixserve import ModelRunner
from mixserve.model.cpu import quant_linear as ql
from mixserve.model.cpu.quant_linear import QuantWeight
from mixserve.model.gguf_file import read_gguf
from tests.gguf_writer import make_hf_folder, write_gguf
from tests.model.test_moe_experts import both_loops
from tests.model.test_quant_model import SAME_WEIGHTS_TOL, max_rel, teacher_forced

T = gguf.GGMLQuantizationType
TYPES = {"ffn_gate_exps": T.Q8_0, "ffn_up_exps": T.Q4_1, "ffn_down_exps": T.Q4_0}  # the rest stays F32


@pytest.fixture(params=["qwen3moe", "mixtral"])
def moe_file(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    if ql.unavailable() is not None:
        pytest.skip(f"the quantized CPU kernels do not build here: {ql.unavailable()}")
    add = gguf.GGUFWriter.add_tensor

    def add_typed(self, name: str, tensor: np.ndarray, *args, **kwargs):  # experts (3D) quantized per row
        qtype = TYPES.get(name.split(".")[-2]) if name.startswith("blk.") else None
        if qtype is not None:
            tensor, kwargs["raw_dtype"] = quants.quantize(tensor, qtype), qtype
        return add(self, name, tensor, *args, **kwargs)

    folder = make_hf_folder(tmp_path / "hf", request.param)
    with monkeypatch.context() as mp:
        mp.setattr(gguf.GGUFWriter, "add_tensor", add_typed)
        return write_gguf(folder, tmp_path / "moe.gguf")


def runner(path: Path, mode: str) -> ModelRunner:
    return ModelRunner.from_pretrained(str(path), num_blocks=32, block_size=4, dtype="float32", device="cpu",
                                       quantization=mode)


def test_quantized_experts_stay_in_their_blocks(moe_file: Path) -> None:
    _, tensors = read_gguf(moe_file)
    file_bytes = sum(t.data.nbytes for n, t in tensors.items() if "_exps" in n)
    model = runner(moe_file, "auto").model
    kept, hidden, inter = 0, model.config.hidden_size, model.config.moe.intermediate_size
    for layer in model.layers:
        mlp = layer.mlp
        assert len(mlp.quantized) == mlp.num_experts
        assert "gate_up" not in mlp._parameters and "down" not in mlp._parameters  # no float copy
        for gate_up, down in mlp.quantized:
            assert isinstance(gate_up, QuantWeight) and gate_up.formats == ("Q8_0", "Q4_1")
            assert isinstance(down, QuantWeight) and down.formats == ("Q4_0",)
            assert gate_up.shape == (2 * inter, hidden) and down.shape == (hidden, inter)
            kept += gate_up.nbytes + down.nbytes
    assert kept == file_bytes  # every expert's blocks once, none dequantized


def test_quantized_experts_answer_as_dequantized(moe_file: Path) -> None:
    runners = {m: runner(moe_file, m) for m in ("auto", "none")}
    assert not runners["none"].model.layers[0].mlp.quantized
    prompt, tokens = [5, 17, 33, 2, 90, 41, 7, 12], [3, 66, 120, 9]
    with torch.inference_mode():
        got, want = (teacher_forced(runners[m], prompt, tokens) for m in ("auto", "none"))
    assert max_rel(got, want) < SAME_WEIGHTS_TOL, max_rel(got, want)
    assert torch.equal(got.argmax(1), want.argmax(1))


@pytest.mark.parametrize("tokens", [1, 6, 40])
def test_quantized_experts_native_loop_equals_the_python_loop(moe_file: Path, tokens: int) -> None:
    native, python, _ = both_loops(runner(moe_file, "auto"), tokens)  # 40: past the block kernel's rows
    assert torch.equal(native, python)
