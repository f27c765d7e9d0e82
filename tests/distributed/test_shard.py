"""The split plan: which heads, MLP rows and vocabulary rows each rank holds (no processes)."""

from __future__ import annotations

import pytest
import torch

from mixserve.distributed.shard import even_spans, head_spans, plan_shards, shard_state_dict
from mixserve.model.config import ModelConfig


def config(heads: int, kv_heads: int, *, head_dim: int = 4, intermediate: int = 10,
           vocab: int = 11) -> ModelConfig:
    return ModelConfig(vocab_size=vocab, hidden_size=heads * head_dim, intermediate_size=intermediate,
                       num_layers=1, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                       max_position_embeddings=64)


def test_even_spans_give_the_first_spans_the_remainder():
    assert even_spans(9, 2) == [(0, 5), (5, 9)]
    assert even_spans(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]


def test_default_model_shape_splits_by_group_unevenly():
    # SmolLM2-135M: 9 query heads in 3 KV groups over 2 ranks -> 2 groups (6 heads) and 1 group (3 heads)
    assert head_spans(9, 3, 2) == [((0, 6), (0, 2)), ((6, 9), (2, 3))]


def test_fewer_groups_than_ranks_replicate_the_kv_heads():
    assert head_spans(4, 1, 2) == [((0, 2), (0, 1)), ((2, 4), (0, 1))]
    assert head_spans(8, 2, 4) == [((0, 2), (0, 1)), ((2, 4), (0, 1)), ((4, 6), (1, 2)), ((6, 8), (1, 2))]


@pytest.mark.parametrize(("heads", "kv_heads", "world"), [(6, 2, 7), (4, 2, 3), (2, 1, 4)])
def test_impossible_splits_name_tensor_parallel_size(heads, kv_heads, world):
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        head_spans(heads, kv_heads, world)


def test_the_shards_of_every_weight_put_back_together_are_the_whole():
    cfg = config(9, 3)
    h, d, q, kv = cfg.hidden_size, cfg.head_dim, 9 * 4, 3 * 4
    sd = {"model.embed_tokens.weight": torch.randn(cfg.vocab_size, h), "lm_head.weight": torch.randn(11, h),
          "model.layers.0.self_attn.q_proj.weight": torch.randn(q, h),
          "model.layers.0.self_attn.k_proj.weight": torch.randn(kv, h),
          "model.layers.0.self_attn.v_proj.weight": torch.randn(kv, h),
          "model.layers.0.self_attn.o_proj.weight": torch.randn(h, q),
          "model.layers.0.mlp.gate_proj.weight": torch.randn(10, h),
          "model.layers.0.mlp.up_proj.weight": torch.randn(10, h),
          "model.layers.0.mlp.down_proj.weight": torch.randn(h, 10),
          "model.layers.0.input_layernorm.weight": torch.randn(h)}
    plans = plan_shards(cfg, 2)
    shards = [shard_state_dict(sd, cfg, p) for p in plans]
    cols = ("o_proj", "down_proj")
    for name, whole in sd.items():
        if "layernorm" in name:  # replicated
            assert all(torch.equal(s[name], whole) for s in shards)
            continue
        dim = 1 if any(c in name for c in cols) else 0
        assert torch.equal(torch.cat([s[name] for s in shards], dim=dim), whole), name
    # rank 0's local shapes: 6 query heads, 2 KV heads, 5 MLP rows, 6 vocabulary rows; rank 1 the rest
    local = [p.local_config(cfg) for p in plans]
    assert [(c.num_heads, c.num_kv_heads, c.intermediate_size, c.vocab_size) for c in local] == [
        (6, 2, 5, 6), (3, 1, 5, 5)]
    assert shards[0]["model.layers.0.self_attn.o_proj.weight"].shape == (h, 6 * d)


def test_a_mixture_of_experts_is_refused_naming_tensor_parallel_size():
    from dataclasses import replace

    from mixserve.model.config import MoeConfig

    moe = MoeConfig(num_experts=4, top_k=2, intermediate_size=8)
    cfg = replace(config(4, 2), family="qwen3_moe", moe=moe)
    with pytest.raises(ValueError, match="^tensor_parallel_size 2: the experts .*qwen3_moe") as e:
        plan_shards(cfg, 2)
    assert "\n" not in str(e.value)
