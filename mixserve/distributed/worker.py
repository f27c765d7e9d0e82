"""One tensor-parallel rank: load its shard, join the groups, and (ranks 1..N-1) run the step loop.

Every rank reads the checkpoint on the CPU and keeps only its slice (shard.py), built on its own device
(cuda:rank on CUDA). Ranks 1..N-1 are spawned processes (torch.multiprocessing, "spawn": a forked torch
with OpenMP threads is not safe); each pins itself to its own cores first, because a child inherits the
affinity of the thread that started it (the parent's loading thread is bound to one core).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from mixserve.distributed.group import ShardCollectives, TensorParallelGroup
from mixserve.distributed.shard import ShardPlan, plan_shards, shard_state_dict
from mixserve.model.attention import get_backend
from mixserve.model.config import ModelConfig
from mixserve.model.decoder import DecoderModel
from mixserve.model.loader import load_weights, model_name, resolve_model_path
from mixserve.model.tokenizer import Tokenizer, load_tokenizer
from mixserve.runner.kv_cache import num_blocks_for_memory
from mixserve.runner.model_runner import ModelRunner, resolve_dtype


@dataclass(frozen=True)
class RankSpec:
    """What every rank needs to build its runner (picklable: it crosses the spawn)."""

    model: str  # "" = the default model
    world: int
    device: str  # "cpu" or "cuda" (resolved by the parent); rank r takes cuda:r
    dtype: str
    block_size: int
    num_blocks: int  # 0 = the smallest number any rank's memory holds
    attention_backend: str
    cpu_kv_cache_gib: float
    gpu_memory_utilization: float
    max_num_seqs: int
    cores: tuple[tuple[int, ...], ...]  # per rank, the cores its threads are bound to
    port: int


@dataclass
class Rank:
    """One rank's loaded state: its runner, the whole model's config, its groups."""

    runner: ModelRunner
    config: ModelConfig
    group: TensorParallelGroup


def rank_device(device: str, rank: int, world: int) -> torch.device:
    if torch.device(device).type != "cuda":
        return torch.device("cpu")
    if torch.cuda.device_count() < world:
        raise ValueError(f"tensor_parallel_size: {world} ranks need {world} GPUs, found "
                         f"{torch.cuda.device_count()}")
    torch.cuda.set_device(rank)
    return torch.device("cuda", rank)


def build_rank(spec: RankSpec, rank: int, loaded: Callable[[], None]) -> Rank:
    """Load this rank's shard, call `loaded()` (the start-up handshake), then join the groups and build
    the runner. The joining waits for every rank, so it comes after the slow part."""
    device = rank_device(spec.device, rank, spec.world)
    dtype = resolve_dtype(spec.dtype, device)
    path = resolve_model_path(spec.model or None)
    cfg, sd, inv_freq = load_weights(path)
    plan = plan_shards(cfg, spec.world)[rank]
    local_cfg = plan.local_config(cfg)
    model = DecoderModel(local_cfg, dtype=dtype, device=device)
    model.load_hf_weights(shard_state_dict(sd, cfg, plan), str(path), inv_freq=inv_freq)
    del sd
    eos = cfg.eos_token_ids
    if path.is_dir():
        from mixserve.model.hf_loader import generation_eos_ids

        eos = eos + generation_eos_ids(path)
    tokenizer = load_tokenizer(path, eos) if rank == 0 else None  # only rank 0 reads text
    loaded()
    group = TensorParallelGroup(rank, spec.world, spec.port, device)
    return Rank(_runner(spec, model, tokenizer, path, plan, group), cfg, group)


def _runner(spec: RankSpec, model: DecoderModel, tokenizer: Tokenizer | None, path: Path, plan: ShardPlan,
            group: TensorParallelGroup) -> ModelRunner:
    device, dtype, local_cfg = model.device, model.dtype, model.config
    hooks = ShardCollectives(plan, group)
    model.tp = hooks
    for layer in model.layers:
        layer.tp = hooks
    num_blocks = spec.num_blocks or num_blocks_for_memory(local_cfg, spec.block_size, dtype, device,
                                                          spec.cpu_kv_cache_gib, spec.gpu_memory_utilization)
    num_blocks = group.min_int(num_blocks)  # the scheduler's block ids must exist on every rank
    attention = get_backend(spec.attention_backend, device, dtype)
    # No CUDA graphs: NCCL inside a captured graph needs its own warm-up rules; eager until measured.
    runner = ModelRunner(model.eval(), tokenizer, num_blocks=num_blocks,  # type: ignore[arg-type]
                         block_size=spec.block_size, attention=attention, model_name=model_name(path),
                         path=path, cuda_graphs=False, max_num_seqs=spec.max_num_seqs)
    return runner


def pin_process(cores: tuple[int, ...]) -> int:
    """Bind this process to `cores` and size torch's pool to them; returns the thread count."""
    with contextlib.suppress(AttributeError, OSError):  # not Linux, or a sandbox forbids it
        os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))
    return len(cores)


def worker_main(rank: int, spec: RankSpec, conn: Connection) -> None:
    """Ranks 1..N-1: build, then run every ForwardBatch rank 0 broadcasts until it sends None."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: rank 0 decides
    # The process, not each OpenMP thread, is pinned: engine/threads.py binds one per core, but the engine
    # layer sits above this one; with 1 thread per rank (2 ranks on 2 cores) the two are the same.
    pin_process(spec.cores[rank])

    def handshake() -> None:
        conn.send("loaded")
        conn.recv()  # "go": every rank has loaded, so the rendezvous below is quick

    try:
        me = build_rank(spec, rank, handshake)
    except (EOFError, OSError):
        sys.exit(1)  # rank 0 went away during start-up
    except Exception as exc:  # a bad checkpoint or setting: rank 0 reports it, one line
        with contextlib.suppress(OSError):
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
        sys.exit(1)
    threading.Thread(target=_exit_with_parent, args=(conn,), daemon=True, name="tp-parent-watch").start()
    try:
        while (batch := me.group.broadcast(None)) is not None:
            try:
                me.runner.forward(batch)
            except ValueError:
                pass  # the runner's own check (a block id out of range): rank 0 raised it too, first
    except RuntimeError as exc:  # a peer failed or timed out: rank 0 sees its own error; leave quietly
        print(f"mixserve tensor-parallel rank {rank}: {exc}".splitlines()[0], file=sys.stderr)
        os._exit(1)


def _exit_with_parent(conn: Connection) -> None:
    """The parent's end of the pipe closes when it exits or is killed: leave at once, whatever runs."""
    with contextlib.suppress(EOFError, OSError):
        conn.recv()
    os._exit(0)
