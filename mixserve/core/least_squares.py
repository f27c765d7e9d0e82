"""Least squares with coefficients >= 0, for the step cost model's few features (pure Python)."""

from __future__ import annotations

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


def nonnegative_fit(xx: list[list[float]], xy: list[float], yy: float) -> list[float]:
    """The least-squares coefficients >= 0 (exact for a few features: the best of every feature subset)."""
    n = len(xy)
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
