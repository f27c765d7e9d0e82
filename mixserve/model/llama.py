"""A Llama-family decoder over packed tokens: fused QKV and gate/up projections, paged KV via a backend."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mixserve import kernels
from mixserve.model.attention.base import AttentionBackend, AttentionMetadata
from mixserve.model.config import ModelConfig
from mixserve.model.errors import ModelLoadError
from mixserve.model.ops import LayerOps, Rotary, torch_ops
from mixserve.model.rope import RotaryTable

KVCaches = list[tuple[Tensor, Tensor]]  # per layer: (K cache, V cache), (num_blocks, block_size, Hkv, D)


def _param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


@dataclass(frozen=True)
class LayerWeights:
    """A layer's linear weights as its ops' `linear` takes them (a plain attribute, not parameters: the
    state dict and parameters() stay the loaded weights)."""

    qkv: Any
    o_proj: Any
    gate_up: Any
    down: Any


@dataclass(frozen=True)
class HeadWeight:
    """The LM head as the ops' `linear` takes it (a plain attribute, for the reason LayerWeights gives)."""

    lm_head: Any


class ShardHooks(Protocol):
    """The collectives a tensor-parallel shard adds to the forward (mixserve/distributed/group.py); a model
    without them (tp None, the default) is whole and runs as before."""

    def all_reduce(self, x: Tensor) -> Tensor: ...
    def embed(self, input_ids: Tensor, weight: Tensor) -> Tensor: ...
    def gather_logits(self, logits: Tensor) -> Tensor: ...


