"""ModelConfig: shape and hyper-parameters of a Llama-family model, from HF config.json or GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mixserve.model.errors import ModelLoadError

# HF architectures (config.json "architectures") this module family runs, and whether q/k/v carry a bias.
HF_ARCHITECTURES = {
    "LlamaForCausalLM": False,
    "MistralForCausalLM": False,
    "Qwen2ForCausalLM": True,
}
# GGUF general.architecture values, same meaning.
GGUF_ARCHITECTURES = {"llama": False, "mistral": False, "qwen2": True}

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """Rope scaling as HF's rope_parameters describe it (rope_type "linear" or "llama3")."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2)."""

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

    def kv_bytes_per_token(self, element_size: int) -> int:
        """Bytes of K and V one token takes in the cache over all layers, at `element_size` bytes each."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_size

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], where: str = "config.json") -> ModelConfig:
        """Build from a parsed HF config.json; `where` names the file in errors."""
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in HF_ARCHITECTURES), None)
        if arch is None:
            raise ModelLoadError(
                f"{where}: unsupported architecture {archs or cfg.get('model_type')!r}; "
                f"supported: {', '.join(HF_ARCHITECTURES)}"
            )
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            return cls(
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=_hf_rope_theta(cfg),
                rope_scaling=_hf_rope_scaling(cfg, where),
                qkv_bias=HF_ARCHITECTURES[arch] or bool(cfg.get("attention_bias", False)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                architecture=arch,
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
            )
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, ModelLoadError):
                raise
            raise ModelLoadError(f"{where}: missing or bad key {e}") from None

    @classmethod
    def from_gguf(cls, meta: dict[str, Any], where: str, *, vocab_size: int, tied: bool) -> ModelConfig:
        """Build from GGUF key/values (`meta`); `where` names the file in errors."""
        arch = meta.get("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise ModelLoadError(
                f"{where}: unsupported architecture {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}"
            )

        def get(key: str, default: Any = None) -> Any:
            value = meta.get(f"{arch}.{key}", default)
            if value is None:
                raise ModelLoadError(f"{where}: GGUF metadata lacks {arch}.{key}")
            return value

        hidden = int(get("embedding_length"))
        heads = int(get("attention.head_count"))
        scaling = RopeScaling()
        kind = meta.get(f"{arch}.rope.scaling.type", "none")
        if kind == "linear":
            scaling = RopeScaling("linear", factor=float(get("rope.scaling.factor")))
        elif kind not in ("none", None):
            raise ModelLoadError(f"{where}: unsupported rope scaling type {kind!r}")
        eos = meta.get("tokenizer.ggml.eos_token_id")
        return cls(
            vocab_size=vocab_size,
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_layers=int(get("block_count")),
            num_heads=heads,
            num_kv_heads=int(get("attention.head_count_kv", heads)),
            head_dim=int(meta.get(f"{arch}.attention.key_length", hidden // heads)),
            max_position_embeddings=int(get("context_length")),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            qkv_bias=GGUF_ARCHITECTURES[arch],
            tie_word_embeddings=tied,
            architecture=arch,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=() if eos is None else (int(eos),),
        )


def _hf_rope_theta(cfg: dict[str, Any]) -> float:
    params = cfg.get("rope_parameters") or {}
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def _hf_rope_scaling(cfg: dict[str, Any], where: str) -> RopeScaling:
    # transformers 5 writes "rope_parameters" (theta inside); older files write "rope_scaling".
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"{where}: unsupported rope scaling type {kind!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if kind == "default":
        return RopeScaling()
    return RopeScaling(
        rope_type=kind,
        factor=float(params["factor"]),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", cfg.get("max_position_embeddings", 8192))
        ),
    )
