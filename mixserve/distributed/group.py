"""The process groups of a tensor-parallel engine and the collectives its model calls (ShardHooks).

Two groups over one TCPStore on tcp://127.0.0.1 (rank 0 hosts it), the same calls for gloo and NCCL:
- the model group, on the model's device (gloo on the CPU, NCCL on CUDA), carries the all-reduces and the
  logits gather; its timeout is short (COLLECTIVE_TIMEOUT): a peer that stops answering mid-step fails
  the step in seconds instead of hanging it;
- a gloo group on the CPU carries the control messages (each step's ForwardBatch, the start-up minimum of
  KV blocks), as vLLM keeps metadata off NCCL; its timeout is long (CONTROL_TIMEOUT) because ranks
  1..N-1 wait on it for the next step while the server is idle.
The groups are built directly (ProcessGroupGloo/ProcessGroupNCCL), not through init_process_group: no
process-global default group, so one process may hold several engines (tests, a notebook) and an engine
that is collected leaves nothing behind.
"""

from __future__ import annotations

import pickle
import socket
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from mixserve.distributed.shard import ShardPlan

COLLECTIVE_TIMEOUT = timedelta(seconds=10)
# gloo adds the timeout to a steady-clock time in nanoseconds: a week stays far from int64's limit.
CONTROL_TIMEOUT = timedelta(days=7)
RENDEZVOUS_TIMEOUT = timedelta(seconds=60)  # every rank has loaded before it starts (worker.py)


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on now (the rendezvous address for one engine)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class TensorParallelGroup:
    """One rank's membership of an engine's two groups."""

    def __init__(self, rank: int, world: int, port: int, device: torch.device) -> None:
        self.rank, self.world, self.device = rank, world, device
        self.store = dist.TCPStore("127.0.0.1", port, world, rank == 0, RENDEZVOUS_TIMEOUT)
        model_store = dist.PrefixStore("model/", self.store)
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = COLLECTIVE_TIMEOUT
            self.model: Any = dist.ProcessGroupNCCL(model_store, rank, world, options)
        else:
            self.model = dist.ProcessGroupGloo(model_store, rank, world, COLLECTIVE_TIMEOUT)
        self.control = dist.ProcessGroupGloo(dist.PrefixStore("control/", self.store), rank, world,
                                             CONTROL_TIMEOUT)

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank: its pickle's length, then the bytes, over the control group.

        Rank 0 gives up after COLLECTIVE_TIMEOUT (gloo's sender waits for the receiver: a hung rank would
        hold it for CONTROL_TIMEOUT), the others wait for the next step as long as the group's timeout."""
        data = pickle.dumps(obj) if self.rank == 0 else b""
        size = torch.tensor([len(data)], dtype=torch.int64)
        timeout = COLLECTIVE_TIMEOUT if self.rank == 0 else None
        self.control.broadcast(size, 0, timeout).wait()
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == 0 else torch.empty(
            int(size.item()), dtype=torch.uint8)
        self.control.broadcast(buf, 0, timeout).wait()
        return obj if self.rank == 0 else pickle.loads(buf.numpy().tobytes())

    def min_int(self, value: int) -> int:
        """The smallest of every rank's `value` (e.g. how many KV blocks each rank's memory holds)."""
        t = torch.tensor([value], dtype=torch.int64)
        self.control.allreduce([t], dist.ReduceOp.MIN).wait()
        return int(t.item())


class ShardCollectives:
    """ShardHooks (mixserve/model/decoder.py) for one rank's plan: sums of partial outputs, the split
    embedding, the gathered logits."""

    def __init__(self, plan: ShardPlan, group: TensorParallelGroup) -> None:
        self.plan, self.group = plan, group.model
        self.vocab_start, self.vocab_end = plan.vocab
        self.widest = max(b - a for a, b in plan.vocab_spans)

    def all_reduce(self, x: Tensor) -> Tensor:
        self.group.allreduce([x]).wait()
        return x

    def embed(self, input_ids: Tensor, weight: Tensor) -> Tensor:
        """Rows this rank holds, zeros for the others; the all-reduce fills every row from its owner."""
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local = (input_ids - self.vocab_start).masked_fill(outside, 0)
        hidden = F.embedding(local, weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return self.all_reduce(hidden)

    def gather_logits(self, logits: Tensor) -> Tensor:
        """(S, local vocab) on each rank -> (S, vocab) on each: all_gather wants equal shapes, so the
        narrower shards are padded to the widest and the padding cut off again."""
        rows, width = logits.shape
        if width < self.widest:
            logits = F.pad(logits, (0, self.widest - width))
        parts = [torch.empty_like(logits) for _ in self.plan.vocab_spans]
        self.group.allgather([parts], [logits.contiguous()]).wait()
        spans = self.plan.vocab_spans
        return torch.cat([p[:, : b - a] for p, (a, b) in zip(parts, spans, strict=True)], dim=1)
