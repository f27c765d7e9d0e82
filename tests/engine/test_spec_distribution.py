"""Verification keeps the target distribution: chi-square over many draws of a small vocabulary.

Each group is one speculating decode with the same logits rows and drafts; its first token must follow
row 0's distribution, its second (given the first draft was kept) row 1's, and so on, whatever the drafts.
"""

from __future__ import annotations

import math

import pytest
import torch

from mixserve.engine.speculative import DraftRows, verify
from mixserve.engine.structured import StepMasks
from mixserve.runner.logits_processors import ProcessorRow
from mixserve.runner.sampler import Sampler, SamplingRow

VOCAB = 8
DRAWS = 40_000


def chi2_critical(df: int, z: float = 3.719) -> float:
    """The 1 - 1e-4 quantile of chi-square with `df` degrees of freedom (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def assert_follows(tokens: list[int], probs: torch.Tensor) -> None:
    """`tokens` are draws from `probs`: none where it is 0, counts within chi-square's 1e-4 quantile."""
    n = len(tokens)
    counts = torch.bincount(torch.tensor(tokens), minlength=VOCAB).double()
    support = probs > 0
    assert counts[~support].sum() == 0, f"drew a token of probability 0: {counts.tolist()}"
    expected = probs[support].double() * n
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    df = int(support.sum()) - 1
    assert stat < chi2_critical(df), f"chi2 {stat:.1f}, {df} dof: {counts.tolist()} vs {expected.tolist()}"


def target(sampler: Sampler, logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """The distribution a row samples from without speculation."""
    x = logits[None].clone()
    if row.processing is not None:
        for t, b in row.processing.logit_bias:
            x[0, t] += b
    return sampler.filtered(x, [row]).softmax(dim=-1)[0]


def run(rows: list[SamplingRow], logits: torch.Tensor, draft: tuple[int, ...], n: int = DRAWS,
        allowed: list[list[int]] | None = None) -> list[list[int]]:
    """n identical speculating decodes verified in one call; each one's tokens. `allowed`: per row, the
    tokens a grammar's mask lets through."""
    sampler = Sampler(seed=1234)
    k = len(draft)
    batch = logits.repeat(n, 1)  # group g's rows: g*(k+1) .. g*(k+1)+k
    groups = [DraftRows(str(g), g * (k + 1), draft, rows) for g in range(n)]
    masks = None
    if allowed is not None:
        bits = torch.tensor([sum(1 << t for t in a) for a in allowed], dtype=torch.int32)
        masks = StepMasks(bits.repeat(n)[:, None], list(range(n * (k + 1))))
    out = verify(sampler, batch, groups, masks)
    return [out[str(g)][0] for g in range(n)]


@pytest.mark.parametrize("row", [
    SamplingRow(temperature=1.0),
    SamplingRow(temperature=0.7, top_k=5, top_p=0.9),
    SamplingRow(temperature=1.3, min_p=0.05),
], ids=["plain", "top-k-top-p", "min-p"])
def test_every_position_follows_its_rows_distribution(row: SamplingRow) -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB) * 1.5
    sampler = Sampler()
    probs = [target(sampler, logits[j], row) for j in range(3)]
    # drafts: a likely token first, then a middling one: both kept and rejected often enough to test
    draft = (int(probs[0].argmax()), int(probs[1].argsort(descending=True)[1]))
    outs = run([row] * 3, logits, draft)
    assert_follows([o[0] for o in outs], probs[0])
    second = [o[1] for o in outs if o[0] == draft[0]]
    assert len(second) > 1000
    assert_follows(second, probs[1])
    third = [o[2] for o in outs if o[:2] == list(draft)]
    assert len(third) > 200
    assert_follows(third, probs[2])
    assert all(len(o) <= 3 and o[:-1] == list(draft[: len(o) - 1]) for o in outs)


def test_a_draft_the_filters_remove_is_always_rejected_and_the_rest_unchanged() -> None:
    torch.manual_seed(1)
    logits = torch.randn(2, VOCAB)
    row = SamplingRow(temperature=1.0, top_k=3)
    draft = (int(logits[0].argmin()),)  # outside the top 3
    outs = run([row, row], logits, draft, n=20_000)
    assert all(len(o) == 1 for o in outs)
    assert_follows([o[0] for o in outs], target(Sampler(), logits[0], row))


def test_each_row_uses_its_own_processing() -> None:
    # row 1 (after the first draft) pushes token 3 up hard: its tokens must follow that row, not row 0's
    torch.manual_seed(2)
    logits = torch.randn(1, VOCAB).repeat(2, 1)
    plain = SamplingRow(temperature=1.0)
    biased = SamplingRow(temperature=1.0, processing=ProcessorRow(logit_bias=((3, 4.0),)))
    draft = (int(logits[0].argmax()),)
    outs = run([plain, biased], logits, draft, n=20_000)
    second = [o[1] for o in outs if len(o) == 2]
    assert_follows(second, target(Sampler(), logits[1], biased))


def test_greedy_keeps_exactly_the_argmax_run() -> None:
    logits = torch.full((4, VOCAB), -1.0)
    for j, t in enumerate((5, 2, 7, 1)):
        logits[j, t] = 3.0
    greedy = SamplingRow(temperature=0.0)
    assert run([greedy] * 4, logits, (5, 2, 7), n=1) == [[5, 2, 7, 1]]
    assert run([greedy] * 4, logits, (5, 3, 7), n=1) == [[5, 2]]
    assert run([greedy] * 4, logits, (4, 2, 7), n=1) == [[5]]


def test_seeded_rows_repeat_their_draws() -> None:
    torch.manual_seed(3)
    logits = torch.randn(3, VOCAB)
    rows = [SamplingRow(temperature=1.0, seed=1000 + j) for j in range(3)]
    draft = (int(logits[0].argmax()), int(logits[1].argmax()))
    assert run(rows, logits, draft, n=50) == run(rows, logits, draft, n=50)
    assert len({tuple(o) for o in run(rows, logits, draft, n=50)}) == 1  # the seed alone decides


def test_under_a_grammars_masks_each_position_follows_its_masked_row() -> None:
    pytest.importorskip("xgrammar")
    torch.manual_seed(4)
    logits = torch.randn(3, VOCAB)
    row = SamplingRow(temperature=1.0)
    allowed = [[0, 2, 5, 6], [1, 3, 4], [0, 3, 4, 7]]

    def masked(j: int) -> torch.Tensor:
        x = torch.full((VOCAB,), float("-inf"))
        x[allowed[j]] = logits[j, allowed[j]]
        return target(Sampler(), x, row)

    # the first draft is allowed at row 0; the second is refused by row 1's mask: never kept
    draft = (int(masked(0).argmax()), 7)
    outs = run([row] * 3, logits, draft, allowed=allowed)
    assert_follows([o[0] for o in outs], masked(0))
    second = [o[1] for o in outs if len(o) > 1]
    assert len(second) > 1000 and all(len(o) <= 2 for o in outs)
    assert_follows(second, masked(1))
