"""Prefill policies: how many prompt tokens a prefilling request gets in this step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class PrefillPolicy(Protocol):
    """Decides the next chunk's length from the tokens still to prefill and the budget left."""

    def chunk_len(self, remaining: int, budget: int, alone: bool) -> int:
        """Tokens to prefill now (0 = wait); `alone` means nothing else is scheduled in this step yet."""
        ...


@dataclass(frozen=True)
class WholePrompt:
    """All remaining tokens if they fit in the budget left, else none; alone in a step it may exceed it."""

    def chunk_len(self, remaining: int, budget: int, alone: bool) -> int:
        # Running alone is the only way a prompt longer than the budget can ever start.
        return remaining if remaining <= budget or alone else 0


@dataclass(frozen=True)
class Chunked:
    """At most `chunk` tokens per step, never more than the budget left."""

    chunk: int

    def __post_init__(self) -> None:
        if not isinstance(self.chunk, int) or isinstance(self.chunk, bool) or self.chunk < 1:
            raise ValueError(f"Chunked.chunk must be an integer >= 1, got {self.chunk!r}")

    def chunk_len(self, remaining: int, budget: int, alone: bool) -> int:
        return min(remaining, self.chunk, budget)
