"""Rotary position embeddings at absolute positions, with HF's rotate-half layout and rope scaling."""

from __future__ import annotations

import math

import torch

from mixserve.model.config import ModelConfig


def inv_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """The per-pair inverse frequencies (head_dim/2,) float32, scaled as HF scales them."""
    dim = cfg.head_dim
    # Same arithmetic as transformers so the tables are bit-identical.
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    s = cfg.rope_scaling
    if s.rope_type == "longrope":  # short factors; RotaryTable takes the long ones past the original
        inv = longrope_inv(cfg, s.short_factor)
    elif s.rope_type == "linear":
        inv = inv / s.factor
    elif s.rope_type == "llama3":
        old = s.original_max_position_embeddings
        low_wavelen = old / s.low_freq_factor
        high_wavelen = old / s.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
        smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        inv = torch.where(medium, smoothed, scaled)
    return inv


def longrope_inv(cfg: ModelConfig, factors: tuple[float, ...]) -> torch.Tensor:
    """Phi-3's longrope inverse frequencies for one factor set, in HF's arithmetic."""
    shape = torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float() / cfg.head_dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * cfg.rope_theta ** shape)


class RotaryTable:
    """cos/sin for every position up to the context length, computed once; indexed per forward."""

    def __init__(self, cfg: ModelConfig, device: torch.device, dtype: torch.dtype, inv_freq=None):
        inv = inv_frequencies(cfg) if inv_freq is None else inv_freq.float()
        pos = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(pos, inv)
        s = cfg.rope_scaling
        if s.rope_type == "longrope" and inv_freq is None:
            # Per position, as vLLM does: the short factors below the original context, the long ones from
            # it (HF switches the whole forward on its longest position: the same below the original).
            long = longrope_inv(cfg, s.long_factor)
            start = s.original_max_position_embeddings
            freqs[start:] = torch.outer(pos[start:], long)
        scale = s.attention_factor if s.rope_type == "longrope" else 1.0
        # Only the first half is stored: the rotate-half layout repeats it.
        self.cos = (freqs.cos() * scale).to(device=device, dtype=dtype)
        self.sin = (freqs.sin() * scale).to(device=device, dtype=dtype)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, 1, D/2) cos and sin for the packed tokens' absolute positions."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (T, H, D) by rotate-half RoPE: pairs are (i, i + D/2)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
