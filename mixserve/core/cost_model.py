"""The step cost model: a step's duration from its tokens and the context they attend to, fit online,
and the step budget a TPOT target draws from it (`TpotBudget`, the scheduler's hook)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mixserve.core.least_squares import nonnegative_fit
from mixserve.core.step_drift import StepDrift

# Features are scaled before the fit so the normal equations stay well conditioned: a step holds up to
# thousands of tokens and millions of (token, position) pairs.
TOKEN_SCALE = 1e3
PAIR_SCALE = 1e6
SEQ_SCALE = 1e2
NUM_FEATURES = 6  # 1, tokens, pairs, sequences, decodes beside a chunk, rows up to FEW_ROWS
# The CPU linears change kernel here (quant_linear.FEW_ROWS, mkl_linear.MKL_FEW_ROWS): up to it a row costs
# its own multiply-adds, past it the weight is decoded or packed once a step and a row costs less
# (docs/decisions/step-cost-few-rows.md). A hinge, not a bucket: the cost stays continuous in the tokens.
FEW_ROWS = 32
# Each size bucket (tokens per step, by powers of two) forgets with this window (in its own steps): a run
# of many decode-only steps then cannot wash out what the rarer big prefill steps taught the fit.
DEFAULT_WINDOW = 64
FORMAT = "mixserve-step-cost/4"  # /4 per_few_row_s, /3 per_mixed_decode_s, /2 per_seq_s; older load (as 0)


def attended_pairs(start: int, length: int) -> int:
    """(token, position) pairs that `length` causal tokens at positions `start ..` attend to."""
    return length * start + length * (length + 1) // 2


@dataclass(frozen=True)
class StepFeatures:
    """What the cost of a step depends on: its tokens, the context they attend to, and its sequences.

    The sequences are a feature of their own because a decode costs more than a prompt token: each
    sequence is one more row of the LM head and one more attention call, paid per row and not per token
    (docs/decisions/step-cost-per-sequence.md). The decodes (one-token sequences) are counted too: beside
    a chunk a decode may cost other than alone (its rows go through the chunk's kernels), which decides
    between mixed and exclusive steps (core/slo.py).
    """

    num_tokens: int = 0
    num_pairs: int = 0
    num_seqs: int = 0
    num_decodes: int = 0

    def plus(self, start: int, length: int) -> StepFeatures:
        """These features with one more sequence of `length` tokens at positions `start ..`."""
        return StepFeatures(self.num_tokens + length, self.num_pairs + attended_pairs(start, length),
                            self.num_seqs + 1, self.num_decodes + (length == 1))

    @property
    def num_few_rows(self) -> int:
        """The step's rows (tokens) up to FEW_ROWS: each costs the few-row kernels' extra per row."""
        return min(self.num_tokens, FEW_ROWS)

    @property
    def num_mixed_decodes(self) -> int:
        """Decodes in a step that also holds a chunk (0 in a decode-only step)."""
        return self.num_decodes if self.num_seqs > self.num_decodes else 0


def step_features(seqs: Iterable[tuple[int, int]]) -> StepFeatures:
    """The features of a step from its sequences' (start, length) pairs."""
    f = StepFeatures()
    for start, length in seqs:
        f = f.plus(start, length)
    return f


@dataclass(frozen=True)
class CostCoefficients:
    """Step time = overhead_s + per_token_s * tokens + per_pair_s * attended (token, position) pairs
    + per_seq_s * sequences + per_mixed_decode_s * decodes beside a chunk + per_few_row_s * min(tokens,
    FEW_ROWS)."""

    overhead_s: float = 0.0
    per_token_s: float = 0.0
    per_pair_s: float = 0.0
    per_seq_s: float = 0.0
    per_mixed_decode_s: float = 0.0
    per_few_row_s: float = 0.0

    def predict(self, f: StepFeatures) -> float:
        return self.overhead_s + self.per_token_s * f.num_tokens + self.per_pair_s * f.num_pairs + \
            self.per_seq_s * f.num_seqs + self.per_mixed_decode_s * f.num_mixed_decodes + \
            self.per_few_row_s * f.num_few_rows

    def as_list(self) -> list[float]:
        return [self.overhead_s, self.per_token_s, self.per_pair_s, self.per_seq_s, self.per_mixed_decode_s,
                self.per_few_row_s]


def _x(f: StepFeatures) -> tuple[float, ...]:
    return (1.0, f.num_tokens / TOKEN_SCALE, f.num_pairs / PAIR_SCALE, f.num_seqs / SEQ_SCALE,
            f.num_mixed_decodes / SEQ_SCALE, f.num_few_rows / SEQ_SCALE)


@dataclass
class _Bucket:
    """Decayed least-squares sums (X'X, X'y, y'y) of the steps of one size range."""

    xx: list[list[float]] = field(default_factory=lambda: [[0.0] * NUM_FEATURES for _ in range(NUM_FEATURES)])
    xy: list[float] = field(default_factory=lambda: [0.0] * NUM_FEATURES)
    yy: float = 0.0
    weight: float = 0.0

    def add(self, x: tuple[float, ...], y: float, decay: float) -> None:
        for i in range(NUM_FEATURES):
            self.xy[i] = self.xy[i] * decay + x[i] * y
            for j in range(NUM_FEATURES):
                self.xx[i][j] = self.xx[i][j] * decay + x[i] * x[j]
        self.yy = self.yy * decay + y * y
        self.weight = self.weight * decay + 1.0


class StepCostModel:
    """Online least-squares fit of `CostCoefficients` to observed step durations.

    Until it has observed anything it predicts with `prior`. Steps are kept as decayed sums per size
    bucket (powers of two of the step's tokens), refit lazily when the coefficients are next read.
    """

    def __init__(self, prior: CostCoefficients | None = None, window: int = DEFAULT_WINDOW) -> None:
        self.prior = prior or CostCoefficients()
        self.decay = 1.0 - 1.0 / window
        self.window = window
        self._buckets: dict[int, _Bucket] = {}
        self._fit: CostCoefficients | None = None
        self._support: tuple[int, ...] | None = None  # the features the last fit kept (> 0): its warm start
        self.num_samples = 0
        # the last step observed: its time as predicted before it ran (None when nobody asked), as measured
        self.last_predicted_s: float | None = None
        self.last_actual_s: float | None = None
        self.step_drift = StepDrift()  # the recent measured / predicted ratio, and the spread around it

    def observe(self, f: StepFeatures, seconds: float, planned: bool = True) -> None:
        """Learn from one step that took `seconds`; `planned`: it held decodes and chunks (drift)."""
        if f.num_tokens <= 0 or not math.isfinite(seconds) or seconds < 0:
            return
        # the prediction as it stood when the step was planned (known if the fit was read since the last
        # step, as it is while a target is on; a refit here would cost every step without one)
        fit = self._fit if self._buckets else self.prior
        self.last_predicted_s = None
        if fit is not None:
            base = fit.predict(f)
            self.last_predicted_s = base * self.drift
            if base > 0 and planned:
                self.step_drift.observe(seconds / base)
        self.last_actual_s = seconds
        self._buckets.setdefault(f.num_tokens.bit_length(), _Bucket()).add(_x(f), seconds, self.decay)
        self.num_samples += 1
        self._fit = None

    @property
    def coefficients(self) -> CostCoefficients:
        if not self._buckets:
            return self.prior
        if self._fit is None:
            self._fit = self.fit(NUM_FEATURES)
        return self._fit

    def fit(self, num_features: int = NUM_FEATURES) -> CostCoefficients:
        """The fit of the observed steps on the first `num_features` features (3: without sequences, the
        model before per_seq_s, for comparing models on the same steps)."""
        n, buckets = num_features, self._buckets.values()
        xx = [[sum(b.xx[i][j] for b in buckets) for j in range(n)] for i in range(n)]
        xy = [sum(b.xy[i] for b in buckets) for i in range(n)]
        full = n == NUM_FEATURES
        fit = nonnegative_fit(xx, xy, sum(b.yy for b in buckets), self._support if full else None)
        if full:
            self._support = tuple(i for i, v in enumerate(fit) if v > 0)
        c = fit + [0.0] * (NUM_FEATURES - n)
        return CostCoefficients(c[0], c[1] / TOKEN_SCALE, c[2] / PAIR_SCALE, c[3] / SEQ_SCALE,
                                c[4] / SEQ_SCALE, c[5] / SEQ_SCALE)

    @property
    def drift(self) -> float:
        return self.step_drift.factor

    @property
    def budget_coefficients(self) -> CostCoefficients:
        """The fit scaled by the drift and the spread's margin: what the budget plans with, a step's p90
        time (step_drift.py; the file keeps the fit)."""
        c, d = self.coefficients, self.drift * self.step_drift.margin
        return c if d == 1.0 else CostCoefficients(*(x * d for x in c.as_list()))

    def predict(self, f: StepFeatures) -> float:
        """The time the budget expects a step of `f` to take now (the fit times the drift)."""
        return self.coefficients.predict(f) * self.drift

    # ---- the JSON file (`mixserve simulate --cost-model`, written by serve on shutdown and --profile) --

    def to_dict(self, **info: object) -> dict:
        """The coefficients, and the fit's state so that a loaded model keeps learning where it was."""
        return {"format": FORMAT, **asdict(self.coefficients), "num_samples": self.num_samples,
                "window": self.window, "info": info,
                "buckets": {str(k): asdict(b) for k, b in sorted(self._buckets.items())}}

    @classmethod
    def from_dict(cls, d: dict) -> StepCostModel:
        """The inverse of to_dict; ValueError (one line) for a file that is not a cost model."""
        try:
            coeffs = CostCoefficients(float(d["overhead_s"]), float(d["per_token_s"]), float(d["per_pair_s"]),
                                      float(d.get("per_seq_s", 0.0)),  # 0: a file from before these terms
                                      float(d.get("per_mixed_decode_s", 0.0)),
                                      float(d.get("per_few_row_s", 0.0)))
            model = cls(coeffs, int(d.get("window", DEFAULT_WINDOW)))
            for k, b in (d.get("buckets") or {}).items():
                xx = [[float(v) for v in row] for row in b["xx"]]
                xy = [float(v) for v in b["xy"]]
                if len(xy) != NUM_FEATURES:  # the sums of an older model's features: it predicts by its
                    continue  # coefficients (the prior) until this run's steps refit it
                model._buckets[int(k)] = _Bucket(xx, xy, float(b["yy"]), float(b["weight"]))
            model.num_samples = int(d.get("num_samples", 0))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"not a step cost model ({type(e).__name__}: {e})") from None
        if any(c < 0 or not math.isfinite(c) for c in coeffs.as_list()):
            raise ValueError("a step cost model's coefficients must be finite and >= 0")
        return model

    def save(self, path: str | Path, **info: object) -> None:
        Path(path).write_text(json.dumps(self.to_dict(**info), indent=1) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> StepCostModel:
        """Read a cost model file; ValueError naming the file for a missing or bad one."""
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except OSError as e:
            raise ValueError(f"{path}: cannot read the cost model ({e.strerror})") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON ({e})") from None
        try:
            return cls.from_dict(data if isinstance(data, dict) else {})
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
