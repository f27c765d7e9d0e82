"""Least squares with coefficients >= 0, for the step cost model's few features (pure Python)."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import combinations


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None if singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        if abs(m[p][c]) < 1e-12:
            return None
        m[c], m[p] = m[p], m[c]
        for r in range(c + 1, n):
            k = m[r][c] / m[c][c]
            for j in range(c, n + 1):
                m[r][j] -= k * m[c][j]
    out = [0.0] * n
    for r in range(n - 1, -1, -1):
        out[r] = (m[r][n] - sum(m[r][j] * out[j] for j in range(r + 1, n))) / m[r][r]
    return out


def _on_support(xx: list[list[float]], xy: list[float], support: Sequence[int]) -> list[float] | None:
    """The unconstrained fit on `support` (the other coefficients 0); None if singular or any is < 0."""
    c = [0.0] * len(xy)
    if support:
        sol = _solve([[xx[i][j] for j in support] for i in support], [xy[i] for i in support])
        if sol is None or any(v < 0 for v in sol):
            return None
        for i, v in zip(support, sol, strict=True):
            c[i] = v
    return c


def _optimal(xx: list[list[float]], xy: list[float], c: list[float]) -> bool:
    """The KKT conditions of min |y - Xc|^2 over c >= 0, which suffice for this convex problem: no
    coefficient held at 0 would lower the error by growing (its gradient xy_i - (xx c)_i is <= 0)."""
    n = len(xy)
    tol = 1e-9 * max(1.0, *(abs(v) for v in xy))
    return all(c[i] > 0 or xy[i] - sum(xx[i][j] * c[j] for j in range(n)) <= tol for i in range(n))


def nonnegative_fit(xx: list[list[float]], xy: list[float], yy: float,
                    support: Sequence[int] | None = None) -> list[float]:
    """The least-squares coefficients >= 0 (exact for a few features: the best of every feature subset).
    `support`: the features a previous fit kept; when their fit is still optimal it is the answer in one
    solve, not 2**n (the step cost model refits after every step)."""
    n = len(xy)
    if support is not None:
        c = _on_support(xx, xy, support)
        if c is not None and _optimal(xx, xy, c):
            return c
    best, best_sse = [0.0] * n, yy
    for k in range(n, 0, -1):
        for subset in combinations(range(n), k):
            sol = _solve([[xx[i][j] for j in subset] for i in subset], [xy[i] for i in subset])
            if sol is None or any(c < 0 for c in sol):
                continue
            c = [0.0] * n
            for i, v in zip(subset, sol, strict=True):
                c[i] = v
            sse = yy - 2 * sum(c[i] * xy[i] for i in range(n)) + sum(
                c[i] * xx[i][j] * c[j] for i in range(n) for j in range(n))
            if sse < best_sse - 1e-15:
                best, best_sse = c, sse
    return best
