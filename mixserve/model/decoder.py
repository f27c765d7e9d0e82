"""A decoder-only transformer over packed tokens, for every family (mixserve/model/families): fused QKV and
gate/up projections, paged KV via an attention backend, and the switches ModelConfig names per family."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mixserve import kernels
from mixserve.model.attention.base import AttentionBackend, AttentionMetadata
from mixserve.model.config import ModelConfig, RopeScaling
from mixserve.model.cpu import quant_linear
from mixserve.model.cpu.quant_linear import QuantWeight
from mixserve.model.mlp import GatedMlp, param
from mixserve.model.ops import LayerOps, Rotary, torch_ops
from mixserve.model.rope import RotaryTable

KVCaches = list[tuple[Tensor, Tensor]]  # per layer: (K cache, V cache), (num_blocks, block_size, Hkv, D)


@dataclass(frozen=True)
class LayerWeights:
    """A layer's attention linears as its ops' `linear` takes them (a plain attribute, not parameters: the
    state dict and parameters() stay the loaded weights)."""

    qkv: Any
    o_proj: Any


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
    """Pre-norm attention + gated MLP (dense or experts), each with a residual; weights fused at load time.
    Sandwich-norm families (Gemma) also norm the attention's and the MLP's outputs."""

    def __init__(self, cfg: ModelConfig, index: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.q_size, self.kv_size = cfg.num_heads * d, cfg.num_kv_heads * d
        self.eps = cfg.rms_norm_eps
        self.input_norm = param(h, dtype=dtype, device=device)
        self.qkv = param(self.q_size + 2 * self.kv_size, h, dtype=dtype, device=device)
        bias = param(self.q_size + 2 * self.kv_size, dtype=dtype, device=device) if cfg.qkv_bias else None
        self.qkv_bias = bias
        qk_norm = cfg.qk_norm
        self.q_norm = param(d, dtype=dtype, device=device) if qk_norm else None
        self.k_norm = param(d, dtype=dtype, device=device) if qk_norm else None
        self.o_proj = param(h, self.q_size, dtype=dtype, device=device)
        self.post_norm = param(h, dtype=dtype, device=device)  # the norm before the MLP
        sandwich = cfg.sandwich_norm
        self.attn_out_norm = param(h, dtype=dtype, device=device) if sandwich else None
        self.mlp_out_norm = param(h, dtype=dtype, device=device) if sandwich else None
        if cfg.sparse(index):
            from mixserve.model.moe import SparseMlp

            self.mlp: nn.Module = SparseMlp(cfg, dtype, device)
        else:
            self.mlp = GatedMlp(h, cfg.intermediate_size, cfg.activation, dtype, device)
        window = cfg.window(index)
        # what this layer's attention call adds to the common one (nothing for a plain causal layer)
        self.attn_args = {k: v for k, v in (("scale", cfg.attn_scale), ("window", window),
                                            ("softcap", cfg.attn_softcap)) if v}
        self.rope_table = 1 if window and cfg.local_rope_theta else 0  # Gemma 3's sliding layers' own base
        self.tp: ShardHooks | None = None  # set by mixserve.distributed: o_proj and down all-reduce
        self.prepare(torch_ops())  # the parameters themselves, until the runner hands over its ops

    def prepare(self, ops: LayerOps) -> None:
        """Hand the linears' weights to `ops.pack` (MKL's or oneDNN's packing on a CPU, nothing elsewhere);
        once, after the weights are loaded: a packed copy does not follow later writes to the parameters."""
        self.packed = LayerWeights(qkv=ops.pack(self.qkv), o_proj=ops.pack(self.o_proj))
        self.mlp.prepare(ops)

    def _qk_norm(self, qk: Tensor, ops: LayerOps) -> Tensor:
        """RMSNorm of each head of q and of k (Qwen3, Gemma 3), into one (T, Hq + Hkv, D) tensor."""
        t, hq, d = qk.shape[0], self.num_heads, self.head_dim
        q = ops.rms_norm(qk[:, :hq].reshape(-1, d), self.q_norm, self.eps).view(t, hq, d)
        k = ops.rms_norm(qk[:, hq:].reshape(-1, d), self.k_norm, self.eps).view(t, self.num_kv_heads, d)
        return torch.cat((q, k), 1)

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
        if self.q_norm is not None:
            qk = self._qk_norm(qk, ops)
        q, k = ops.rotary(qk, self.num_heads, rot)
        o = attn.forward(q, k, v, k_cache, v_cache, meta, **self.attn_args)
        hidden = ops.linear(o.reshape(t, self.q_size), w.o_proj, None)
        if self.tp is not None:  # row-parallel o_proj: each rank holds a partial sum
            hidden = self.tp.all_reduce(hidden)
        if self.attn_out_norm is not None:
            hidden = ops.rms_norm(hidden, self.attn_out_norm, self.eps)
        x, residual = ops.add_rms_norm(hidden, residual, self.post_norm, self.eps)
        out = self.mlp(x, ops)
        if self.tp is not None:
            out = self.tp.all_reduce(out)
        if self.mlp_out_norm is not None:
            out = ops.rms_norm(out, self.mlp_out_norm, self.eps)
        return out, residual


class DecoderModel(nn.Module):
    """Embedding, decoder layers, final norm and LM head; forward() returns logits of chosen tokens."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str = "cpu"):
        super().__init__()
        device = torch.device(device)
        self.config, self.dtype, self.device = cfg, dtype, device
        self.embed = param(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype, device) for i in range(cfg.num_layers))
        self.norm = param(cfg.hidden_size, dtype=dtype, device=device)
        self.lm_head = self.embed if cfg.tie_word_embeddings else param(
            cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device
        )
        self.set_rotary(None)
        self.tp: ShardHooks | None = None  # set by mixserve.distributed: vocabulary-split embed and head
        self.prepare(torch_ops())

    def set_rotary(self, inv_freq: Tensor | None) -> None:
        """The RoPE tables: the config's (or `inv_freq`, a GGUF file's own), and the sliding layers' where
        their base differs (Gemma 3)."""
        cfg, device, dtype = self.config, self.device, self.dtype
        self.rotary = RotaryTable(cfg, device, dtype, inv_freq=inv_freq)
        self.rotaries = [self.rotary]
        if cfg.local_rope_theta is not None:
            local = replace(cfg, rope_theta=cfg.local_rope_theta, rope_scaling=RopeScaling())
            self.rotaries.append(RotaryTable(local, device, dtype))

    def prepare(self, ops: LayerOps) -> None:
        """Run the layers with `ops` from now on (the runner decides them once, at start-up), packing the
        weights as they want them. Call it after the weights are loaded."""
        self.ops = ops
        for layer in self.layers:
            layer.prepare(ops)
        # A packed copy even when tied (the embedding gathers rows of the plain one): see ops._MIN_ROWS.
        self.head = HeadWeight(ops.pack(self.lm_head))
        self.stack = None  # decode steps' layers as one C++ call where every layer is a plain quantized one
        if ops.name.endswith("+cpp") and self.dtype in (torch.float32, torch.bfloat16):
            from mixserve.model.cpu import decode_layers

            self.stack = decode_layers.plan(self, ops)

    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: KVCaches,
        attn: AttentionBackend,
    ) -> torch.Tensor:
        """Packed tokens (T,) -> float32 logits (S, vocab) of the tokens at meta.last_token_index (or
        meta.logits_index).

        No host sync (the MoE layers sync once each when eager; their capture path does not), so CUDA graphs
        can capture it."""
        ops, cfg = self.ops, self.config
        if ops.triton and not kernels.enabled():  # kernels.set_enabled(False) after start-up: eager ops
            ops = torch_ops()
        tp = self.tp
        if isinstance(self.embed, QuantWeight):  # a token table kept in its blocks (cpu/quant_linear.py)
            hidden = quant_linear.embedding(input_ids, self.embed, self.dtype)
        else:
            hidden = F.embedding(input_ids, self.embed) if tp is None else tp.embed(input_ids, self.embed)
        if cfg.embed_scale != 1.0:  # in the model's dtype, as HF's Gemma scales it
            hidden = hidden * torch.tensor(cfg.embed_scale, dtype=hidden.dtype)
        if self.stack is not None and self.stack.runs(ops, hidden.shape[0], attn.name):
            hidden, residual = self.stack.run(hidden, meta, kv_caches)
        else:
            hidden, residual = self._run_layers(hidden, meta, kv_caches, attn, ops)
        # Only each sequence's last token goes on: the last residual add fuses into the final norm.
        last = meta.last_token_index if meta.logits_index is None else meta.logits_index
        eps = cfg.rms_norm_eps
        if residual is None:  # a model without layers
            hidden = ops.rms_norm(hidden[last], self.norm, eps)
        else:
            hidden = ops.add_rms_norm(hidden[last], residual[last], self.norm, eps)[0]
        lm_head = self.head.lm_head if ops is self.ops else self.lm_head
        logits = ops.linear(hidden, lm_head, None)
        logits = (logits if self.tp is None else self.tp.gather_logits(logits)).float()
        if cfg.final_softcap:
            logits = torch.tanh(logits / cfg.final_softcap) * cfg.final_softcap
        return logits

    def _run_layers(self, hidden: Tensor, meta: AttentionMetadata, kv_caches: KVCaches,
                    attn: AttentionBackend, ops: LayerOps) -> tuple[Tensor, Tensor | None]:
        """Every layer through the Python body: (hidden, residual); residual None without layers."""
        rots = [ops.rotary_state(table, meta.positions) for table in self.rotaries]
        residual: Tensor | None = None
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            rot = rots[layer.rope_table]
            hidden, residual = layer(hidden, residual, rot, k_cache, v_cache, attn, meta, ops)
        return hidden, residual

    def load_hf_weights(self, sd, where: str, inv_freq: Tensor | None = None) -> None:
        """Copy HF-named weights (model.layers.N.self_attn.q_proj.weight, ...) in, fusing QKV and gate/up."""
        from mixserve.model.weights import load_hf_weights

        load_hf_weights(self, sd, where)
        if inv_freq is not None:
            self.set_rotary(inv_freq)


LlamaModel = DecoderModel  # the name callers outside this package have used since the first family
