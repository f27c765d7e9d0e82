"""Rank 0's side: spawn ranks 1..N-1, and a runner that broadcasts each ForwardBatch before its forward.

The engine sees a TensorParallelRunner where it would see a ModelRunner: same attributes, `config` the
whole model's. A rank that dies or stops answering fails the step (RuntimeError naming the rank) within
seconds — a dead process is noticed before the step's broadcast, a hung one by the collective timeout —
and every later step fails at once, so the server's restart budget runs out and it exits (supervision.py).
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from dataclasses import replace
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.multiprocessing as mp

from mixserve.config import EngineConfig
from mixserve.core.batch import ForwardBatch
from mixserve.distributed.group import free_port
from mixserve.distributed.worker import Rank, RankSpec, build_rank, worker_main

START_POLL_S = 0.2


class RankFailedError(RuntimeError):
    """A tensor-parallel rank died or stopped answering. `permanent`: no in-process restart can bring it
    back, so the server's step loop treats it as death (engine/supervision.py), not as a failed step."""

    permanent = True


def rank_cores(cores: list[int], world: int, threads: int) -> tuple[tuple[int, ...], ...]:
    """Per rank, `threads` of `cores` (0: cores / world, at least 1) taken in order, wrapping if too few."""
    per_rank = threads or max(1, len(cores) // world)
    return tuple(tuple(cores[(r * per_rank + i) % len(cores)] for i in range(per_rank)) for r in range(world))


class Ranks:
    """The spawned ranks 1..N-1 and their pipes (whose closing tells them to exit)."""

    def __init__(self, spec: RankSpec) -> None:
        ctx = mp.get_context("spawn")
        self.procs: list[BaseProcess] = []
        self.conns: list[Connection] = []
        for rank in range(1, spec.world):
            parent_end, child_end = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(rank, spec, child_end), daemon=True,
                               name=f"mixserve-tp-rank{rank}")
            proc.start()
            child_end.close()
            self.procs.append(proc)
            self.conns.append(parent_end)

    def wait_loaded(self) -> None:
        """Until every rank has loaded its shard, then tell them all to go; a rank that fails: its error."""
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns, strict=True), start=1):
            while not conn.poll(START_POLL_S):
                if not proc.is_alive():
                    raise RuntimeError(f"tensor-parallel rank {rank} exited with code {proc.exitcode} "
                                       "while loading")
            msg = conn.recv()
            if msg != "loaded":
                raise ValueError(f"tensor-parallel rank {rank}: {msg[1]}")
        for conn in self.conns:
            conn.send("go")

    def dead(self) -> str | None:
        """A line naming the first rank that is no longer running, or None."""
        for rank, proc in enumerate(self.procs, start=1):
            if not proc.is_alive():
                return f"tensor-parallel rank {rank} died (exit code {proc.exitcode})"
        return None


def _shutdown(procs: list[BaseProcess], conns: list[Connection]) -> None:
    """Close the pipes (the ranks exit on EOF) and make sure they are gone."""
    for conn in conns:
        conn.close()
    for proc in procs:
        proc.join(2.0)
        if proc.is_alive():
            proc.kill()
            proc.join(2.0)


class TensorParallelRunner:
    """Rank 0's runner: broadcasts each batch to ranks 1..N-1, then runs its own shard with them."""

    def __init__(self, rank: Rank, ranks: Ranks, cores: tuple[int, ...]) -> None:
        self._rank, self._ranks, self._cores = rank, ranks, cores
        self.runner = rank.runner
        self.config = rank.config  # the whole model's (the local runner's config is its shard)
        self.world = rank.group.world
        self._failed: str | None = None
        self._pinned: int | None = None
        # Runs when the LLM (and so this runner) is collected, on close(), or at interpreter exit.
        self._finalizer = weakref.finalize(self, _shutdown, ranks.procs, ranks.conns)

    @property
    def processes(self) -> list[BaseProcess]:
        """Ranks 1..N-1 (for tests and supervisors)."""
        return list(self._ranks.procs)

    def __getattr__(self, name: str) -> Any:  # tokenizer, num_blocks, block_size, device, dtype, ...
        return getattr(self.__dict__["runner"], name)

    def forward(self, batch: ForwardBatch):
        """The model's logits for `batch`, computed by every rank; RankFailedError if a rank failed."""
        if self._failed is None:
            self._failed = self._ranks.dead()
        if self._failed is not None:
            raise RankFailedError(self._failed)
        self._pin_step_thread()
        try:
            self._rank.group.broadcast(batch)
            return self.runner.forward(batch)
        except RuntimeError as exc:  # gloo/NCCL: a peer closed its connection or the timeout passed
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            self._failed = self._ranks.dead() or f"tensor-parallel collective failed: {first}"
            raise RankFailedError(self._failed) from exc

    def _pin_step_thread(self) -> None:
        """With one thread per rank, pin the stepping thread to rank 0's core (bind_threads pins >= 2)."""
        me = threading.get_native_id()
        if len(self._cores) == 1 and self._pinned != me and hasattr(os, "sched_setaffinity"):
            self._pinned = me
            with contextlib.suppress(OSError):
                os.sched_setaffinity(me, set(self._cores))

    def close(self) -> None:
        """Stop the other ranks and leave the process group (also done when collected)."""
        self._finalizer()


def start_tensor_parallel(cfg: EngineConfig, device: str, cores: list[int]) -> tuple[TensorParallelRunner,
                                                                                     EngineConfig]:
    """Spawn ranks 1..N-1 and load rank 0 here, over `cores` (the process's, as engine/threads.py saw them
    first); returns rank 0's runner and `cfg` with its thread count (the engine binds them, >= 2)."""
    world = cfg.tensor_parallel_size
    cores = rank_cores(cores, world, cfg.threads)
    spec = RankSpec(model=cfg.model, world=world, device=device, dtype=cfg.dtype, block_size=cfg.block_size,
                    num_blocks=cfg.num_blocks, attention_backend=cfg.attention_backend,
                    cpu_kv_cache_gib=cfg.cpu_kv_cache_gib, gpu_memory_utilization=cfg.gpu_memory_utilization,
                    max_num_seqs=cfg.max_num_seqs, cores=cores, port=free_port())
    ranks = Ranks(spec)
    try:
        if device == "cpu":
            torch.set_num_threads(len(cores[0]))
        rank = build_rank(spec, 0, ranks.wait_loaded)
    except BaseException:
        _shutdown(ranks.procs, ranks.conns)
        raise
    return TensorParallelRunner(rank, ranks, cores[0]), replace(cfg, threads=len(cores[0]))
