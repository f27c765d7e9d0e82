"""Pictures (matplotlib Agg): one run's latencies, a sweep's CDFs, and step timelines from step_trace."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on a server, and no GUI toolkit to import
import matplotlib.pyplot as plt  # noqa: E402

from mixserve.bench.report import STALL_THRESHOLD_S, RequestResult  # noqa: E402
from mixserve.bench.run import results_from_records  # noqa: E402
from mixserve.bench.trace import StepRecord  # noqa: E402

KIND_COLORS = {"short": "tab:blue", "long": "tab:red"}


def cdf_points(values: Sequence[float]) -> tuple[list[float], list[float]]:
    """Sorted values and the fraction of values at or below each."""
    xs = sorted(values)
    return xs, [(i + 1) / len(xs) for i in range(len(xs))]


def _ms(values) -> list[float]:
    return [v * 1000 for v in values if v is not None]


def _step_cdf(ax, values: Sequence[float], label: str, **kw) -> None:
    if values:
        xs, ys = cdf_points(values)
        # start from 0 at the smallest value, so a class of one request still draws a visible step;
        # few values get markers, so each request can be counted
        marker = "o" if len(xs) <= 12 else None
        ax.step([xs[0], *xs], [0.0, *ys], where="post", label=label, marker=marker, ms=4, **kw)


def _done(report: dict, kind: str | None = None) -> list[RequestResult]:
    return [r for r in results_from_records(report["requests"]) if r.ok and (kind is None or r.kind == kind)]


def plot_run(report: dict, path: str | Path, title: str = "") -> Path:
    """TTFT and TPOT CDFs by class, and every request's tokens over time (a stall is a visible gap)."""
    fig, (ax_ttft, ax_tpot, ax_time) = plt.subplots(1, 3, figsize=(17, 5))
    kinds = sorted({r["kind"] for r in report["requests"]})
    for kind in kinds:
        done = _done(report, kind)
        color = KIND_COLORS.get(kind)
        _step_cdf(ax_ttft, _ms(r.ttft for r in done), f"{kind} (n={len(done)})", color=color)
        _step_cdf(ax_tpot, _ms(r.tpot for r in done), f"{kind} (n={len(done)})", color=color)
    ax_ttft.set(xlabel="time to first token (ms)", ylabel="fraction of requests", title="TTFT CDF")
    ax_tpot.set(xlabel="time per output token (ms)", ylabel="fraction of requests", title="TPOT CDF")
    for r in results_from_records(report["requests"]):
        color = KIND_COLORS.get(r.kind, "gray") if r.ok else "black"
        ax_time.plot([r.start, r.end], [r.index, r.index], color=color, lw=0.6, alpha=0.5)
        ax_time.plot(r.token_times, [r.index] * len(r.token_times), "|", color=color, ms=4)
    for kind in kinds:
        ax_time.plot([], [], "|", color=KIND_COLORS.get(kind), label=f"{kind}: a token")
    ax_time.set(xlabel="time since the bench started (s)", ylabel="request index",
                title="tokens per request over time (line: sent to done)")
    for ax in (ax_ttft, ax_tpot, ax_time):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # a run where nothing completed has no curves
            ax.legend(loc="lower right" if ax is not ax_time else "upper left", fontsize=8)
    fig.suptitle(title or _run_title(report))
    return _save(fig, path)


def _run_title(report: dict) -> str:
    s = report["settings"]
    return (f"{s.get('model', '?')}: {report['completed']} requests done, {report['failed']} failed, "
            f"{report['output_token_throughput'] or 0:.1f} output tok/s")


def plot_sweep_ttft(runs: Sequence[tuple[str, dict]], path: str | Path) -> Path:
    """TTFT CDF per setting: short requests and long prompts side by side (log time axis)."""
    fig, axes = plt.subplots(1, 2, figsize=(14, 5))
    for ax, kind in zip(axes, ("short", "long"), strict=True):
        for label, report in runs:
            _step_cdf(ax, _ms(r.ttft for r in _done(report, kind)), label, lw=1.6)
        ax.set(xscale="log", xlabel="time to first token (ms, log scale)", ylabel="fraction of requests",
               title=f"TTFT CDF, {kind} requests")
        ax.grid(alpha=0.3, which="both")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="lower right")
    return _save(fig, path)


