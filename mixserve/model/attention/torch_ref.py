"""Reference attention on plain torch (any device): SDPA over K/V gathered from the paged cache.

Every single-token sequence (the decodes) goes through one batched SDPA call over K/V padded to the
longest context and masked by length; each multi-token sequence (a prefill chunk) gets its own call.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from mixserve.core.batch import ForwardBatch
from mixserve.model.attention.base import AttentionBackend, AttentionMetadata, AttentionPlan, build_metadata
from mixserve.model.attention.sdpa import attend_sequence, causal_mask, gather_kv, write_kv


@dataclass
class TorchPlan(AttentionPlan):
    """The decodes as one batch (rows, tables, length mask), the chunks as (seq, begin, n, length, mask)."""

    decode_rows: torch.Tensor | None = None  # (B,) packed rows of the decodes; None: no decode
    decode_tables: torch.Tensor | None = None  # (B, width)
    decode_len: int = 0  # the longest decode context
    decode_mask: torch.Tensor | None = None  # (B, 1, 1, decode_len): keys up to each own position
    chunks: list[tuple[int, int, int, int, torch.Tensor | None]] = field(default_factory=list)


class TorchAttention(AttentionBackend):
    """The reference backend: one batched call for the decodes, a loop over the prefill chunks."""

    name = "torch"

    def prepare(self, batch: ForwardBatch, block_size: int, device: torch.device) -> AttentionMetadata:
        meta = build_metadata(batch, block_size, device)
        qlens, lens = meta.query_lens_cpu, meta.seq_lens_cpu
        plan = TorchPlan()
        decodes = [i for i, n in enumerate(qlens) if n == 1]
        if decodes:
            longest = max(lens[i] for i in decodes)
            idx = torch.tensor(decodes, dtype=torch.int64).to(device)
            dec_lens = torch.tensor([lens[i] for i in decodes], dtype=torch.int64)
            plan.decode_rows = meta.last_token_index[idx]
            plan.decode_tables = meta.block_tables[idx]
            plan.decode_len = longest
            mask = torch.arange(longest).unsqueeze(0) < dec_lens.unsqueeze(1)
            plan.decode_mask = mask[:, None, None, :].to(device)
        begin = 0
        for i, (n, length) in enumerate(zip(qlens, lens, strict=True)):
            if n > 1:
                plan.chunks.append((i, begin, n, length, causal_mask(n, length, device)))
            begin += n
        meta.plan = plan
        return meta

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        plan = meta.plan
        if not isinstance(plan, TorchPlan):
            raise ValueError("TorchAttention.forward needs metadata from TorchAttention.prepare")
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        if plan.decode_rows is not None:
            rows, tables, length = plan.decode_rows, plan.decode_tables, plan.decode_len
            o = F.scaled_dot_product_attention(
                q[rows].unsqueeze(2),  # (B, Hq, 1, D)
                gather_kv(k_cache, tables, length),
                gather_kv(v_cache, tables, length),
                attn_mask=plan.decode_mask,
                enable_gqa=True,
            )
            out[rows] = o.squeeze(2)
        for i, begin, n, length, mask in plan.chunks:
            out[begin:begin + n] = attend_sequence(q, k, v, k_cache, v_cache, meta.block_tables[i:i + 1],
                                                   begin, n, length, mask)
        return out
