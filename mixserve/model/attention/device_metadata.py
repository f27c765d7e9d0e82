"""The per-forward metadata of the CUDA backends, built on the host and sent in one H2D copy.

Positions, cache slots, lengths and block tables of a ForwardBatch are flattened into one int64 list,
copied once (pinned and non-blocking on CUDA, so the host never waits for the device), and viewed back
as the AttentionMetadata fields every layer reads.
"""

from __future__ import annotations

import torch

from mixserve.core import ForwardBatch
from mixserve.model.attention.base import AttentionMetadata


def host_inputs(batch: ForwardBatch, block_size: int, width: int | None = None) -> dict[str, list[int]]:
    """The batch as flat int lists (positions, slots, lengths, block tables padded to `width` columns)."""
    positions: list[int] = []
    slots: list[int] = []
    query_lens: list[int] = []
    seq_lens: list[int] = []
    for s in batch.seqs:
        n = len(s.tokens)
        table, span = s.block_table, range(s.start, s.start + n)
        positions.extend(span)
        slots.extend(table[p // block_size] * block_size + p % block_size for p in span)
        query_lens.append(n)
        seq_lens.append(s.start + n)
    need = max(-(-n // block_size) for n in seq_lens) if seq_lens else 1
    width = max(width or 0, need, 1)
    tables: list[int] = []
    for s in batch.seqs:
        row = list(s.block_table[:width])
        tables.extend(row + [0] * (width - len(row)))
    return {"positions": positions, "slot_mapping": slots, "query_lens": query_lens,
            "seq_lens": seq_lens, "block_tables": tables, "width": [width]}


def to_device(lists: dict[str, list[int]], device: torch.device) -> dict[str, torch.Tensor]:
    """One H2D copy for all the ints (pinned and non-blocking on CUDA, so the host never waits)."""
    names = [k for k in lists if k != "width"]
    flat = [x for k in names for x in lists[k]]
    host = torch.tensor(flat, dtype=torch.int64)
    if device.type == "cuda":
        dev = host.pin_memory().to(device, non_blocking=True)
    else:
        dev = host.to(device)
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for k in names:
        n = len(lists[k])
        out[k] = dev[offset:offset + n]
        offset += n
    return out


def build_device_metadata(batch: ForwardBatch, block_size: int, device: torch.device,
                          width: int | None = None,
                          extra_lists: dict[str, list[int]] | None = None) -> AttentionMetadata:
    """The shared AttentionMetadata fields of DESIGN's seam (positions, slots, lengths, tables).

    extra_lists ride along in the same single H2D copy; their device tensors land in meta.extra.
    """
    lists = host_inputs(batch, block_size, width)
    extra_lists = extra_lists or {}
    if set(extra_lists) & set(lists):
        raise ValueError(f"extra_lists {sorted(extra_lists)} clash with the metadata's own names")
    t = to_device({**lists, **extra_lists}, device)
    num_seqs = len(batch.seqs)
    query_lens = t["query_lens"]
    query_start = torch.zeros(num_seqs + 1, dtype=torch.int64, device=device)
    torch.cumsum(query_lens, 0, out=query_start[1:])
    return AttentionMetadata(
        positions=t["positions"],
        slot_mapping=t["slot_mapping"],
        query_start=query_start,
        seq_lens=t["seq_lens"],
        block_tables=t["block_tables"].view(num_seqs, lists["width"][0]),
        last_token_index=query_start[1:] - 1,
        query_lens_cpu=lists["query_lens"],
        seq_lens_cpu=lists["seq_lens"],
        extra={k: t[k] for k in extra_lists},
    )