def plot_sweep_tpot(runs: Sequence[tuple[str, dict]], path: str | Path,
                    stall_threshold: float = STALL_THRESHOLD_S) -> Path:
    """Short requests per setting: TPOT CDF, and the CDF of each one's worst inter-token gap (stalls)."""
    fig, (ax_tpot, ax_gap) = plt.subplots(1, 2, figsize=(14, 5))
    for label, report in runs:
        done = _done(report, "short")
        _step_cdf(ax_tpot, _ms(r.tpot for r in done), label, lw=1.6)
        _step_cdf(ax_gap, _ms(r.max_gap for r in done), label, lw=1.6)
    ax_tpot.set(xlabel="time per output token (ms)", ylabel="fraction of short requests",
                title="TPOT CDF, short requests")
    ax_gap.axvline(stall_threshold * 1000, color="black", ls="--", lw=1, label=f"stall ({stall_threshold} s)")
    ax_gap.set(xscale="log", xlabel="worst gap between two tokens of the request (ms, log scale)",
               ylabel="fraction of short requests", title="worst inter-token gap CDF, short requests")
    for ax in (ax_tpot, ax_gap):
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8, loc="lower right")
    return _save(fig, path)


@dataclass(frozen=True)
class Timeline:
    """One setting's steps, aligned to its bench start, with what to mark on them."""

    label: str
    steps: list[StepRecord]
    budget: int
    long_arrivals: list[float]


def plot_timelines(timelines: Sequence[Timeline], path: str | Path) -> Path:
    """Tokens per step over time, decode and prefill stacked, one panel per setting on a shared time axis."""
    fig, axes = plt.subplots(len(timelines), 1, figsize=(15, 2.6 * len(timelines) + 0.8), sharex=True,
                             squeeze=False)
    for n, (ax, tl) in enumerate(zip(axes[:, 0], timelines, strict=True)):
        starts = [s.start_s for s in tl.steps]
        widths = [max(s.duration_s, 1e-4) for s in tl.steps]
        decode = [s.decode_tokens for s in tl.steps]
        prefill = [s.prefill_tokens for s in tl.steps]
        ax.bar(starts, decode, widths, align="edge", color="tab:blue", lw=0, label="decode tokens")
        ax.bar(starts, prefill, widths, bottom=decode, align="edge", color="tab:orange", lw=0,
               label="prefill tokens")
        ax.axhline(tl.budget, color="black", ls="--", lw=1, label="max_batch_tokens (budget)")
        for i, t in enumerate(tl.long_arrivals):
            ax.axvline(t, color="tab:red", ls=":", lw=1.2, label="long prompt arrives" if i == 0 else None)
        ax.set_ylabel("tokens in step")
        ax.set_title(f"{tl.label}: {len(tl.steps)} steps", fontsize=10, loc="left")
        ax.grid(alpha=0.3)
        if n == 0:  # one legend, outside the plot, so no bar hides behind it
            ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.005, 1.0))
    axes[-1, 0].set_xlabel("time since the bench started (s); a bar is one step, as wide as it ran")
    return _save(fig, path)


def plot_frontier(rows: Sequence[dict], path: str | Path, stall_threshold: float = STALL_THRESHOLD_S,
                  runs: Sequence[dict] = ()) -> Path:
    """Each sweep setting as a point: the short requests' worst gap against the long prompts' TTFT p50.

    Both axes are costs: a fixed budget buys one with the other; a TPOT target should sit low and left.
    `runs` (a repeated sweep's rows of single runs) are drawn small behind the medians: the spread.
    """
    fig, ax = plt.subplots(figsize=(9, 6))
    for r in runs:
        if "error" in r or r.get("short_max_gap_s") is None or r.get("long_ttft_p50_s") is None:
            continue
        ax.scatter(r["short_max_gap_s"] * 1000, r["long_ttft_p50_s"], s=14, zorder=2, alpha=0.45,
                   color="tab:green" if r.get("tpot_target_ms") else "tab:blue")
    for r in rows:
        if "error" in r or r.get("short_max_gap_s") is None or r.get("long_ttft_p50_s") is None:
            continue
        target = bool(r.get("tpot_target_ms"))
        ax.scatter(r["short_max_gap_s"] * 1000, r["long_ttft_p50_s"], s=70, zorder=3,
                   marker="*" if target else "o", color="tab:green" if target else "tab:blue")
        ax.annotate(f"{r['setting']} ({r['short_stalled']} stalled)", (r["short_max_gap_s"] * 1000,
                    r["long_ttft_p50_s"]), textcoords="offset points", xytext=(6, 4), fontsize=8)
    ax.axvline(stall_threshold * 1000, color="black", ls="--", lw=1, label=f"stall ({stall_threshold} s)")
    ax.set(xscale="log", xlabel="short requests' worst gap between two tokens (ms, log scale)",
           ylabel="long prompts' TTFT p50 (s)", title="the stall / long-prompt TTFT frontier")
    ax.margins(x=0.25, y=0.1)  # room for the labels, which run right of their points
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="lower right")
    return _save(fig, path)


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
