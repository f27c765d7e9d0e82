"""`bench sweep --request-rate 1,2,3`: the sweep at every rate, then goodput and SLO attainment against the
rate, one line per setting (goodput.md, goodput.json, goodput.png): the capacity of each setting."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

from mixserve.bench.plot import plt


def parse_rates(text: str) -> list[float]:
    """"0.5,1,2" -> [0.5, 1.0, 2.0]; ValueError (one line) for an empty list or a rate <= 0."""
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--request-rate: not a comma-separated list of numbers: {text!r}") from None
    if not rates or any(not r > 0 for r in rates):
        raise ValueError(f"--request-rate: every rate must be > 0, got {text!r}")
    return rates


def rate_dir(out: Path, rate: float) -> Path:
    return out / f"rate{rate:g}"


def run_rates(rates: Sequence[float], sweep_at: Callable[[float, Path], dict], out_dir: str | Path) -> dict:
    """`sweep_at(rate, folder)` (one whole sweep, its summary) at each rate; the goodput table of all."""
    out = Path(out_dir)
    per_rate = {rate: sweep_at(rate, rate_dir(out, rate)) for rate in rates}
    table = goodput_table(per_rate)
    out.mkdir(parents=True, exist_ok=True)
    (out / "goodput.json").write_text(json.dumps(table, indent=1))
    (out / "goodput.md").write_text(goodput_markdown(table))
    plot_goodput(table, out / "goodput.png")
    return table


def goodput_table(per_rate: dict[float, dict]) -> dict:
    """{"rates": [...], "settings": {label: {"goodput": [...], "slo_attainment": [...]}}} from each rate's
    sweep rows (each a setting's median over its repeats; None where it did not run)."""
    rates = list(per_rate)
    settings: dict[str, dict[str, list]] = {}
    for i, rate in enumerate(rates):
        for row in per_rate[rate]["rows"]:
            entry = settings.setdefault(row["setting"], {"goodput": [None] * len(rates),
                                                          "slo_attainment": [None] * len(rates)})
            entry["goodput"][i] = row.get("goodput")
            entry["slo_attainment"][i] = row.get("slo_attainment")
    return {"rates": rates, "settings": settings}


def goodput_markdown(table: dict) -> str:
    """One row per setting, goodput (req/s) and attainment per rate, the best goodput per rate in bold."""
    rates = table["rates"]
    best = [max((s["goodput"][i] or 0 for s in table["settings"].values()), default=0)
            for i in range(len(rates))]
    head = "| setting | " + " | ".join(f"rate {r:g}: goodput, attained" for r in rates) + " |"
    lines = [head, "|---|" + "---|" * len(rates)]
    for label, s in table["settings"].items():
        cells = []
        for i, (g, a) in enumerate(zip(s["goodput"], s["slo_attainment"], strict=True)):
            text = "-" if g is None else f"{g:.3f}"
            text = f"**{text}**" if g is not None and g == best[i] and g > 0 else text
            cells.append(f"{text}, {'-' if a is None else f'{a:.0%}'}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_goodput(table: dict, path: Path) -> None:
    """Goodput and SLO attainment against the request rate, one line per setting."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    for label, s in table["settings"].items():
        pts = [(r, g, a) for r, g, a in zip(table["rates"], s["goodput"], s["slo_attainment"], strict=True)
               if g is not None]
        top.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        bottom.plot([p[0] for p in pts], [100 * (p[2] or 0) for p in pts], marker="o", label=label)
    top.set_ylabel("goodput (req/s)")
    top.legend(fontsize=8)
    bottom.axhline(90, linestyle="--", color="grey")
    bottom.set_ylabel("SLO attainment (%)")
    bottom.set_xlabel("request rate (req/s)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
