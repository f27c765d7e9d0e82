"""Copy an HF-named state dict (Llama's names plus the families' extras) into a DecoderModel."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from mixserve.model.errors import ModelLoadError

if TYPE_CHECKING:
    from mixserve.model.decoder import DecoderModel


@torch.no_grad()
def load_hf_weights(model: DecoderModel, sd: Mapping[str, torch.Tensor], where: str) -> None:
    """Fuse q/k/v and gate/up as the decoder stores them; norms get the family's offset added (Gemma's
    (1 + w)), so every family runs one RMSNorm."""
    cfg = model.config
    offset = cfg.norm_offset

    def take(name: str) -> torch.Tensor:
        try:
            return sd[name]
        except KeyError:
            raise ModelLoadError(f"{where}: missing weight {name}") from None

    def put(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
        if tuple(src.shape) != tuple(dst.shape):
            raise ModelLoadError(f"{where}: weight {name} has shape {tuple(src.shape)}, "
                                 f"expected {tuple(dst.shape)}")
        dst.copy_(src)

    def norm(dst: torch.Tensor | None, name: str) -> None:
        if dst is not None:
            put(dst, take(name).float() + offset if offset else take(name), name)

    put(model.embed, take("model.embed_tokens.weight"), "model.embed_tokens.weight")
    norm(model.norm, "model.norm.weight")
    if not cfg.tie_word_embeddings:
        put(model.lm_head, take("lm_head.weight"), "lm_head.weight")
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
        put(layer.qkv, torch.cat([take(a + f"{n}_proj.weight") for n in "qkv"]), a + "qkv_proj.weight")
        if layer.qkv_bias is not None:
            put(layer.qkv_bias, torch.cat([take(a + f"{n}_proj.bias") for n in "qkv"]), a + "qkv_proj.bias")
        norm(layer.q_norm, a + "q_norm.weight")
        norm(layer.k_norm, a + "k_norm.weight")
        put(layer.o_proj, take(a + "o_proj.weight"), a + "o_proj.weight")
        layer.mlp.load(take, put, p + "mlp.")
