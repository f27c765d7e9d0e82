"""The attention backend seam: per-forward metadata built once, and one attention call per layer."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import torch

from mixserve.core.batch import ForwardBatch


@dataclass
class AttentionMetadata:
    """Built once per forward by the backend, shared by every layer (docs/structures.md)."""

    positions: torch.Tensor  # (T,) int64: absolute position of each packed token
    slot_mapping: torch.Tensor  # (T,) int64: flat KV slot each token's K/V is written to
    query_start: torch.Tensor  # (S+1,) int64: cumulative query lengths (cu_seqlens_q)
    seq_lens: torch.Tensor  # (S,) int64: context length after this step
    block_tables: torch.Tensor  # (S, max_blocks) int64, padded with 0
    last_token_index: torch.Tensor  # (S,) int64: packed index of each sequence's last token
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    extra: dict[str, Any] = field(default_factory=dict)


def build_metadata(batch: ForwardBatch, block_size: int, device: torch.device) -> AttentionMetadata:
    """The common metadata of a batch, built on the CPU with per-sequence (not per-token) Python work."""
    seqs = batch.seqs
    if not seqs:
        raise ValueError("empty ForwardBatch: nothing to run")
    query_lens = [len(s.tokens) for s in seqs]
    starts = [s.start for s in seqs]
    seq_lens = [st + n for st, n in zip(starts, query_lens, strict=True)]
    for s, n in zip(seqs, seq_lens, strict=True):
        if len(s.tokens) == 0:
            raise ValueError(f"sequence {s.request_id!r} has no tokens")
        if len(s.block_table) * block_size < n:
            raise ValueError(
                f"sequence {s.request_id!r}: block table of {len(s.block_table)} blocks cannot hold "
                f"{n} positions at block_size {block_size}"
            )
    max_blocks = max(len(s.block_table) for s in seqs)
    tables = torch.zeros((len(seqs), max_blocks), dtype=torch.int64)
    for i, s in enumerate(seqs):
        tables[i, : len(s.block_table)] = torch.as_tensor(s.block_table, dtype=torch.int64)
    qlens = torch.tensor(query_lens, dtype=torch.int64)
    query_start = torch.zeros(len(seqs) + 1, dtype=torch.int64)
    torch.cumsum(qlens, 0, out=query_start[1:])
    seq_index = torch.repeat_interleave(torch.arange(len(seqs)), qlens)
    # position of token j of sequence i = start_i + (j - query_start_i)
    offsets = torch.arange(int(query_start[-1])) - query_start[:-1].repeat_interleave(qlens)
    positions = torch.tensor(starts, dtype=torch.int64).repeat_interleave(qlens) + offsets
    slot_mapping = tables[seq_index, positions // block_size] * block_size + positions % block_size
    return AttentionMetadata(
        positions=positions.to(device),
        slot_mapping=slot_mapping.to(device),
        query_start=query_start.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
        block_tables=tables.to(device),
        last_token_index=(query_start[1:] - 1).to(device),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
    )


def packed_tokens(batch: ForwardBatch, device: torch.device) -> torch.Tensor:
    """All sequences' tokens in one (T,) int64 tensor, in batch order."""
    return torch.tensor(list(chain.from_iterable(s.tokens for s in batch.seqs)), dtype=torch.int64).to(device)


class AttentionBackend(ABC):
    """Causal attention of packed tokens over a paged KV cache."""

    name: str = "base"

    def configure(self, num_heads: int, num_kv_heads: int) -> None:
        """Told once by the runner the model's head counts, before any prepare (default: not needed)."""
        return None

    def prepare(self, batch: ForwardBatch, block_size: int, device: torch.device) -> AttentionMetadata:
        """Per-forward metadata; backends may add to `extra`."""
        return build_metadata(batch, block_size, device)

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """q (T, Hq, D), k/v (T, Hkv, D); caches (num_blocks, block_size, Hkv, D).
        Writes k, v into the caches at meta.slot_mapping, then returns (T, Hq, D): each token
        attends causally to positions 0..its own of its own sequence (GQA: Hq/Hkv query heads per KV head)."""
