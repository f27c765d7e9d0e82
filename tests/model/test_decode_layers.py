"""The decode layer stack (model/cpu/decode_layers.py): every layer of a few-row step as one C++ call on
quantized weights. It runs the layer body's kernels in the body's order, so its logits must equal the
body's exactly, on the default Q4_1 file and on int8 checkpoints of the families it takes (a q/k/v bias,
a sliding window); models it cannot take run the body, and so does a step it does not fit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mixserve import ModelRunner
from mixserve.core.batch import ForwardBatch, ForwardSeq
from mixserve.model.cpu import decode_layers
from mixserve.model.cpu import quant_linear as ql
from mixserve.model.loader import default_model_path
from mixserve.model.ops import torch_ops
from tests.family_models import make_tiny_family

pytestmark = pytest.mark.skipif(ql.unavailable() is not None, reason=f"no CPU kernels: {ql.unavailable()}")


def steps(runner: ModelRunner, prompt: list[int]) -> list[ForwardBatch]:
    """A prompt of few rows, 4 greedy-shaped decodes, then a mixed step: a decode beside a new prompt."""
    table, other = list(range(16)), list(range(16, 32))
    batches = [ForwardBatch([ForwardSeq("a", prompt, 0, table)])]
    for i in range(4):
        batches.append(ForwardBatch([ForwardSeq("a", [7 + i], len(prompt) + i, table)]))
    batches.append(ForwardBatch([ForwardSeq("a", [3], len(prompt) + 4, table),
                                 ForwardSeq("b", prompt[:9], 0, other)]))
    return batches


def logits_of(runner: ModelRunner, batches: list[ForwardBatch], stack: bool,
              monkeypatch: pytest.MonkeyPatch) -> tuple[list[torch.Tensor], int]:
    """Each step's logits, with the model's stack on or off, and how many steps the stack ran."""
    model, ran = runner.model, []
    planned = model.stack
    run = decode_layers.LayerStack.run

    def counted(self, *args):
        ran.append(1)
        return run(self, *args)

    with monkeypatch.context() as mp:
        mp.setattr(decode_layers.LayerStack, "run", counted)
        mp.setattr(model, "stack", planned if stack else None)
        with torch.no_grad():
            out = [runner.forward(b).clone() for b in batches]
    return out, len(ran)


def assert_stack_equals_body(runner: ModelRunner, prompt: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    assert runner.model.stack is not None, decode_layers.why_not(runner.model, runner.model.ops)
    batches = steps(runner, prompt)
    got, ran = logits_of(runner, batches, True, monkeypatch)
    want, none = logits_of(runner, batches, False, monkeypatch)
    assert ran == len(batches) and none == 0
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w), (g - w).abs().max()


@pytest.fixture(scope="module")
def default_runner() -> ModelRunner:
    return ModelRunner.from_pretrained(str(default_model_path()), num_blocks=64, block_size=4, device="cpu",
                                       quantization="auto")


def test_default_model_stack_equals_the_layer_body(default_runner: ModelRunner,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    prompt = default_runner.tokenizer.encode("What is the capital of France? Answer in one word.")
    assert len(prompt) <= default_runner.model.stack.max_tokens
    assert_stack_equals_body(default_runner, prompt, monkeypatch)


def test_bf16_model_stack_equals_the_layer_body(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bf16 model (the opt-in for speed): bf16 activations and KV cache, each linear's rows widened to
    float32 and its product rounded once, as the body does; steps from the bf16 panels' row count on are
    the body's."""
    runner = ModelRunner.from_pretrained(str(default_model_path()), num_blocks=64, block_size=4, device="cpu",
                                         quantization="auto", dtype="bfloat16")
    stack = runner.model.stack
    assert stack is not None, decode_layers.why_not(runner.model, runner.model.ops)
    if ql.bf16_panels():
        assert stack.max_tokens == ql.BF16_PANEL_ROWS - 1
    prompt = runner.tokenizer.encode("What is the capital of France? Answer in one word.")[: stack.max_tokens]
    assert_stack_equals_body(runner, prompt, monkeypatch)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_activations_stack_equals_the_layer_body(dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """int8_activations: the stack passes the flag to every linear, so its integer dots (block kernel below
    the int8 panels' rows, the panels from them) are the body's."""
    runner = ModelRunner.from_pretrained(str(default_model_path()), num_blocks=64, block_size=4, device="cpu",
                                         quantization="auto", dtype=dtype, int8_activations=True)
    stack = runner.model.stack
    assert stack is not None and stack.shape.int8_inputs == 1
    prompt = runner.tokenizer.encode("What is the capital of France? Answer in one word.")[: stack.max_tokens]
    assert len(prompt) >= 8  # the prefill takes the int8 panels where the build has them
    assert_stack_equals_body(runner, prompt, monkeypatch)


@pytest.mark.parametrize("family", ["mistral", "qwen2-window"])
def test_int8_families_stack_equals_the_layer_body(family: str, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Mistral's window (5) and Qwen2's window layers (6, from layer 1) are shorter than the prompt, Qwen2
    has a q/k/v bias: each goes through the stack's own path to the kernels."""
    path = make_tiny_family(tmp_path / family, family)
    runner = ModelRunner.from_pretrained(str(path), num_blocks=32, block_size=4, device="cpu",
                                         quantization="int8")
    if family == "qwen2-window":
        assert runner.model.layers[0].qkv_bias is not None
    assert {layer.attn_args.get("window") for layer in runner.model.layers} - {None}
    prompt = runner.tokenizer.encode("The quick brown fox jumps over the lazy dog, twice over.")[:20]
    assert_stack_equals_body(runner, prompt, monkeypatch)


def test_a_step_the_stack_does_not_fit_runs_the_body(default_runner: ModelRunner,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    stack = default_runner.model.stack
    assert stack.runs(default_runner.model.ops, stack.max_tokens, "cpu")
    assert not stack.runs(default_runner.model.ops, stack.max_tokens + 1, "cpu")  # a prefill chunk
    assert not stack.runs(default_runner.model.ops, 1, "torch")  # another attention backend
    assert not stack.runs(torch_ops(), 1, "cpu")  # other ops (a profiler's timed ones)
    long_prompt = list(range(100, 100 + stack.max_tokens + 8))
    _, ran = logits_of(default_runner, [ForwardBatch([ForwardSeq("c", long_prompt, 0, list(range(16)))])],
                       True, monkeypatch)
    assert ran == 0


@pytest.mark.parametrize("family", ["qwen2-window"])
def test_bf16_family_with_a_bias_stack_equals_the_layer_body(family: str, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A bf16 q/k/v bias is added in float32 inside the product, as the body adds it."""
    path = make_tiny_family(tmp_path / family, family)
    runner = ModelRunner.from_pretrained(str(path), num_blocks=32, block_size=4, device="cpu",
                                         quantization="int8", dtype="bfloat16")
    assert runner.model.layers[0].qkv_bias.dtype == torch.bfloat16
    prompt = runner.tokenizer.encode("The quick brown fox jumps over the lazy dog, twice over.")[:12]
    assert_stack_equals_body(runner, prompt, monkeypatch)


def test_models_it_cannot_take_are_not_planned(tmp_path: Path) -> None:
    none = ModelRunner.from_pretrained(str(default_model_path()), num_blocks=8, block_size=4, device="cpu",
                                       quantization="none")
    assert none.model.stack is None
    assert "not all quantized" in decode_layers.why_not(none.model, none.model.ops)
    qwen3 = ModelRunner.from_pretrained(str(make_tiny_family(tmp_path / "qwen3", "qwen3")), num_blocks=8,
                                        block_size=4, device="cpu", quantization="int8")
    assert qwen3.model.stack is None
    assert "per-head or sandwich norms" in decode_layers.why_not(qwen3.model, qwen3.model.ops)
