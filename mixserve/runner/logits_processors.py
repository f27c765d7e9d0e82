"""Logits processing vectorized over the batch: penalties, logit_bias, and tokens hidden before min_tokens.

Each processor works on the rows that ask for it, with one tensor op per kind for the whole batch; the
per-token history enters as one flat index tensor (no Python loop over the vocabulary or per row math).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ProcessorRow:
    """What one logits row asks for. `output_ids` (for presence/frequency) and `seen_ids` (prompt +
    output, for repetition) are only filled when the penalty is on; `hidden_ids` get -inf (min_tokens)."""

    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    hidden_ids: tuple[int, ...] = ()
    output_ids: Sequence[int] = ()
    seen_ids: Sequence[int] = ()

    @property
    def active(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0 or bool(self.logit_bias) or bool(self.hidden_ids))


def _counts(histories: list[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """(len(histories), vocab) float counts of each token id in each history."""
    counts = torch.zeros((len(histories), vocab), device=device)
    flat = [t for h in histories for t in h]
    if flat:
        rows = torch.repeat_interleave(torch.arange(len(histories), device=device),
                                       torch.tensor([len(h) for h in histories], device=device))
        counts.index_put_((rows, torch.tensor(flat, device=device)), torch.ones(len(flat), device=device),
                          accumulate=True)
    return counts


def _scatter(logits: torch.Tensor, pairs: list[tuple[int, int, float]], accumulate: bool) -> None:
    if pairs:
        rows, cols, values = zip(*pairs, strict=True)
        dev = logits.device
        logits.index_put_((torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)),
                          torch.tensor(values, device=dev, dtype=logits.dtype), accumulate=accumulate)


def apply_processors(logits: torch.Tensor, rows: list[ProcessorRow]) -> torch.Tensor:
    """A processed copy of float32 `logits` (one row per entry of `rows`); the input is left as it was.

    Order as in vLLM: repetition, then frequency and presence, then logit_bias, then hidden tokens.
    """
    out = logits.clone()
    vocab, dev = logits.shape[1], logits.device
    rep = [i for i, r in enumerate(rows) if r.repetition_penalty != 1.0]
    if rep:  # HF's definition: a seen token's positive logit divided by the penalty, a negative one times it
        seen = _counts([rows[i].seen_ids for i in rep], vocab, dev) > 0
        x = out[rep]
        p = torch.tensor([rows[i].repetition_penalty for i in rep], device=dev).unsqueeze(1)
        out[rep] = torch.where(seen, torch.where(x > 0, x / p, x * p), x)
    pen = [i for i, r in enumerate(rows) if r.presence_penalty != 0.0 or r.frequency_penalty != 0.0]
    if pen:  # OpenAI's definition, over the generated tokens
        counts = _counts([rows[i].output_ids for i in pen], vocab, dev)
        freq = torch.tensor([rows[i].frequency_penalty for i in pen], device=dev).unsqueeze(1)
        pres = torch.tensor([rows[i].presence_penalty for i in pen], device=dev).unsqueeze(1)
        out[pen] -= freq * counts + pres * (counts > 0).float()
    _scatter(out, [(i, t, b) for i, r in enumerate(rows) for t, b in r.logit_bias], accumulate=True)
    _scatter(out, [(i, t, float("-inf")) for i, r in enumerate(rows) for t in r.hidden_ids], accumulate=False)
    return out
