"""Verifying a speculating decode's drafts on its logits rows (row j follows drafts[:j]).

Greedy keeps each draft the model's own argmax agrees with, then takes the argmax where they part: the
output is the one without speculation, token for token. Sampling keeps draft j with the target's own
probability p_j(draft) and, at the first rejection, draws from p_j with the draft taken out and
renormalised: for a draft that is one token (an n-gram's), the speculative-sampling rule, so every token
kept or drawn follows the target distribution exactly (docs/decisions/speculative-decoding.md). With all
drafts kept, the last row draws one more token as usual.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mixserve.core.speculative import Speculation
from mixserve.engine.draft_model import DraftModel
from mixserve.engine.outputs import TokenLogprobs
from mixserve.engine.structured import StepMasks
from mixserve.runner.logits_processors import ProcessorRow, apply_processors
from mixserve.runner.sampler import GREEDY_BELOW, Sampler, SamplingRow, argmax_rows


def speculation_for(method: str, num_tokens: int) -> Speculation | None:
    """`[engine] speculative` and `num_speculative_tokens` as the scheduler takes them; None: off. Anything
    but "" and "ngram" names a draft model (engine/draft_model.py loads it)."""
    if method == "":
        return None
    return Speculation(num_tokens, "ngram" if method == "ngram" else "draft")


def draft_model_for(method: str, target: Any) -> DraftModel | None:
    """The draft model `[engine] speculative` names (a path), loaded beside the target; None otherwise."""
    return None if method in ("", "ngram") else DraftModel.load(method, target)


@dataclass(frozen=True)
class DraftRows:
    """One speculating decode: its first logits row, its drafts, and how each of its 1 + k rows samples."""

    request_id: str
    first_row: int
    draft: tuple[int, ...]
    rows: list[SamplingRow]


def verify(sampler: Sampler, logits: torch.Tensor, groups: list[DraftRows], masks: StepMasks | None = None
           ) -> dict[str, tuple[list[int], list[TokenLogprobs | None]]]:
    """Per request: the drafts it keeps then the token after them, with each one's logprobs. `masks`:
    the grammars' masks of the groups' rows (Grammars.draft_masks), applied before anything reads them."""
    dev = logits.device
    rows = [r for g in groups for r in g.rows]
    index = [g.first_row + j for g in groups for j in range(len(g.rows))]
    raw = logits[torch.tensor(index, dtype=torch.long, device=dev)].float()  # a copy: masks go in place
    if masks is not None:
        masks.apply(raw)
    processed = raw
    if any(r.processing is not None and r.processing.active for r in rows):
        processed = apply_processors(raw, [r.processing or ProcessorRow() for r in rows])
    greedy = [r.temperature < GREEDY_BELOW for r in rows]
    # the draft each row verifies (-1: the last row of a group, which verifies none)
    drafts = [g.draft[j] if j < len(g.draft) else -1 for g in groups for j in range(len(g.rows))]
    keep = argmax_rows(processed).tolist()  # greedy: the token each row would take
    x = u = None
    kept: list[bool] = []
    if not all(greedy):
        x = sampler.filtered(processed, rows)
        u = sampler.uniforms(rows, dev, 2)  # per row: the keep-or-reject test, then a draw
        p_draft = x.softmax(dim=-1).gather(1, torch.tensor(drafts, device=dev).clamp(min=0)[:, None])
        kept = (u[:, :1] < p_draft.double()).squeeze(1).tolist()
    # walk each group to its first rejected draft: that row (or its last) draws the final token
    finals: list[tuple[int, bool]] = []  # (row, the draft there was rejected)
    start = 0
    for g in groups:
        row = start
        while row < start + len(g.draft) and (keep[row] == drafts[row] if greedy[row] else kept[row]):
            row += 1
        finals.append((row, row < start + len(g.draft)))
        start += len(g.rows)
    final_tokens = [keep[row] for row, _ in finals]
    drawn = [i for i, (row, _) in enumerate(finals) if not greedy[row]]
    if drawn:
        assert x is not None and u is not None
        sel = torch.tensor([finals[i][0] for i in drawn], dtype=torch.long, device=dev)
        xs = x[sel].clone()
        for j, i in enumerate(drawn):
            row, rejected = finals[i]
            if rejected:  # the residual max(0, p - q) of a one-token draft q: p without that token
                xs[j, drafts[row]] = float("-inf")
        for j, t in zip(drawn, sampler.draw(xs, u[sel, 1]).tolist(), strict=True):
            final_tokens[j] = t
    out: dict[str, tuple[list[int], list[TokenLogprobs | None]]] = {}
    start, emitted_rows, emitted = 0, [], []
    for g, (row, _), last in zip(groups, finals, final_tokens, strict=True):
        tokens = [*g.draft[: row - start], last]
        emitted_rows.extend(range(start, row + 1))
        emitted.extend(tokens)
        out[g.request_id] = (tokens, [])
        start += len(g.rows)
    lps, tops = sampler.logprobs(raw[emitted_rows], torch.tensor(emitted, device=dev),
                                 [rows[i] for i in emitted_rows])
    i = 0
    for tokens, logprobs in out.values():
        for t in tokens:
            lp, top = lps[i], tops[i]
            logprobs.append(None if lp is None or top is None else TokenLogprobs(t, lp, tuple(top)))
            i += 1
    return out
