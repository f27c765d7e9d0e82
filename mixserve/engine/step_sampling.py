"""One step's sampling: a token per sampled row, and a speculating decode's drafts verified on its rows."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from mixserve.core.batch import StepPlan
from mixserve.engine.outputs import TokenLogprobs
from mixserve.engine.request_state import RequestState
from mixserve.engine.speculative import DraftRows, verify
from mixserve.engine.structured import StepMasks
from mixserve.runner.sampler import Sampler

# Per request: its token and logprobs, or a speculating decode's tokens (kept drafts, then one) and theirs.
Sampled = dict[str, tuple[int, TokenLogprobs | None] | tuple[list[int], list[TokenLogprobs | None]]]


def sample_step(sampler: Sampler, logits: torch.Tensor, step_plan: StepPlan,
                states: Mapping[str, RequestState], masks: StepMasks | None = None,
                draft_masks: StepMasks | None = None) -> Sampled:
    """The tokens of every sampled row; a middle chunk's row is not among them. Grammars' masks: `masks`
    for the plain rows, `draft_masks` for the speculating decodes' rows (in draft_groups' order)."""
    plain = [(row, rid) for row, rid in step_plan.sample if rid not in step_plan.drafts]
    sampled: Sampled = {}
    if plain:
        index = [row for row, _ in plain]
        rows = logits
        if index != list(range(logits.shape[0])):
            rows = logits[torch.tensor(index, dtype=torch.long, device=logits.device)]
        if masks is not None:  # in place, before the sampler: logprobs are the masked ones (as vLLM)
            masks.apply(rows)
        result = sampler(rows, [states[rid].sampling_row() for _, rid in plain])
        for i, (_, rid) in enumerate(plain):
            token, lp, top = result.token_ids[i], result.logprobs[i], result.top_logprobs[i]
            logprobs = None if lp is None or top is None else TokenLogprobs(token, lp, tuple(top))
            sampled[rid] = (token, logprobs)
    if step_plan.drafts:
        groups = [DraftRows(rid, row, d, states[rid].sampling_rows(d))
                  for row, rid, d in draft_groups(step_plan)]
        sampled.update(verify(sampler, logits, groups, draft_masks))
    return sampled


def draft_groups(step_plan: StepPlan) -> list[tuple[int, str, tuple[int, ...]]]:
    """The speculating decodes in row order: (first logits row, request id, drafts)."""
    return [(row, rid, d) for row, rid in step_plan.sample if (d := step_plan.drafts.get(rid)) is not None]
