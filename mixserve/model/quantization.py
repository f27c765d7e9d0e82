"""Which weights stay quantized (`[engine] quantization`): the one place that decides it, at load.

`auto`: a GGUF file's linears, token table and head stay in the file's blocks where a CPU kernel reads the
format (mixserve/model/cpu/quant_linear.py); any other tensor, and every tensor of an HF folder, loads as
before. `none`: everything dequantized to the model's dtype. `int8`: the dense linears, the token table and
the head quantized at load to int8 per output channel (weight-only), from whatever the checkpoint holds.
Quantized weights run on the CPU only; elsewhere `auto` and `int8` load unquantized and say so once.
"""

from __future__ import annotations

import logging

import torch

from mixserve.model.errors import ModelLoadError

log = logging.getLogger("mixserve")
MODES = ("auto", "none", "int8")


def resolve(mode: str, device: torch.device) -> str:
    """The mode that applies on `device`: `mode`, or `none` where quantized weights cannot run."""
    if mode not in MODES:
        raise ModelLoadError(f"quantization {mode!r} is not one of {', '.join(MODES)}")
    if mode == "none":
        return mode
    if device.type != "cpu":
        log.warning("quantization %s: quantized weights run on the CPU only; loading unquantized on %s",
                    mode, device)
        return "none"
    from mixserve.model.cpu.quant_linear import unavailable

    why = unavailable()
    if why is not None:
        log.warning("quantization %s: the quantized CPU kernels are unavailable (%s); loading unquantized",
                    mode, why)
        return "none"
    return mode


def with_int8_inputs(sd: dict[str, object]) -> dict[str, object]:
    """`[engine] int8_activations`: the state dict's quantized weights marked to multiply int8-rounded inputs
    (quant_linear.with_int8_inputs; the blocks are not copied). Said once where none has integer dots."""
    from mixserve.model.cpu.quant_linear import QuantWeight, with_int8_inputs

    marked = {k: with_int8_inputs(v) if isinstance(v, QuantWeight) else v for k, v in sd.items()}
    if not any(isinstance(v, QuantWeight) and v.int8_inputs for v in marked.values()):
        log.warning("int8_activations: no weight is kept quantized (a GGUF file's blocks, or quantization "
                    "int8); the inputs stay float")
    return marked


@torch.no_grad()
def quantize_int8(model, int8_inputs: bool = False) -> None:
    """Replace the dense linears, the token table and the head of a loaded DecoderModel by int8 per channel
    (the experts of a MoE layer stay as loaded); `int8_inputs` (`[engine] int8_activations`): marked to
    multiply int8-rounded inputs, W8A8 as integer dots."""
    from mixserve.model.cpu import quant_linear

    def int8(w: torch.Tensor) -> quant_linear.QuantWeight:
        q = quant_linear.quantize_int8(w)
        return quant_linear.with_int8_inputs(q) if int8_inputs else q
    from mixserve.model.mlp import GatedMlp
    from mixserve.model.weights import replace_weight

    tied = model.lm_head is model.embed
    for layer in model.layers:
        for owner, attr in ((layer, "qkv"), (layer, "o_proj"), (layer.mlp, "gate_up"), (layer.mlp, "down")):
            if owner is layer or isinstance(owner, GatedMlp):
                replace_weight(owner, attr, int8(getattr(owner, attr)))
    replace_weight(model, "embed", int8(model.embed))
    replace_weight(model, "lm_head", model.embed if tied else int8(model.lm_head))
