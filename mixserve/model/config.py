"""ModelConfig: shape and hyper-parameters of a decoder, whatever its family; the families fill it in
(mixserve/model/families reads config.json or GGUF metadata into one)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RopeScaling:
    """Rope scaling as HF's rope_parameters describe it: "default", "linear", "llama3" or "longrope"."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # longrope (Phi-3): per-pair divisors below and from original_max_position_embeddings; cos/sin scale
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0


@dataclass(frozen=True)
class MoeConfig:
    """A sparse MLP: a router picks `top_k` of `num_experts` gated MLPs per token."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool = True  # renormalise the chosen experts' softmax weights to sum to 1
    layers: tuple[bool, ...] = ()  # per layer: True where the MLP is sparse; () = every layer
    weights_in_model_dtype: bool = False  # Qwen3-MoE rounds the routing weights to the model's dtype (HF)


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a decoder-only transformer. The defaults are Llama's; each field past `eos_token_ids`
    names what one family does differently (mixserve/model/families says which)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    qkv_bias: bool = False
    tie_word_embeddings: bool = False
    architecture: str = "llama"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    family: str = "llama"
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over each head of q and k, before RoPE
    norm_offset: float = 0.0  # Gemma: norms scale by (offset + w); added to the weights at load
    embed_scale: float = 1.0  # Gemma: the embedding times sqrt(hidden_size)
    activation: str = "silu"  # the gated MLP's: "silu" or "gelu_tanh"
    sandwich_norm: bool = False  # Gemma 2/3: a norm after attention and around the MLP too
    attn_scale: float | None = None  # score scale; None: head_dim ** -0.5
    attn_softcap: float = 0.0  # Gemma 2: scores = c * tanh(scores / c)
    final_softcap: float = 0.0  # Gemma 2: the same on the logits
    layer_windows: tuple[int, ...] = ()  # per layer sliding window (0: full context); (): all full
    local_rope_theta: float | None = None  # Gemma 3: the windowed layers' RoPE base, unscaled
    moe: MoeConfig | None = None

    def kv_bytes_per_token(self, element_size: int) -> int:
        """Bytes of K and V one token takes in the cache over all layers, at `element_size` bytes each."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_size

    def window(self, layer: int) -> int:
        """Layer `layer`'s sliding window in tokens (0: it sees the whole context)."""
        return self.layer_windows[layer] if self.layer_windows else 0

    def sparse(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is a mixture of experts."""
        return self.moe is not None and (not self.moe.layers or self.moe.layers[layer])

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], where: str = "config.json") -> ModelConfig:
        """Build from a parsed HF config.json; `where` names the file in errors."""
        from mixserve.model.families import config_from_hf

        return config_from_hf(cfg, where)

    @classmethod
    def from_gguf(cls, meta: dict[str, Any], where: str, *, vocab_size: int, tied: bool) -> ModelConfig:
        """Build from GGUF key/values (`meta`); `where` names the file in errors."""
        from mixserve.model.families import config_from_gguf

        return config_from_gguf(meta, where, vocab_size=vocab_size, tied=tied)
