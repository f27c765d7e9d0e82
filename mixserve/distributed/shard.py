"""Megatron-style split of a Llama checkpoint over N ranks: which heads, MLP rows and vocabulary rows a
rank holds, and that rank's slice of the HF-named state dict.

Column-parallel: QKV and gate/up (output rows split), embedding and LM head (vocabulary rows split).
Row-parallel: o_proj and down (input columns split; their outputs are all-reduced by the hooks). Attention
splits by KV-head group, so a rank's query heads always find their K/V heads locally: with G groups and
N <= G ranks the groups are dealt out as evenly as they go (9 heads in 3 groups over 2 ranks: 6 + 3 query
heads, o_proj columns sliced to match); with N > G every group is replicated on N/G ranks, which split
its query heads (N must then be a multiple of G).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from mixserve.model.config import ModelConfig

Span = tuple[int, int]  # [start, end)


def even_spans(n: int, parts: int) -> list[Span]:
    """`n` items in `parts` contiguous spans, the first n % parts one longer (array_split's rule)."""
    base, extra = divmod(n, parts)
    spans, start = [], 0
    for i in range(parts):
        end = start + base + (i < extra)
        spans.append((start, end))
        start = end
    return spans


@dataclass(frozen=True)
class ShardPlan:
    """What rank `rank` of `world` holds: query heads, KV heads, MLP rows, vocabulary rows."""

    rank: int
    world: int
    q_heads: Span
    kv_heads: Span
    ffn: Span
    vocab: Span
    vocab_spans: tuple[Span, ...]  # every rank's vocabulary span, for the logits gather

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """The config of this rank's DecoderModel: its own head, MLP and vocabulary counts."""
        return replace(cfg, num_heads=self.q_heads[1] - self.q_heads[0],
                       num_kv_heads=self.kv_heads[1] - self.kv_heads[0],
                       intermediate_size=self.ffn[1] - self.ffn[0], vocab_size=self.vocab[1] - self.vocab[0])


def head_spans(num_heads: int, num_kv_heads: int, world: int) -> list[tuple[Span, Span]]:
    """Per rank (query head span, KV head span); ValueError naming tensor_parallel_size if it cannot split."""
    if num_heads % num_kv_heads:
        raise ValueError(f"tensor_parallel_size: {num_heads} query heads do not form {num_kv_heads} groups")
    per_group = num_heads // num_kv_heads
    if num_kv_heads >= world:
        return [((a * per_group, b * per_group), (a, b)) for a, b in even_spans(num_kv_heads, world)]
    if world % num_kv_heads:
        raise ValueError(f"tensor_parallel_size: {world} ranks cannot share {num_kv_heads} KV heads evenly "
                         f"(with fewer KV heads than ranks, the ranks must be a multiple of them)")
    ranks_per_group = world // num_kv_heads
    if per_group < ranks_per_group:
        raise ValueError(f"tensor_parallel_size: {world} ranks exceed the model's {num_heads} query heads")
    return [((g * per_group + a, g * per_group + b), (g, g + 1))
            for g in range(num_kv_heads) for a, b in even_spans(per_group, ranks_per_group)]


def plan_shards(cfg: ModelConfig, world: int) -> list[ShardPlan]:
    """One ShardPlan per rank."""
    if world < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {world}")
    if cfg.moe is not None:
        raise ValueError(f"tensor_parallel_size {world}: the experts of a mixture-of-experts model "
                         f"({cfg.family}) are not split over ranks; run it with tensor_parallel_size 1")
    heads = head_spans(cfg.num_heads, cfg.num_kv_heads, world)
    if cfg.intermediate_size < world or cfg.vocab_size < world:
        raise ValueError(f"tensor_parallel_size: {world} ranks exceed the model's MLP or vocabulary size")
    ffn, vocab = even_spans(cfg.intermediate_size, world), even_spans(cfg.vocab_size, world)
    return [ShardPlan(r, world, heads[r][0], heads[r][1], ffn[r], vocab[r], tuple(vocab))
            for r in range(world)]


def shard_state_dict(sd: dict[str, torch.Tensor], cfg: ModelConfig, plan: ShardPlan,
                     ) -> dict[str, torch.Tensor]:
    """This rank's slice of an HF-named state dict (as DecoderModel.load_hf_weights takes it)."""
    d = cfg.head_dim
    (qa, qb), (ka, kb), (fa, fb), (va, vb) = plan.q_heads, plan.kv_heads, plan.ffn, plan.vocab
    rows = {"q_proj": (qa * d, qb * d), "k_proj": (ka * d, kb * d), "v_proj": (ka * d, kb * d),
            "gate_proj": (fa, fb), "up_proj": (fa, fb)}
    cols = {"o_proj": (qa * d, qb * d), "down_proj": (fa, fb)}
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        parts = name.split(".")
        module = parts[-2] if len(parts) >= 2 else ""
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            t = t[va:vb]
        elif module in rows:  # weights and biases: the output rows
            a, b = rows[module]
            t = t[a:b]
        elif module in cols and parts[-1] == "weight":
            a, b = cols[module]
            t = t[:, a:b]
        out[name] = t.contiguous()
    return out
