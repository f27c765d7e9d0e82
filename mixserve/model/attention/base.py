"""The attention backend seam: per-forward metadata built once, one attention call per layer, graph hooks.

The one host-side flattener of a ForwardBatch (`flatten`: positions, slots, lengths, block tables) lives
here; eager metadata (`build_metadata`) and the CUDA-graph inputs (runner/cuda_graph.py) both use it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import torch

from mixserve.core.batch import ForwardBatch


class AttentionPlan:
    """A backend's own per-forward state (query tiles, masks, a context capacity), typed by subclassing."""


@dataclass
class AttentionMetadata:
    """Built once per forward by the backend, shared by every layer (docs/architecture.md)."""

    positions: torch.Tensor  # (T,) int64: absolute position of each packed token
    slot_mapping: torch.Tensor  # (T,) int64: flat KV slot each token's K/V is written to
    query_start: torch.Tensor  # (S+1,) int64: cumulative query lengths (cu_seqlens_q)
    seq_lens: torch.Tensor  # (S,) int64: context length after this step
    block_tables: torch.Tensor  # (S, width) int64, padded with 0
    last_token_index: torch.Tensor  # (S,) int64: packed index of each sequence's last token
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    plan: AttentionPlan | None = None  # the backend's own state; None: the common fields are enough
    # (R,) int64: packed index of each logits row when a sequence wants more than its last (drafts to
    # verify: ForwardSeq.num_logits); None: one row per sequence, last_token_index
    logits_index: torch.Tensor | None = None


@dataclass
class HostBatch:
    """A ForwardBatch flattened on the host: per token its id, position and KV slot; per sequence its
    query and context lengths and its block table, padded (with 0) or cut to `width` columns."""

    token_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[int]  # row-major, width columns per sequence
    width: int

    def pad_rows(self, size: int, scratch_block: int, block_size: int) -> HostBatch:
        """The batch grown to `size` single-token rows for a CUDA graph: a padding row is token 0 at
        position 0, written to the scratch block's first slot and attending to it alone (seq_len 1), so
        it can neither disturb a real request nor produce an all-masked row."""
        pad = size - len(self.query_lens)
        if pad < 0:
            raise ValueError(f"{len(self.query_lens)} sequences do not fit a graph of {size} rows")
        return HostBatch(self.token_ids + [0] * pad, self.positions + [0] * pad,
                         self.slot_mapping + [scratch_block * block_size] * pad, self.query_lens + [1] * pad,
                         self.seq_lens + [1] * pad, self.block_tables + [scratch_block] * (pad * self.width),
                         self.width)


