"""A Llama-family decoder over packed tokens: fused QKV and gate/up projections, paged KV via a backend."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mixserve.kernels import NORM_MAX_HIDDEN, use_triton
from mixserve.model.attention.base import AttentionBackend, AttentionMetadata
from mixserve.model.config import ModelConfig
from mixserve.model.errors import ModelLoadError
from mixserve.model.rope import RotaryTable, apply_rotary


@dataclass(frozen=True)
class FusedOps:
    """The Triton kernels of the fused path (mixserve/kernels), loaded on first use."""

    rms_norm: Callable[[Tensor, Tensor, float], Tensor]
    add_rms_norm: Callable[[Tensor, Tensor, Tensor, float], tuple[Tensor, Tensor]]
    silu_and_mul: Callable[[Tensor], Tensor]
    rotary_qk_: Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], None]


@functools.cache
def fused_ops() -> FusedOps:
    """Import the kernel modules (and triton) once, only when the fused path first runs."""
    from mixserve.kernels import activation, norm, rope

    return FusedOps(rms_norm=norm.rms_norm, add_rms_norm=norm.add_rms_norm,
                    silu_and_mul=activation.silu_and_mul, rotary_qk_=rope.rotary_qk_)


KVCaches = list[tuple[Tensor, Tensor]]  # per layer: (K cache, V cache), (num_blocks, block_size, Hkv, D)


def _param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


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

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        attn: AttentionBackend,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t = hidden.shape[0]
        x = rms_norm(hidden, self.input_norm, self.eps)
        qkv = F.linear(x, self.qkv, self.qkv_bias)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rotary(q.view(t, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(k.view(t, self.num_kv_heads, self.head_dim), cos, sin)
        o = attn.forward(q, k, v.reshape(t, self.num_kv_heads, self.head_dim), k_cache, v_cache, meta)
        hidden = hidden + F.linear(o.reshape(t, self.q_size), self.o_proj)
        x = rms_norm(hidden, self.post_norm, self.eps)
        gate, up = F.linear(x, self.gate_up).chunk(2, dim=-1)
        return hidden + F.linear(F.silu(gate) * up, self.down)

    def forward_fused(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: RotaryTable,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        attn: AttentionBackend,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The same layer with Triton kernels, vLLM-style: (hidden, residual) in, (hidden, residual) out.

        The residual stream is carried unsummed: this layer's output is `hidden + residual` (the caller
        adds it, fused into the next norm). residual=None marks the first layer, whose input is whole.
        Per layer: 2 norm launches (each with the residual add), 4 GEMMs, 1 RoPE, 1 SiLU*up, attention.
        """
        ops = fused_ops()
        t = hidden.shape[0]
        if residual is None:
            residual = hidden
            x = ops.rms_norm(hidden, self.input_norm, self.eps)
        else:
            x, residual = ops.add_rms_norm(hidden, residual, self.input_norm, self.eps)
        qkv = F.linear(x, self.qkv, self.qkv_bias)
        # Strided views into qkv (strides (W, D, 1)): RoPE rotates q and k in place, nothing is copied.
        q = qkv[:, : self.q_size].view(t, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(t, self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        ops.rotary_qk_(q, k, rotary.cos, rotary.sin, meta.positions)
        o = attn.forward(q, k, v, k_cache, v_cache, meta)
        hidden = F.linear(o.reshape(t, self.q_size), self.o_proj)
        x, residual = ops.add_rms_norm(hidden, residual, self.post_norm, self.eps)
        return F.linear(ops.silu_and_mul(F.linear(x, self.gate_up)), self.down), residual


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32 like HF, then scaled in the weight's dtype."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


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

    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: KVCaches,
        attn: AttentionBackend,
    ) -> torch.Tensor:
        """Packed tokens (T,) -> float32 logits (S, vocab) of the tokens at meta.last_token_index.

        On CUDA with triton (`mixserve.kernels.use_triton`) the layers run fused Triton kernels; elsewhere
        eager PyTorch. Either way no host sync, so CUDA graphs can capture it."""
        hidden = F.embedding(input_ids, self.embed)
        if use_triton(hidden) and self.config.hidden_size <= NORM_MAX_HIDDEN:
            hidden = self._last_hidden_fused(hidden, meta, kv_caches, attn)
        else:
            hidden = self._last_hidden(hidden, meta, kv_caches, attn)
        return F.linear(hidden, self.lm_head).float()

    def _last_hidden(self, hidden: Tensor, meta: AttentionMetadata, kv_caches: KVCaches,
                    attn: AttentionBackend) -> Tensor:
        """Eager PyTorch layers, then the final norm of each sequence's last token: (S, H)."""
        cos, sin = self.rotary.lookup(meta.positions)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            hidden = layer(hidden, cos, sin, k_cache, v_cache, attn, meta)
        return rms_norm(hidden[meta.last_token_index], self.norm, self.config.rms_norm_eps)

    def _last_hidden_fused(self, hidden: Tensor, meta: AttentionMetadata, kv_caches: KVCaches,
                          attn: AttentionBackend) -> Tensor:
        """Fused Triton layers; the last layer's residual add fuses into the final norm: (S, H)."""
        ops = fused_ops()
        residual: torch.Tensor | None = None
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer.forward_fused(hidden, residual, self.rotary, k_cache, v_cache, attn,
                                                   meta)
        last, eps = meta.last_token_index, self.config.rms_norm_eps
        if residual is None:  # a model without layers
            return ops.rms_norm(hidden[last], self.norm, eps)
        return ops.add_rms_norm(hidden[last], residual[last], self.norm, eps)[0]

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
