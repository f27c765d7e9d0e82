"""The C heap of a process that steps a model on the CPU: freed buffers stay in it, for the next step.

A step allocates the same large buffers every time (a 512-token chunk's expert rows: 16 MiB; the logits).
glibc serves blocks above its mmap threshold from fresh mappings and gives the heap's free top back to the
kernel past its trim threshold, so the next step faults those pages in again, and a page fault is slow in
many VMs (docs/decisions/keep-freed-memory.md). So: every block up to 32 MiB from the heap, and its top kept.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from functools import cache

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # malloc.h's mallopt parameters
MMAP_THRESHOLD = 32 << 20  # glibc's most (HEAP_MAX_SIZE / 2 on 64-bit); larger blocks are still mapped
TRIM_THRESHOLD = 1 << 30  # free memory the heap's top keeps before it gives any back


@cache
def keep_freed_memory() -> bool:
    """Set glibc's thresholds once per process; False where the C library is not glibc (nothing changes)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl, macOS: no mallopt, and their own allocators' rules
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