def flatten(batch: ForwardBatch, block_size: int, width: int | None = None) -> HostBatch:
    """The batch as flat int lists; tables get max(width, the blocks the longest context needs) columns.

    Checks each sequence once (tokens present, a block table long enough): a clear ValueError otherwise.
    """
    if not batch.seqs:
        raise ValueError("empty ForwardBatch: nothing to run")
    positions: list[int] = []
    slots: list[int] = []
    query_lens: list[int] = []
    seq_lens: list[int] = []
    for s in batch.seqs:
        n = len(s.tokens)
        if n == 0:
            raise ValueError(f"sequence {s.request_id!r} has no tokens")
        table, end = s.block_table, s.start + n
        if len(table) * block_size < end:
            raise ValueError(f"sequence {s.request_id!r}: block table of {len(table)} blocks cannot hold "
                             f"{end} positions at block_size {block_size}")
        span = range(s.start, end)
        positions.extend(span)
        slots.extend(table[p // block_size] * block_size + p % block_size for p in span)
        query_lens.append(n)
        seq_lens.append(end)
    width = max(width or 0, -(-max(seq_lens) // block_size), 1)
    tables: list[int] = []
    for s in batch.seqs:
        row = list(s.block_table[:width])
        tables.extend(row + [0] * (width - len(row)))
    tokens = list(chain.from_iterable(s.tokens for s in batch.seqs))
    return HostBatch(tokens, positions, slots, query_lens, seq_lens, tables, width)


def to_device(lists: dict[str, list[int]], device: torch.device) -> dict[str, torch.Tensor]:
    """All the lists in one int64 H2D copy (pinned and non-blocking on CUDA: the host never waits), viewed
    back by name."""
    flat = torch.tensor(list(chain.from_iterable(lists.values())), dtype=torch.int64)
    dev = flat.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else flat.to(device)
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for name, values in lists.items():
        out[name] = dev[offset:offset + len(values)]
        offset += len(values)
    return out


def device_metadata(host: HostBatch, device: torch.device, extra_lists: dict[str, list[int]] | None = None,
                    ) -> tuple[AttentionMetadata, dict[str, torch.Tensor]]:
    """The common metadata of a flattened batch, plus `extra_lists` riding in the same single H2D copy."""
    lists = {"positions": host.positions, "slot_mapping": host.slot_mapping, "query_lens": host.query_lens,
             "seq_lens": host.seq_lens, "block_tables": host.block_tables}
    extra_lists = extra_lists or {}
    if set(extra_lists) & set(lists):
        raise ValueError(f"extra_lists {sorted(extra_lists)} clash with the metadata's own names")
    t = to_device({**lists, **extra_lists}, device)
    num_seqs = len(host.query_lens)
    query_start = torch.zeros(num_seqs + 1, dtype=torch.int64, device=device)
    torch.cumsum(t["query_lens"], 0, out=query_start[1:])
    meta = AttentionMetadata(
        positions=t["positions"], slot_mapping=t["slot_mapping"], query_start=query_start,
        seq_lens=t["seq_lens"], block_tables=t["block_tables"].view(num_seqs, host.width),
        last_token_index=query_start[1:] - 1, query_lens_cpu=host.query_lens, seq_lens_cpu=host.seq_lens)
    return meta, {name: t[name] for name in extra_lists}


def build_metadata(batch: ForwardBatch, block_size: int, device: torch.device,
                   width: int | None = None) -> AttentionMetadata:
    """The common metadata of a batch (block tables of at least `width` columns), in one H2D copy."""
    return device_metadata(flatten(batch, block_size, width), device)[0]


def logits_index(batch: ForwardBatch) -> list[int] | None:
    """The packed index of every logits row, each sequence's last `num_logits` tokens; None when that is
    just each sequence's last token."""
    if all(s.num_logits == 1 for s in batch.seqs):
        return None
    index, end = [], 0
    for s in batch.seqs:
        end += len(s.tokens)
        if not 1 <= s.num_logits <= len(s.tokens):
            raise ValueError(f"sequence {s.request_id!r}: num_logits {s.num_logits} is outside "
                             f"1..{len(s.tokens)}")
        index.extend(range(end - s.num_logits, end))
    return index


def packed_tokens(batch: ForwardBatch, device: torch.device) -> torch.Tensor:
    """All sequences' tokens in one (T,) int64 tensor, in batch order."""
    return torch.tensor(list(chain.from_iterable(s.tokens for s in batch.seqs)), dtype=torch.int64).to(device)


def is_decode_only(batch: ForwardBatch) -> bool:
    """True when every sequence is a single-token decode."""
    return bool(batch.seqs) and all(len(s.tokens) == 1 for s in batch.seqs)


def check_features(head_dim: int, scale: float | None, window: int, softcap: float) -> float:
    """The score scale a layer's call means (None: head_dim ** -0.5); ValueError for a negative window or a
    negative softcap, which no model defines."""
    if window < 0:
        raise ValueError(f"attention window must be 0 (full) or positive, got {window}")
    if softcap < 0:
        raise ValueError(f"attention softcap must be 0 (none) or positive, got {softcap}")
    return head_dim ** -0.5 if scale is None else float(scale)


@dataclass
class GraphInputs:
    """Views into a CUDA graph's static input buffer (runner/cuda_graph.py), one row per padded decode."""

    positions: torch.Tensor  # (size,)
    slot_mapping: torch.Tensor  # (size,)
    seq_lens: torch.Tensor  # (size,)
    block_tables: torch.Tensor  # (size, ctx // block_size)


class AttentionBackend(ABC):
    """Causal attention of packed tokens over a paged KV cache."""

    name: str = "base"
    supports_graphs: bool = False  # True: decode_capacity and graph_metadata serve runner/cuda_graph.py

    def configure(self, num_heads: int, num_kv_heads: int, device: torch.device | None = None) -> None:
        """Told once by the runner the model's head counts and device, before any prepare (default: unused).
        """
        return None

    def prepare(self, batch: ForwardBatch, block_size: int, device: torch.device) -> AttentionMetadata:
        """Per-forward metadata; backends may attach their own plan."""
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
        *,
        scale: float | None = None,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        """q (T, Hq, D), k/v (T, Hkv, D); caches (num_blocks, block_size, Hkv, D).
        Writes k, v into the caches at meta.slot_mapping, then returns (T, Hq, D): each token
        attends causally to positions 0..its own of its own sequence (GQA: Hq/Hkv query heads per KV head).

        Per layer: `scale` multiplies q.k (None: D ** -0.5); `window` w > 0 keeps only the keys at
        p - w < j <= p for a query at p (Hugging Face's sliding window); `softcap` c > 0 maps each scaled
        score s to c * tanh(s / c) before the softmax (Gemma 2). See check_features. The cache keeps the keys
        below a window (docs/decisions/sliding-window-keeps-full-kv.md)."""

    # ---- CUDA-graph hooks (capture once per (padded size, capacity), replay with new static inputs) ----

    def decode_capacity(self, seq_lens: Sequence[int], block_size: int) -> int | None:
        """The context capacity (a multiple of block_size) the decode path runs single-token sequences of
        these context lengths at, or None where they take another path (so no graph)."""
        return None

    def graph_metadata(self, inputs: GraphInputs, ctx: int, block_size: int) -> AttentionMetadata:
        """Metadata over a graph's static inputs, built at capture: every replay reads these tensors."""
        raise NotImplementedError(f"the {self.name} attention backend does not run in CUDA graphs")