class DecoderLayer(nn.Module):
    """Pre-norm attention + SwiGLU MLP, each with a residual; weights fused at load time."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.q_size, self.kv_size = cfg.num_heads * d, cfg.num_kv_heads * d
        self.eps = cfg.rms_norm_eps
        self.input_norm = _param(h, dtype=dtype, device=device)
        self.qkv = _param(self.q_size + 2 * self.kv_size, h, dtype=dtype, device=device)
        bias = _param(self.q_size + 2 * self.kv_size, dtype=dtype, device=device) if cfg.qkv_bias else None
        self.qkv_bias = bias
        self.o_proj = _param(h, self.q_size, dtype=dtype, device=device)
        self.post_norm = _param(h, dtype=dtype, device=device)
        self.gate_up = _param(2 * cfg.intermediate_size, h, dtype=dtype, device=device)
        self.down = _param(h, cfg.intermediate_size, dtype=dtype, device=device)
        self.tp: ShardHooks | None = None  # set by mixserve.distributed: o_proj and down all-reduce
        self.prepare(torch_ops())  # the parameters themselves, until the runner hands over its ops

    def prepare(self, ops: LayerOps) -> None:
        """Hand the linears' weights to `ops.pack` (MKL's or oneDNN's packing on a CPU, nothing elsewhere);
        once, after the weights are loaded: a packed copy does not follow later writes to the parameters."""
        self.packed = LayerWeights(qkv=ops.pack(self.qkv), o_proj=ops.pack(self.o_proj),
                                   gate_up=ops.pack(self.gate_up), down=ops.pack(self.down))

    def forward(self, hidden: Tensor, residual: Tensor | None, rot: Rotary, k_cache: Tensor, v_cache: Tensor,
                attn: AttentionBackend, meta: AttentionMetadata, ops: LayerOps) -> tuple[Tensor, Tensor]:
        """(hidden, residual) in, (hidden, residual) out, vLLM-style: the residual stream is carried unsummed,
        this layer's output is `hidden + residual` (the next norm adds it: one launch with the Triton set).
        residual=None marks the first layer, whose input is whole."""
        t, w = hidden.shape[0], self.packed
        if residual is None:
            residual = hidden
            x = ops.rms_norm(hidden, self.input_norm, self.eps)
        else:
            x, residual = ops.add_rms_norm(hidden, residual, self.input_norm, self.eps)
        qkv = ops.linear(x, w.qkv, self.qkv_bias)
        # Strided views into qkv (strides (W, D, 1)): nothing is copied; the Triton RoPE rotates in place.
        qk = qkv[:, : self.q_size + self.kv_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        q, k = ops.rotary(qk, self.num_heads, rot)
        o = attn.forward(q, k, v, k_cache, v_cache, meta)
        hidden = ops.linear(o.reshape(t, self.q_size), w.o_proj, None)
        if self.tp is not None:  # row-parallel o_proj: each rank holds a partial sum
            hidden = self.tp.all_reduce(hidden)
        x, residual = ops.add_rms_norm(hidden, residual, self.post_norm, self.eps)
        out = ops.linear(ops.silu_and_mul(ops.linear(x, w.gate_up, None)), w.down, None)
        return (out if self.tp is None else self.tp.all_reduce(out)), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm and LM head; forward() returns logits of chosen tokens."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str = "cpu"):
        super().__init__()
        device = torch.device(device)
        self.config = cfg
        self.embed = _param(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype, device) for _ in range(cfg.num_layers))
        self.norm = _param(cfg.hidden_size, dtype=dtype, device=device)
        self.lm_head = self.embed if cfg.tie_word_embeddings else _param(
            cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device
        )
        self.rotary = RotaryTable(cfg, device, dtype)
        self.tp: ShardHooks | None = None  # set by mixserve.distributed: vocabulary-split embed and head
        self.prepare(torch_ops())

    def prepare(self, ops: LayerOps) -> None:
        """Run the layers with `ops` from now on (the runner decides them once, at start-up), packing the
        weights as they want them. Call it after the weights are loaded."""
        self.ops = ops
        for layer in self.layers:
            layer.prepare(ops)
        # A packed copy even when tied (the embedding gathers rows of the plain one): see ops._MIN_ROWS.
        self.head = HeadWeight(ops.pack(self.lm_head))

    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: KVCaches,
        attn: AttentionBackend,
    ) -> torch.Tensor:
        """Packed tokens (T,) -> float32 logits (S, vocab) of the tokens at meta.last_token_index.

        No host sync, so CUDA graphs can capture it."""
        ops = self.ops
        if ops.triton and not kernels.enabled():  # kernels.set_enabled(False) after start-up: eager ops
            ops = torch_ops()
        tp = self.tp
        hidden = F.embedding(input_ids, self.embed) if tp is None else tp.embed(input_ids, self.embed)
        rot = ops.rotary_state(self.rotary, meta.positions)
        residual: Tensor | None = None
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, rot, k_cache, v_cache, attn, meta, ops)
        # Only each sequence's last token goes on: the last residual add fuses into the final norm.
        last, eps = meta.last_token_index, self.config.rms_norm_eps
        if residual is None:  # a model without layers
            hidden = ops.rms_norm(hidden[last], self.norm, eps)
        else:
            hidden = ops.add_rms_norm(hidden[last], residual[last], self.norm, eps)[0]
        lm_head = self.head.lm_head if ops is self.ops else self.lm_head
        logits = ops.linear(hidden, lm_head, None)
        return (logits if self.tp is None else self.tp.gather_logits(logits)).float()

    @torch.no_grad()
    def load_hf_weights(self, sd: Mapping[str, torch.Tensor], where: str, inv_freq=None) -> None:
        """Copy HF-named weights (model.layers.N.self_attn.q_proj.weight, ...) in, fusing QKV and gate/up."""

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

        put(self.embed, take("model.embed_tokens.weight"), "model.embed_tokens.weight")
        put(self.norm, take("model.norm.weight"), "model.norm.weight")
        if not self.config.tie_word_embeddings:
            put(self.lm_head, take("lm_head.weight"), "lm_head.weight")
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            norms = ((layer.input_norm, "input_layernorm"), (layer.post_norm, "post_attention_layernorm"))
            for dst, n in norms:
                put(dst, take(p + n + ".weight"), p + n + ".weight")
            a = p + "self_attn."
            qkv = torch.cat([take(a + f"{n}_proj.weight") for n in "qkv"])
            put(layer.qkv, qkv, a + "qkv_proj.weight")
            if layer.qkv_bias is not None:
                bias = torch.cat([take(a + f"{n}_proj.bias") for n in "qkv"])
                put(layer.qkv_bias, bias, a + "qkv_proj.bias")
            put(layer.o_proj, take(a + "o_proj.weight"), a + "o_proj.weight")
            m = p + "mlp."
            put(layer.gate_up, torch.cat([take(m + "gate_proj.weight"), take(m + "up_proj.weight")]),
                m + "gate_up_proj.weight")
            put(layer.down, take(m + "down_proj.weight"), m + "down_proj.weight")
        if inv_freq is not None:
            self.rotary = RotaryTable(self.config, self.embed.device, self.embed.dtype, inv_freq=inv_freq)
