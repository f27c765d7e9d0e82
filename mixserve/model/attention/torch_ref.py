"""Reference attention on plain torch (any device): SDPA over K/V gathered from the paged cache.

Every single-token sequence (the decodes) goes through one batched SDPA call over K/V padded to the
longest context and masked by length; each multi-token sequence (a prefill chunk) gets its own call.
A layer's window only changes the masks (made once per forward and window); its softcap swaps SDPA for
explicit float32 scores (sdpa.capped_attention).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mixserve.core.batch import ForwardBatch
from mixserve.model.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    AttentionPlan,
    build_metadata,
    check_features,
)
from mixserve.model.attention.sdpa import attend_sequence, attention, causal_mask, gather_kv, write_kv


@dataclass
class TorchPlan(AttentionPlan):
    """The decodes as one batch (rows, tables, lengths), the chunks as (seq, begin, n, length); the masks
    per window, made on first use and kept for the forward's other layers."""

    decode_rows: torch.Tensor | None = None  # (B,) packed rows of the decodes; None: no decode
    decode_tables: torch.Tensor | None = None  # (B, width)
    decode_len: int = 0  # the longest decode context
    decode_lens: torch.Tensor | None = None  # (B,) int64 on the host: each decode's context length
    chunks: list[tuple[int, int, int, int]] = field(default_factory=list)
    masks: dict[tuple[int, int, int], torch.Tensor | None] = field(default_factory=dict)

    def decode_mask(self, window: int, device: torch.device) -> torch.Tensor:
        """(B, 1, 1, decode_len): the keys each decode sees (below its length; within its window)."""
        key = (0, -1, window)
        if key not in self.masks:
            assert self.decode_lens is not None
            keys, lens = torch.arange(self.decode_len).unsqueeze(0), self.decode_lens.unsqueeze(1)
            mask = keys < lens
            if window > 0:  # keys below the window stay in the cache (no block is freed): masked here
                mask &= keys >= lens - window
            self.masks[key] = mask[:, None, None, :].to(device)
        return self.masks[key]

    def chunk_mask(self, n: int, length: int, window: int, device: torch.device) -> torch.Tensor | None:
        """causal_mask(n, length, window), made once per forward."""
        key = (n, length, window)
        if key not in self.masks:
            self.masks[key] = causal_mask(n, length, device, window)
        return self.masks[key]


class TorchAttention(AttentionBackend):
    """The reference backend: one batched call for the decodes, a loop over the prefill chunks."""

    name = "torch"

    def prepare(self, batch: ForwardBatch, block_size: int, device: torch.device) -> AttentionMetadata:
        meta = build_metadata(batch, block_size, device)
        qlens, lens = meta.query_lens_cpu, meta.seq_lens_cpu
        plan = TorchPlan()
        decodes = [i for i, n in enumerate(qlens) if n == 1]
        if decodes:
            idx = torch.tensor(decodes, dtype=torch.int64).to(device)
            plan.decode_rows = meta.last_token_index[idx]
            plan.decode_tables = meta.block_tables[idx]
            plan.decode_len = max(lens[i] for i in decodes)
            plan.decode_lens = torch.tensor([lens[i] for i in decodes], dtype=torch.int64)
            plan.decode_mask(0, device)  # the full-attention mask, as every model's layers use
        begin = 0
        for i, (n, length) in enumerate(zip(qlens, lens, strict=True)):
            if n > 1:
                plan.chunks.append((i, begin, n, length))
                plan.chunk_mask(n, length, 0, device)
            begin += n
        meta.plan = plan
        return meta

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, *, scale: float | None = None,
                window: int = 0, softcap: float = 0.0) -> torch.Tensor:
        plan = meta.plan
        if not isinstance(plan, TorchPlan):
            raise ValueError("TorchAttention.forward needs metadata from TorchAttention.prepare")
        check_features(q.shape[-1], scale, window, softcap)
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        if plan.decode_rows is not None:
            rows, tables, length = plan.decode_rows, plan.decode_tables, plan.decode_len
            o = attention(
                q[rows].unsqueeze(2),  # (B, Hq, 1, D)
                gather_kv(k_cache, tables, length),
                gather_kv(v_cache, tables, length),
                plan.decode_mask(window, q.device), False, scale, softcap,
            )
            out[rows] = o.squeeze(2)
        for i, begin, n, length in plan.chunks:
            mask = plan.chunk_mask(n, length, window, q.device)
            out[begin:begin + n] = attend_sequence(q, k, v, k_cache, v_cache, meta.block_tables[i:i + 1],
                                                   begin, n, length, mask, scale, softcap)
        return out
