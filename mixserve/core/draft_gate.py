"""Whether drafts pay at this many decodes, measured on this machine rather than predicted.

A draft row costs what a token of the forward costs: next to nothing while a step is bound by reading the
weights (one stream), as much as a decode once the step is bound by multiply-adds (many streams on a
CPU), and the kernels change regime with the row count, which a linear cost model does not see. So the
gate keeps, per bucket of decodes (powers of two) and for steps with and without prefill chunks apart,
the useful tokens per second (prompt tokens prefilled, tokens output; a rejected draft is wasted work) of
steps that carried drafts and of those that did not, and lets drafts through where they win. The losing
mode is still run one step in PROBE_EVERY, so a change (acceptance, context, load) is seen
(docs/decisions/speculative-decoding.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

PROBE_EVERY = 16
SMOOTHING = 0.25  # weight of the newest step in each running rate


@dataclass
class _Rates:
    """A bucket's running tokens per second without drafts [0] and with them [1]; None: not seen yet."""

    rate: list[float | None] = field(default_factory=lambda: [None, None])
    steps: int = 0


class DraftGate:
    """Drafts on or off per decode count, from the measured tokens per second of either mode."""

    def __init__(self) -> None:
        self._buckets: dict[tuple[int, bool], _Rates] = {}

    def allows(self, num_decodes: int, chunks: bool = False) -> bool:
        """May this step's decodes carry drafts (`chunks`: beside prefill chunks)? Tries drafts first,
        then one step without for a baseline, then the faster mode, the other one step in PROBE_EVERY."""
        b = self._buckets.setdefault((num_decodes.bit_length(), chunks), _Rates())
        b.steps += 1
        without, with_drafts = b.rate
        if with_drafts is None:
            return True
        if without is None:
            return False
        return (with_drafts >= without) != (b.steps % PROBE_EVERY == 0)

    def observe(self, num_decodes: int, drafted: bool, tokens: int, seconds: float, chunks: bool = False
                ) -> None:
        """A step ran: `tokens` useful (prefilled and output) in `seconds`; `drafted`: some decode carried
        drafts; `chunks`: it prefilled chunks too."""
        if num_decodes < 1 or seconds <= 0:
            return
        b = self._buckets.setdefault((num_decodes.bit_length(), chunks), _Rates())
        rate, old = tokens / seconds, b.rate[drafted]
        b.rate[drafted] = rate if old is None else old + SMOOTHING * (rate - old)

    def rates(self) -> dict[tuple[int, bool], tuple[float | None, float | None]]:
        """Per (bucket: decodes < 2**bucket, with chunks): tokens per second (without, with drafts)."""
        return {k: (b.rate[0], b.rate[1]) for k, b in sorted(self._buckets.items())}
