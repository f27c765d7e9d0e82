"""CUDA graphs for decode-only steps: capture once per (padded batch size, context capacity), then replay.

A decode step of a small model is launch-bound (hundreds of small kernels), so replaying one captured graph
saves most of its time. Batch sizes are padded up a ladder (1, 2, 4, ... max_num_seqs) and contexts up to
a capacity bucket, so a few graphs serve every step; padding rows point at a scratch KV block that no
request owns. Mixed steps (any prefill chunk) run eagerly. With the paged Triton decode kernel
(`paged=True`), which reads each sequence only up to its own length, capacities are powers of two: a
handful of graphs per batch size instead of sixteen per octave of context.

The graph reads its inputs from one static int64 buffer on the device, filled by one non-blocking copy
from pinned memory per step: no host synchronisation besides the caller reading the sampled tokens.
On a CPU the same static-buffer path runs without capture, so its padding logic is testable there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mixserve.core.batch import ForwardBatch
from mixserve.model.attention.base import AttentionMetadata
from mixserve.model.attention.dense_decode import (
    DecodePlan,
    context_capacity,
    dense_decode_capacity,
    is_decode_only,
)
from mixserve.model.attention.flex import FlexAttentionBackend

DEFAULT_MAX_CTX = 4096  # longer decodes run eagerly: the dense decode path reads ctx slots per row


def graph_ladder(max_num_seqs: int) -> list[int]:
    """Padded batch sizes: powers of two below max_num_seqs, then max_num_seqs itself."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
    sizes, n = [], 1
    while n < max_num_seqs:
        sizes.append(n)
        n *= 2
    return [*sizes, max_num_seqs]


def graph_size(num_seqs: int, ladder: list[int]) -> int | None:
    """The smallest rung that holds num_seqs rows, or None when the batch is too large for any graph."""
    return next((size for size in ladder if size >= num_seqs), None)


