"""Copy an HF-named state dict (Llama's names plus the families' extras) into a DecoderModel.

A state dict's linears may be quantized (cpu/quant_linear.QuantWeight, from a GGUF file kept in its blocks):
those replace the module's parameter as they are; everything else is copied into the parameters."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from mixserve.model.cpu import quant_linear
from mixserve.model.cpu.quant_linear import QuantWeight
from mixserve.model.errors import ModelLoadError

if TYPE_CHECKING:
    from mixserve.model.decoder import DecoderModel


def replace_weight(owner: nn.Module, attr: str, w: QuantWeight) -> None:
    """Put a quantized weight where the module's parameter `attr` was (a plain attribute from then on)."""
    owner._parameters.pop(attr, None)
    object.__setattr__(owner, attr, w)


def dense(w: Tensor | QuantWeight) -> Tensor:
    """A checkpoint tensor as a float tensor (a quantized one dequantized to float32)."""
    return quant_linear.dequantize(w) if isinstance(w, QuantWeight) else w


@dataclass(frozen=True)
class WeightSource:
    """A state dict, the checkpoint's name for errors, and the copies into a module, with their checks."""

    sd: Mapping[str, Any]
    where: str

    def take(self, name: str) -> Tensor:
        """A tensor by name, dequantized if it is quantized (norms, routers, experts)."""
        return dense(self.raw(name))

    def raw(self, name: str) -> Tensor | QuantWeight:
        try:
            return self.sd[name]
        except KeyError:
            raise ModelLoadError(f"{self.where}: missing weight {name}") from None

    def rows(self, names: list[str]) -> Tensor | QuantWeight:
        """The named weights one below the other (a fused q/k/v, gate/up), quantized if all of them are."""
        parts = [self.raw(n) for n in names]
        if all(isinstance(p, QuantWeight) for p in parts):
            return parts[0] if len(parts) == 1 else quant_linear.cat(parts)
        return torch.cat([dense(p) for p in parts])

    def check(self, dst: Tensor, src: Tensor | QuantWeight, name: str) -> None:
        if tuple(src.shape) != tuple(dst.shape):
            raise ModelLoadError(f"{self.where}: weight {name} has shape {tuple(src.shape)}, "
                                 f"expected {tuple(dst.shape)}")

    def put(self, dst: Tensor, src: Tensor, name: str) -> None:
        self.check(dst, src, name)
        dst.copy_(src)

    def put_linear(self, owner: nn.Module, attr: str, src: Tensor | QuantWeight, name: str) -> None:
        """A linear weight into `owner.attr`: a quantized one replaces the parameter, a float one is copied
        in."""
        if isinstance(src, QuantWeight):
            self.check(getattr(owner, attr), src, name)
            replace_weight(owner, attr, src)
        else:
            self.put(getattr(owner, attr), src, name)


@torch.no_grad()
def load_hf_weights(model: DecoderModel, sd: Mapping[str, Any], where: str) -> None:
    """Fuse q/k/v and gate/up as the decoder stores them; norms get the family's offset added (Gemma's
    (1 + w)), so every family runs one RMSNorm."""
    cfg = model.config
    offset = cfg.norm_offset
    src = WeightSource(sd, where)

    def norm(dst: Tensor | None, name: str) -> None:
        if dst is not None:
            src.put(dst, src.take(name).float() + offset if offset else src.take(name), name)

    tied = model.lm_head is model.embed
    src.put_linear(model, "embed", src.raw("model.embed_tokens.weight"), "model.embed_tokens.weight")
    if tied and isinstance(model.embed, QuantWeight):  # the head reads the same quantized table
        replace_weight(model, "lm_head", model.embed)
    norm(model.norm, "model.norm.weight")
    if not cfg.tie_word_embeddings:
        src.put_linear(model, "lm_head", src.raw("lm_head.weight"), "lm_head.weight")
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        norm(layer.input_norm, p + "input_layernorm.weight")
        if cfg.sandwich_norm:  # Gemma's post_attention_layernorm follows attention; pre_feedforward precedes
            norm(layer.attn_out_norm, p + "post_attention_layernorm.weight")
            norm(layer.post_norm, p + "pre_feedforward_layernorm.weight")
            norm(layer.mlp_out_norm, p + "post_feedforward_layernorm.weight")
        else:
            norm(layer.post_norm, p + "post_attention_layernorm.weight")
        a = p + "self_attn."
        src.put_linear(layer, "qkv", src.rows([a + f"{n}_proj.weight" for n in "qkv"]), a + "qkv_proj.weight")
        if layer.qkv_bias is not None:
            src.put(layer.qkv_bias, torch.cat([src.take(a + f"{n}_proj.bias") for n in "qkv"]),
                    a + "qkv_proj.bias")
        norm(layer.q_norm, a + "q_norm.weight")
        norm(layer.k_norm, a + "k_norm.weight")
        src.put_linear(layer, "o_proj", src.raw(a + "o_proj.weight"), a + "o_proj.weight")
        layer.mlp.load(src, p + "mlp.")
