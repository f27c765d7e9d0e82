"""What travels over the KV link: a prompt's full KV blocks as one tensor, and the check that both ends
lay their caches out alike.

A payload is (layers, 2, blocks, block_size, kv_heads, head_dim): per layer K then V, the blocks in the
prompt's order. The sender gathers them from its block ids, the receiver scatters them into block ids of
its own (the mapping); only the order is shared, never an id.
"""

from __future__ import annotations

from typing import Any

import torch


def num_full_blocks(num_tokens: int, block_size: int) -> int:
    """The full blocks a prompt can hand over: those before the block holding its last token, which the
    decode side always computes itself (its logits give the first token; core/prefix_cache.py)."""
    return max(num_tokens - 1, 0) // block_size


def describe(runner: Any) -> dict[str, Any]:
    """This end's KV layout and model, sent as the link's hello."""
    cfg = runner.config
    return {"model": runner.model_name, "vocab_size": cfg.vocab_size, "block_size": runner.block_size,
            "num_layers": cfg.num_layers, "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
            "dtype": str(runner.dtype).removeprefix("torch.")}


def check_peer(mine: dict[str, Any], theirs: dict[str, Any]) -> None:
    """ValueError naming every field on which the two ends differ (their K/V could not be exchanged)."""
    keys = ("model", "vocab_size", "block_size", "num_layers", "num_kv_heads", "head_dim", "dtype")
    diff = [f"{k} {mine.get(k)!r} here, {theirs.get(k)!r} there"
            for k in keys if mine.get(k) != theirs.get(k)]
    if diff:
        raise ValueError("kv_peer: the two instances must serve the same model with the same KV layout: "
                         + "; ".join(diff))


def gather_blocks(layers: list[tuple[torch.Tensor, torch.Tensor]], blocks: list[int]) -> torch.Tensor:
    """A copy of `blocks` of every layer's K and V, on the CPU (gloo sends CPU tensors)."""
    device = layers[0][0].device
    index = torch.tensor(blocks, dtype=torch.long, device=device)
    payload = torch.stack([torch.stack((k.index_select(0, index), v.index_select(0, index)))
                           for k, v in layers])
    return payload.cpu()


def scatter_blocks(layers: list[tuple[torch.Tensor, torch.Tensor]], blocks: list[int],
                   payload: torch.Tensor) -> None:
    """Write payload block i into block `blocks[i]` of every layer's K and V."""
    expected = (len(layers), 2, len(blocks), *layers[0][0].shape[1:])
    if tuple(payload.shape) != expected:
        raise ValueError(f"KV payload of shape {tuple(payload.shape)}, expected {expected}")
    device = layers[0][0].device
    index = torch.tensor(blocks, dtype=torch.long, device=device)
    payload = payload.to(device)
    for i, (k, v) in enumerate(layers):
        k.index_copy_(0, index, payload[i, 0].to(k.dtype))
        v.index_copy_(0, index, payload[i, 1].to(v.dtype))