def paged_capacity(max_seq_len: int, block_size: int) -> int:
    """Context capacity for graphs whose decode attention is the paged Triton kernel: a power of two.

    That kernel reads each sequence only up to its own length (on the device), so a larger capacity
    costs only block-table columns and early-exiting programs, not K/V reads; powers of two mean a
    handful of capacities, so few graphs are captured (and few captures stall a serving engine).
    """
    n = max(max_seq_len, block_size, 1)
    return -(-(1 << (n - 1).bit_length()) // block_size) * block_size


@dataclass(frozen=True)
class DecodeLayout:
    """Where each input sits in the flat static buffer, for one (size, width) graph."""

    size: int  # padded batch rows
    width: int  # block-table columns = ctx // block_size

    @property
    def numel(self) -> int:
        return self.size * (4 + self.width)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Named views into `flat`: token_ids, positions, slot_mapping, seq_lens (size,), block_tables."""
        s = self.size
        return {
            "token_ids": flat[0:s],
            "positions": flat[s:2 * s],
            "slot_mapping": flat[2 * s:3 * s],
            "seq_lens": flat[3 * s:4 * s],
            "block_tables": flat[4 * s:self.numel].view(s, self.width),
        }


def decode_host_inputs(batch: ForwardBatch, layout: DecodeLayout, block_size: int,
                       scratch_block: int) -> list[int]:
    """A decode-only batch as the flat int list of `layout`; padding rows use the scratch block.

    A padding row is token 0 at position 0, written to the scratch block's first slot and attending to
    it alone (seq_len 1), so it can neither disturb a real request nor produce an all-masked row.
    """
    rows = len(batch.seqs)
    pad = layout.size - rows
    if pad < 0:
        raise ValueError(f"{rows} sequences do not fit a graph of {layout.size} rows")
    tokens, positions, slots, seq_lens, tables = [], [], [], [], []
    for s in batch.seqs:
        p = s.start
        tokens.append(int(s.tokens[0]))
        positions.append(p)
        slots.append(s.block_table[p // block_size] * block_size + p % block_size)
        seq_lens.append(p + 1)
        row = list(s.block_table[: layout.width])
        tables.extend(row + [0] * (layout.width - len(row)))
    scratch_slot = scratch_block * block_size
    return (tokens + [0] * pad + positions + [0] * pad + slots + [scratch_slot] * pad
            + seq_lens + [1] * pad + tables + [scratch_block] * (pad * layout.width))


ModelFn = Callable[[torch.Tensor, AttentionMetadata], torch.Tensor]


class DecodeGraphs:
    """Decode steps replayed from graphs captured per (padded size, context capacity).

    `model_fn(input_ids, meta)` runs the model over the KV cache and returns float32 logits; it must
    use the dense decode attention (FlexAttentionBackend with a DecodePlan), whatever the eager backend.
    """

    def __init__(self, model_fn: ModelFn, *, block_size: int, max_num_seqs: int, scratch_block: int,
                 device: torch.device, max_ctx: int = DEFAULT_MAX_CTX,
                 paged: bool = False) -> None:
        self.model_fn = model_fn
        # paged: the model_fn's decode attention is the paged Triton kernel (it reads only up to each
        # length), so contexts are bucketed by powers of two and any decode-only batch may use a graph.
        self.paged = paged
        self.block_size = block_size
        self.ladder = graph_ladder(max_num_seqs)
        self.scratch_block = scratch_block
        self.device = torch.device(device)
        self.max_ctx = (paged_capacity if paged else context_capacity)(max_ctx, block_size)
        width = self.max_ctx // block_size
        self.flat = torch.zeros(self.ladder[-1] * (4 + width), dtype=torch.int64, device=self.device)
        self.graphs: dict[tuple[int, int], tuple[Callable[[], None], torch.Tensor]] = {}
        # The metadata each graph was captured with: its tensors (row indices, query starts) are read by
        # the replays, so they must outlive the capture (a freed one's memory would be reused: garbage).
        self._metas: dict[tuple[int, int], AttentionMetadata] = {}
        self._pool = None

    @property
    def captures(self) -> bool:
        """True when steps replay real CUDA graphs (else the static-buffer path runs eagerly)."""
        return self.device.type == "cuda"

    def key(self, batch: ForwardBatch) -> tuple[int, int] | None:
        """(padded size, context capacity) for a batch a graph can run, else None (run it eagerly)."""
        if self.paged:
            ctx = (paged_capacity(max(s.start + 1 for s in batch.seqs), self.block_size)
                   if is_decode_only(batch) else None)
        else:
            ctx = dense_decode_capacity(batch, self.block_size)
        size = graph_size(len(batch.seqs), self.ladder)
        if ctx is None or size is None or ctx > self.max_ctx:
            return None
        return size, ctx

    def _meta(self, layout: DecodeLayout, views: dict[str, torch.Tensor]) -> AttentionMetadata:
        rows = torch.arange(layout.size, dtype=torch.int64, device=self.device)
        return AttentionMetadata(
            positions=views["positions"],
            slot_mapping=views["slot_mapping"],
            query_start=torch.arange(layout.size + 1, dtype=torch.int64, device=self.device),
            seq_lens=views["seq_lens"],
            block_tables=views["block_tables"],
            last_token_index=rows,
            query_lens_cpu=[1] * layout.size,
            seq_lens_cpu=[1] * layout.size,  # unused by the dense decode path; real lengths live on device
            extra={"decode": DecodePlan(ctx=layout.width * self.block_size, block_size=self.block_size)},
        )

    def _write(self, host: list[int]) -> None:
        src = torch.tensor(host, dtype=torch.int64)
        if self.captures:
            # Pinned + non-blocking: the copy queues behind the previous step, the host does not wait.
            # The caching host allocator keeps the pinned block alive until the copy has run.
            src = src.pin_memory()
        self.flat[: len(host)].copy_(src, non_blocking=self.captures)

    def capture(self, size: int, ctx: int) -> None:
        """Capture (or, on a CPU, prepare) the graph for `size` rows and context capacity `ctx`."""
        if (size, ctx) in self.graphs:
            return
        with torch.inference_mode():
            self._capture(size, ctx)

    def _capture(self, size: int, ctx: int) -> None:
        layout = DecodeLayout(size, ctx // self.block_size)
        views = layout.views(self.flat)
        meta = self._meta(layout, views)
        self._metas[(size, ctx)] = meta
        # Every row a padding row while capturing: warm-up writes only touch the scratch block.
        self._write(decode_host_inputs(ForwardBatch([]), layout, self.block_size, self.scratch_block))
        if not self.captures:
            out = torch.empty(0)

            def run() -> None:
                self.graphs[(size, ctx)] = (run, self.model_fn(views["token_ids"], meta))

            self.graphs[(size, ctx)] = (run, out)
            return
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # lazy initialisation (cuBLAS workspaces, caches) stays out of the graph
                self.model_fn(views["token_ids"], meta)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self.model_fn(views["token_ids"], meta)
        self._pool = graph.pool()  # every graph shares one memory pool: they never run at once
        self.graphs[(size, ctx)] = (graph.replay, out)

    def capture_all(self, ctxs: list[int]) -> None:
        """Capture every rung for each context capacity, largest first (smaller ones reuse its memory)."""
        capacity = paged_capacity if self.paged else context_capacity
        for ctx in sorted({capacity(c, self.block_size) for c in ctxs}, reverse=True):
            for size in reversed(self.ladder):
                self.capture(size, ctx)

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """(len(batch.seqs), vocab) logits of a decode-only batch; valid until the next run."""
        key = self.key(batch)
        if key is None:
            raise ValueError("this batch cannot run from a decode graph")
        size, ctx = key
        if key not in self.graphs:
            self.capture(size, ctx)
        layout = DecodeLayout(size, ctx // self.block_size)
        self._write(decode_host_inputs(batch, layout, self.block_size, self.scratch_block))
        replay, _ = self.graphs[key]
        with torch.inference_mode():
            replay()
        return self.graphs[key][1][: len(batch.seqs)]


def decode_model_fn(model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> ModelFn:
    """The model over its KV cache with the dense decode attention, as DecodeGraphs wants it."""
    attention = FlexAttentionBackend()

    def run(input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return model(input_ids, meta, kv_caches, attention)

    return run
