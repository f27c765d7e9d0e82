"""Whether drafts pay at this many decodes, measured on this machine rather than predicted.

A draft row costs what a token of the forward costs: next to nothing while a step is bound by reading the
weights (one stream), as much as a decode once the step is bound by multiply-adds (many streams on a
CPU), and the kernels change regime with the row count, which a linear cost model does not see. So the
gate keeps, per bucket of decodes (powers of two) and for steps with and without prefill chunks apart,
the useful tokens per second (prompt tokens prefilled, tokens output; a rejected draft is wasted work) of
steps that carried drafts and of those that did not, and lets drafts through where they win. The losing
mode is still run one step in PROBE_EVERY, so a change (acceptance, context, load) is seen; each probe
that finds it still losing doubles that bucket's wait, up to MAX_PROBE_EVERY: a draft model has to catch
up on every token since its last draft, so a probe costs more the rarer it is, and only fewer probes let a
request finish without any (docs/decisions/speculative-decoding.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

PROBE_EVERY = 16
MAX_PROBE_EVERY = 256
SMOOTHING = 0.25  # weight of the newest step in each running rate


@dataclass
class _Rates:
    """A bucket's running tokens per second without drafts [0] and with them [1]; None: not seen yet."""

    rate: list[float | None] = field(default_factory=lambda: [None, None])
    probe_every: int = PROBE_EVERY  # steps between probes of the losing mode
    since_probe: int = 0


def _winner(rate: list[float | None]) -> bool | None:
    """True: drafts are the faster mode; None: a mode not measured yet."""
    without, with_drafts = rate
    return None if without is None or with_drafts is None else with_drafts >= without


class DraftGate:
    """Drafts on or off per decode count, from the measured tokens per second of either mode."""

    def __init__(self) -> None:
        self._buckets: dict[tuple[int, bool], _Rates] = {}

    def allows(self, num_decodes: int, chunks: bool = False) -> bool:
        """May this step's decodes carry drafts (`chunks`: beside prefill chunks)? Tries drafts first,
        then one step without for a baseline, then the faster mode, the other one step in `probe_every`."""
        b = self._buckets.setdefault((num_decodes.bit_length(), chunks), _Rates())
        if b.rate[1] is None:
            return True
        if b.rate[0] is None:
            return False
        b.since_probe += 1
        probe = b.since_probe >= b.probe_every
        if probe:
            b.since_probe = 0
        return bool(_winner(b.rate)) != probe

    def observe(self, num_decodes: int, drafted: bool, tokens: int, seconds: float, chunks: bool = False
                ) -> None:
        """A step ran: `tokens` useful (prefilled and output) in `seconds`; `drafted`: some decode carried
        drafts; `chunks`: it prefilled chunks too."""
        if num_decodes < 1 or seconds <= 0:
            return
        b = self._buckets.setdefault((num_decodes.bit_length(), chunks), _Rates())
        before = _winner(b.rate)
        rate, old = tokens / seconds, b.rate[drafted]
        b.rate[drafted] = rate if old is None else old + SMOOTHING * (rate - old)
        after = _winner(b.rate)
        if before is not None and after != before:  # the other mode wins now: probe the loser often again
            b.probe_every, b.since_probe = PROBE_EVERY, 0
        elif before is not None and drafted != before:  # a probe of the loser, which still loses
            b.probe_every = min(2 * b.probe_every, MAX_PROBE_EVERY)

    def rates(self) -> dict[tuple[int, bool], tuple[float | None, float | None]]:
        """Per (bucket: decodes < 2**bucket, with chunks): tokens per second (without, with drafts)."""
        return {k: (b.rate[0], b.rate[1]) for k, b in sorted(self._buckets.items())}
