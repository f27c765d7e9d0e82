"""A rank that dies or hangs fails the step within seconds, and every later step; ranks never outlive
the process that started them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mixserve import LLM, SamplingParams
from mixserve.distributed.group import COLLECTIVE_TIMEOUT

OPTIONS = dict(num_blocks=64, block_size=4, prefill_chunk=8, dtype="float32")
PARAMS = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
PROMPT = [[5, 6, 7, 8, 9, 10]]


def failing_generate(llm: LLM) -> tuple[float, str]:
    """Seconds until generate raised, and its message."""
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        llm.generate(PROMPT, PARAMS, use_tqdm=False)
    return time.monotonic() - start, str(info.value)


def test_a_killed_rank_fails_the_next_step_at_once_and_every_one_after(uneven_model: Path):
    llm = LLM(str(uneven_model), tensor_parallel_size=2, **OPTIONS)
    try:
        assert llm.generate(PROMPT, PARAMS, use_tqdm=False)[0].token_ids  # serving
        rank1 = llm.engine.runner.processes[0]
        os.kill(rank1.pid, signal.SIGKILL)
        rank1.join(10)
        took, message = failing_generate(llm)
        assert took < 3.0 and "rank 1 died" in message
        took, message = failing_generate(llm)
        assert took < 1.0 and "rank 1 died" in message
    finally:
        llm.engine.runner.close()


def test_a_hung_rank_fails_the_step_by_the_collective_timeout(uneven_model: Path):
    llm = LLM(str(uneven_model), tensor_parallel_size=2, **OPTIONS)
    rank1 = llm.engine.runner.processes[0]
    try:
        os.kill(rank1.pid, signal.SIGSTOP)  # alive but not answering, as a rank stuck in a kernel
        took, message = failing_generate(llm)
        assert took < COLLECTIVE_TIMEOUT.total_seconds() + 5 and "tensor-parallel" in message
    finally:
        os.kill(rank1.pid, signal.SIGCONT)
        llm.engine.runner.close()
    rank1.join(10)
    assert not rank1.is_alive()


PARENT = """
import sys
from mixserve import LLM
llm = LLM(sys.argv[1], tensor_parallel_size=2, num_blocks=16, block_size=4)
print(llm.engine.runner.processes[0].pid, flush=True)
sys.stdin.read()
"""


def test_the_ranks_exit_when_their_parent_is_killed(uneven_model: Path):
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(uneven_model)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2])
    try:
        pid = int(parent.stdout.readline())  # type: ignore[union-attr]
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 5
        while _running(pid) and time.monotonic() < deadline:
            time.sleep(0.05)  # polling a process we cannot wait on (it is the parent's child)
        assert not _running(pid)
    finally:
        parent.kill()


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] not in "ZX"  # a zombie has exited
    except (FileNotFoundError, IndexError):
        return False
