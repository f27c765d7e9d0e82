"""The KV block pool: which fixed-size blocks of the cache are free and which are held."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol


class BlockSpace(Protocol):
    """Where the scheduler gets KV blocks from."""

    def num_free(self) -> int: ...

    def allocate(self, n: int) -> list[int]: ...

    def free(self, blocks: Iterable[int]) -> None: ...


class BlockPool:
    """The default BlockSpace: `num_blocks` block ids, handed out lowest first."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        # A stack popped from the end: freshly built, block 0 comes out first (easy to read in tests).
        self._free = list(range(num_blocks - 1, -1, -1))
        self._held: set[int] = set()

    def num_free(self) -> int:
        return len(self._free)

    def num_held(self) -> int:
        return len(self._held)

    def allocate(self, n: int) -> list[int]:
        """Take `n` free blocks; asking for more than are free is a scheduler bug."""
        if n < 0 or n > len(self._free):
            raise RuntimeError(f"cannot allocate {n} blocks: {len(self._free)} free")
        blocks = [self._free.pop() for _ in range(n)]
        self._held.update(blocks)
        return blocks

    def free(self, blocks: Iterable[int]) -> None:
        """Give blocks back; freeing a block that is not held (a double free) raises ValueError."""
        for b in blocks:
            if b not in self._held:
                raise ValueError(f"block {b} is not held (double free?)")
            self._held.remove(b)
            self._free.append(b)

    def check(self) -> None:
        """Raise RuntimeError unless free + held == total and no block is both free and held, or twice."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise RuntimeError("a block is on the free list twice")
        if free & self._held:
            raise RuntimeError(f"blocks both free and held: {sorted(free & self._held)}")
        if free | self._held != set(range(self.num_blocks)):
            raise RuntimeError(f"free {len(free)} + held {len(self._held)} != total {self.num_blocks}")
