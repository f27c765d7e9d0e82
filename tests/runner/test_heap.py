"""runner/heap.py: with glibc, a freed step-sized block stays in the heap for the next step (a fresh process
each, since the thresholds are the process's; the program break shows where a block came from)."""

from __future__ import annotations

import ctypes.util
import subprocess
import sys

import pytest

PROBE = """
import ctypes, ctypes.util, sys
from mixserve.runner.heap import keep_freed_memory
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.sbrk.restype, libc.malloc.restype = ctypes.c_void_p, ctypes.c_void_p
libc.sbrk.argtypes, libc.malloc.argtypes = [ctypes.c_long], [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
start = libc.sbrk(0)
block = libc.malloc(20 << 20)
grown = libc.sbrk(0) - start
libc.free(block)
print(kept, grown >> 20, (libc.sbrk(0) - start) >> 20)
"""


def probe(mode: str) -> list[str]:
    """(keep_freed_memory's answer, MiB the break grew for a 20 MiB block, MiB still there once freed)."""
    done = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    return done.stdout.split()


@pytest.fixture(scope="module", autouse=True)
def glibc() -> None:
    name = ctypes.util.find_library("c") or ""
    if not sys.platform.startswith("linux") or "libc.so" not in name:
        pytest.skip("glibc's mallopt only")


def test_a_step_sized_block_comes_from_the_heap_and_stays() -> None:
    kept, grown, after_free = probe("keep")
    assert kept == "True"
    # from the heap (the break moved: by less where its free top held part of it), and not given back
    assert int(grown) >= 16 and int(after_free) >= 16


def test_without_it_glibc_maps_the_block_afresh() -> None:
    _, grown, _ = probe("default")  # what the setting changes: glibc's own first answer for 20 MiB
    assert int(grown) < 4
