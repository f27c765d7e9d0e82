"""CUDA graphs for decode-only steps: capture once per (padded batch size, context capacity), then replay.

A decode step of a small model is launch-bound (hundreds of small kernels), so replaying one captured graph
saves most of its time. Batch sizes are padded up a ladder (1, 2, 4, ... max_num_seqs) and contexts up to
the capacity the attention backend's decode path asks for (its `decode_capacity` hook: the paged Triton
kernel takes powers of two, the dense path sixteenths of an octave), so a few graphs serve every step;
padding rows point at a scratch KV block that no request owns. Mixed steps (any prefill chunk) run eagerly.

The graph reads its inputs from one static int64 buffer on the device, filled by one non-blocking copy
from pinned memory per step, laid out from the same host flattener as eager metadata (attention/base.py);
the attention metadata over that buffer is the backend's (`graph_metadata` hook), built once at capture.
Each layer's attention arguments (scale, sliding window, softcap) are constants of the model that its layers
pass on every call, so a capture records each layer with its own values and a replay changes none of them.
No host synchronisation besides the caller reading the sampled tokens. On a CPU the same static-buffer
path runs without capture, so its padding logic is testable there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mixserve.core.batch import ForwardBatch
from mixserve.model.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    GraphInputs,
    HostBatch,
    flatten,
    is_decode_only,
)

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
    """A decode-only batch as the flat int list of `layout`; padding rows use the scratch block
    (HostBatch.pad_rows). An empty batch is all padding: what a capture runs."""
    host = flatten(batch, block_size, layout.width) if batch.seqs else HostBatch([], [], [], [], [], [],
                                                                                 layout.width)
    host = host.pad_rows(layout.size, scratch_block, block_size)
    return host.token_ids + host.positions + host.slot_mapping + host.seq_lens + host.block_tables


ModelFn = Callable[[torch.Tensor, AttentionMetadata], torch.Tensor]


class DecodeGraphs:
    """Decode steps replayed from graphs captured per (padded size, context capacity).

    `model_fn(input_ids, meta)` runs the model over the KV cache with `attention`, the runner's own
    backend, and returns float32 logits; the backend says which batches a graph takes (decode_capacity)
    and builds the metadata a graph is captured with (graph_metadata).
    """

    def __init__(self, model_fn: ModelFn, attention: AttentionBackend, *, block_size: int, max_num_seqs: int,
                 scratch_block: int, device: torch.device, max_ctx: int = DEFAULT_MAX_CTX) -> None:
        if not attention.supports_graphs:
            raise ValueError(f"the {attention.name} attention backend does not run in CUDA graphs")
        self.model_fn = model_fn
        self.attention = attention
        self.block_size = block_size
        self.ladder = graph_ladder(max_num_seqs)
        self.scratch_block = scratch_block
        self.device = torch.device(device)
        capacity = attention.decode_capacity([max_ctx], block_size)
        if capacity is None:
            raise ValueError(f"the {attention.name} attention backend gives no decode capacity for {max_ctx}")
        self.max_ctx = capacity
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
        if not is_decode_only(batch):
            return None
        ctx = self.attention.decode_capacity([s.start + 1 for s in batch.seqs], self.block_size)
        size = graph_size(len(batch.seqs), self.ladder)
        if ctx is None or size is None or ctx > self.max_ctx:
            return None
        return size, ctx

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
        names = ("positions", "slot_mapping", "seq_lens", "block_tables")
        inputs = GraphInputs(*(views[name] for name in names))
        meta = self.attention.graph_metadata(inputs, ctx, self.block_size)
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


def decode_model_fn(model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                    attention: AttentionBackend) -> ModelFn:
    """The model over its KV cache with `attention`, as DecodeGraphs wants it."""

    def run(input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return model(input_ids, meta, kv_caches, attention)

    return run
