"""Sampling vectorized over the batch: logits processing (logits_processors.py), temperature, top-k,
top-p, min-p, per-request seeds, logprobs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mixserve.runner.logits_processors import ProcessorRow, apply_processors

_MASK = float("-inf")
# Temperatures below this sample greedily: dividing logits by, say, 5e-324 overflows to inf and the
# softmax to NaN (vLLM uses the same cut-off).
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingRow:
    """How one logits row is sampled. `seed` (already mixed with the step) gives the row its own
    generator; None draws from the sampler's shared generator. `num_logprobs` None = no logprobs."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    num_logprobs: int | None = None
    processing: ProcessorRow | None = None  # penalties, logit_bias, min_tokens; None = none


@dataclass(frozen=True)
class SampleResult:
    """Per row: the token, and (when asked) its log-probability and the top-k (id, log-probability)."""

    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None]


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Each row's index of its largest value, the first on ties (as `argmax`): `max(dim).indices` is
    cheaper than argmax on a CPU, and this is the largest per-row cost of a greedy step on the host
    (docs/decisions/host-cost-per-row.md)."""
    return x.max(dim=-1).indices


def row_seed(seed: int, num_generated: int) -> int:
    """The generator seed of a seeded request's next token: a function of its seed and position only,
    so its tokens do not depend on the rest of the batch, nor on being preempted and recomputed."""
    return hash((seed, num_generated)) & 0x7FFF_FFFF_FFFF_FFFF


class Sampler:
    """Picks one token per logits row: argmax for temperature 0, else inverse-CDF sampling with one
    uniform number per row, which lets every row draw it from its own generator (per-request seeds)."""

    def __init__(self, seed: int = 0, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SampleResult:
        """`logits` (len(rows), vocab), float32; returns one token per row. Logprobs are those of the
        model's own distribution, before any processing (as vLLM's default)."""
        raw = logits = logits.float()
        if any(r.processing is not None and r.processing.active for r in rows):
            logits = apply_processors(raw, [r.processing or ProcessorRow() for r in rows])
        greedy = [r.temperature < GREEDY_BELOW for r in rows]
        if all(greedy):
            tokens = argmax_rows(logits)
        else:
            tokens = self._sample(logits, rows, greedy)
        token_list = tokens.tolist()
        lps, tops = self.logprobs(raw, tokens, rows)
        return SampleResult(token_list, lps, tops)

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow], greedy: list[bool]) -> torch.Tensor:
        sampled = self.draw(self.filtered(logits, rows), self.uniforms(rows, logits.device)[:, 0])
        if any(greedy):
            mask = torch.tensor(greedy, device=logits.device)
            sampled = torch.where(mask, argmax_rows(logits), sampled)
        return sampled

    def filtered(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """The processed `logits` scaled by each row's temperature with top-k, top-p and min-p applied
        (-inf outside): the distribution a sampled row draws from is their softmax."""
        dev = logits.device
        vocab = logits.shape[1]
        temps = torch.tensor([max(r.temperature, GREEDY_BELOW) for r in rows], device=dev)
        x = logits / temps.unsqueeze(1)
        if any(0 < r.top_k < vocab for r in rows) or any(r.top_p < 1.0 for r in rows):
            x = self._top_k_top_p(x, rows)
        if any(r.min_p > 0.0 for r in rows):
            probs = x.softmax(dim=-1)
            min_p = torch.tensor([r.min_p for r in rows], device=dev).unsqueeze(1)
            x = x.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), _MASK)
        return x

    @staticmethod
    def draw(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """One token per row of filtered logits `x`, by inverse CDF at the row's U[0, 1) number in `u`."""
        # Inverse CDF: the first token whose cumulative probability exceeds u * total, u ~ U[0, 1) one
        # number per row (a filtered-out token adds nothing to the sum, so it is never the first), not
        # Gumbel noise: a draw per vocabulary entry per row was most of a sample's time on a CPU
        # (docs/decisions/host-cost-per-row.md). Float64 sums, so the tail is not rounded away.
        cdf = x.softmax(dim=-1).double().cumsum(dim=-1)
        total = cdf[:, -1:]
        point = torch.minimum(u.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
        return torch.searchsorted(cdf, point, right=True).squeeze(1).clamp_(max=x.shape[1] - 1)

    def uniforms(self, rows: list[SamplingRow], dev: torch.device, count: int = 1) -> torch.Tensor:
        """(len(rows), count) U[0, 1) float64: a seeded row's from its own generator (its seed already
        mixes in the position, so it does not depend on the batch), the others' from the sampler's."""
        shared = [i for i, r in enumerate(rows) if r.seed is None]
        u = torch.empty((len(rows), count), dtype=torch.float64)
        if shared:
            drawn = torch.rand((len(shared), count), generator=self.generator, dtype=torch.float64,
                               device=self.device)
            u[shared] = drawn.cpu()
        gen = torch.Generator()  # on the CPU whatever the device: one number, no kernel launch
        for i, r in enumerate(rows):
            if r.seed is not None:
                u[i] = torch.rand(count, generator=gen.manual_seed(r.seed), dtype=torch.float64)
        return u.to(dev)

    @staticmethod
    def _top_k_top_p(x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        dev = x.device
        vocab = x.shape[1]
        ordered, index = x.sort(dim=-1, descending=True)
        ks = torch.tensor([r.top_k if 0 < r.top_k < vocab else vocab for r in rows], device=dev)
        rank = torch.arange(vocab, device=dev).unsqueeze(0)
        ordered = ordered.masked_fill(rank >= ks.unsqueeze(1), _MASK)
        top_p = torch.tensor([r.top_p for r in rows], device=dev).unsqueeze(1)
        probs = ordered.softmax(dim=-1)
        # drop a token once the tokens before it already reach top_p (the most likely is always kept)
        before = probs.cumsum(dim=-1) - probs
        ordered = ordered.masked_fill(before >= top_p, _MASK)
        return torch.full_like(x, _MASK).scatter(1, index, ordered)

    @staticmethod
    def logprobs(
        logits: torch.Tensor, tokens: torch.Tensor, rows: list[SamplingRow]
    ) -> tuple[list[float | None], list[list[tuple[int, float]] | None]]:
        """Log-probabilities of the model's own distribution (before temperature and filtering)."""
        wanted = [i for i, r in enumerate(rows) if r.num_logprobs is not None]
        lps: list[float | None] = [None] * len(rows)
        tops: list[list[tuple[int, float]] | None] = [None] * len(rows)
        if not wanted:
            return lps, tops
        logp = logits[wanted].log_softmax(dim=-1)
        chosen = logp.gather(1, tokens[wanted].unsqueeze(1)).squeeze(1).tolist()
        k = max(rows[i].num_logprobs or 0 for i in wanted)
        top_v, top_i = logp.topk(k, dim=-1) if k > 0 else (logp[:, :0], logp[:, :0].long())
        top_v, top_i = top_v.tolist(), top_i.tolist()
        for j, i in enumerate(wanted):
            n = rows[i].num_logprobs or 0
            lps[i] = chosen[j]
            tops[i] = list(zip(top_i[j][:n], top_v[j][:n], strict=True))
        return lps, tops
