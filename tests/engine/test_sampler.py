"""The batched sampler: greedy, filters, per-request seeds, logprobs."""

from __future__ import annotations

import torch

from mixserve.runner.sampler import Sampler, SamplingRow, row_seed


def logits(rows: int, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_temperature_zero_is_argmax() -> None:
    x = logits(4)
    out = Sampler()(x, [SamplingRow(temperature=0.0)] * 4)
    assert out.token_ids == x.argmax(-1).tolist()


def test_top_k_1_and_tiny_top_p_and_min_p_1_are_greedy() -> None:
    x = logits(6)
    rows = [SamplingRow(temperature=1.5, top_k=1)] * 2 + [SamplingRow(temperature=1.5, top_p=1e-6)] * 2
    rows += [SamplingRow(temperature=1.5, min_p=1.0)] * 2
    out = Sampler(seed=3)(x, rows)
    assert out.token_ids == x.argmax(-1).tolist()


def test_top_k_keeps_only_the_k_best() -> None:
    x = logits(1).repeat(200, 1)
    out = Sampler(seed=1)(x, [SamplingRow(temperature=5.0, top_k=3)] * 200)
    allowed = set(x[0].topk(3).indices.tolist())
    assert set(out.token_ids) <= allowed and len(set(out.token_ids)) > 1


def test_top_p_keeps_the_nucleus() -> None:
    x = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(400, 1)
    out = Sampler(seed=2)(x, [SamplingRow(temperature=1.0, top_p=0.7)] * 400)
    assert set(out.token_ids) == {0, 1}  # 0.5 < 0.7, so the second is needed; 0.8 >= 0.7 stops there


def test_sampling_follows_the_distribution() -> None:
    x = torch.log(torch.tensor([[0.7, 0.2, 0.1]])).repeat(3000, 1)
    out = Sampler(seed=4)(x, [SamplingRow(temperature=1.0)] * 3000)
    freq = torch.bincount(torch.tensor(out.token_ids), minlength=3).float() / 3000
    assert torch.allclose(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.05)


def test_seeded_row_is_independent_of_the_batch() -> None:
    x = logits(5)
    seeded = SamplingRow(temperature=1.0, seed=row_seed(7, 0))
    alone = Sampler(seed=0)(x[2:3], [seeded]).token_ids[0]
    others = [SamplingRow(temperature=1.0)] * 5
    for shared_seed in range(5):
        rows = [*others[:2], seeded, *others[3:]]
        assert Sampler(seed=shared_seed)(x, rows).token_ids[2] == alone
    rows_at = [[SamplingRow(temperature=1.0, seed=row_seed(7, n))] for n in range(30)]
    draws = {Sampler()(x[2:3], r).token_ids[0] for r in rows_at}
    assert len(draws) > 1  # a new position gets new randomness


def test_logprobs_are_a_distribution() -> None:
    x = logits(3, vocab=12)
    rows = [SamplingRow(temperature=0.0, num_logprobs=12), SamplingRow(temperature=0.8, num_logprobs=2),
            SamplingRow(temperature=0.0)]
    out = Sampler()(x, rows)
    top = out.top_logprobs[0]
    assert len(top) == 12 and abs(sum(torch.tensor([lp for _, lp in top]).exp().tolist()) - 1) < 1e-5
    assert [t for t, _ in top][0] == out.token_ids[0]  # greedy picks the most likely
    assert top[0][1] == out.logprobs[0]
    assert len(out.top_logprobs[1]) == 2 and out.top_logprobs[1][0][1] >= out.top_logprobs[1][1][1]
    assert out.logprobs[1] <= 0 and out.logprobs[2] is None and out.top_logprobs[2] is None


def test_tiny_temperature_samples_greedily_instead_of_overflowing():
    # logits / 5e-324 overflows to inf and the softmax to NaN; such temperatures must act as greedy
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.9], [4.0, 1.0, 0.0, 3.99]])
    rows = [SamplingRow(temperature=5e-324), SamplingRow(temperature=1e-7, top_p=1e-300)]
    out = Sampler(seed=0)(logits, rows)
    assert out.token_ids == [1, 0]


def test_the_ends_of_the_uniform_never_pick_a_filtered_token(monkeypatch) -> None:
    # inverse-CDF sampling: u = 0 and u just below 1 land on the first and last token left by top-k,
    # never on a filtered one before or after them (their probability adds nothing to the sum)
    x = torch.tensor([[0.0, 5.0, 1.0, 4.0, 0.5], [9.0, 0.0, 0.0, 0.0, 8.0]])
    rows = [SamplingRow(temperature=1.0, top_k=2)] * 2
    for u, expected in ((0.0, [1, 0]), (1.0 - 2**-53, [3, 4])):
        sampler = Sampler(seed=0)
        monkeypatch.setattr(sampler, "uniforms", lambda rows, dev, count=1, u=u: torch.full(
            (len(rows), count), u, dtype=torch.float64))
        assert sampler(x, rows).token_ids == expected
