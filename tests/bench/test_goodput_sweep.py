"""`bench sweep --request-rate 0.5,1,2 --slo-mode`: the rate list, the SLO-mode setting's server flags, the
goodput table and picture from each rate's sweep, and the one-line errors."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from mixserve.bench.goodput_sweep import goodput_markdown, parse_rates, run_rates
from mixserve.bench.report import RequestResult, build_report
from mixserve.bench.sweep import parse_settings
from mixserve.cli import main
from mixserve.cli.bench import slo_flags


def test_parse_rates_and_its_errors() -> None:
    """A comma list of positive numbers; anything else is one line naming --request-rate."""
    assert parse_rates("0.5, 1,2") == [0.5, 1.0, 2.0]
    for bad in ("", "1,x", "0,1", "-2"):
        with pytest.raises(ValueError, match="--request-rate"):
            parse_rates(bad)


def test_the_slo_mode_setting_serves_the_sweeps_slos(tmp_path: Path) -> None:
    """--slo-ttft 2 --slo-tpot 0.2 --slo-mode: one more setting, at the budget, with the server's ms flags."""
    flags = slo_flags(argparse.Namespace(slo_mode=True, slo_ttft=2.0, slo_tpot=0.2))
    assert flags == "--slo-ttft-ms 2000 --slo-tpot-ms 200"
    settings = parse_settings("256", 512, 0, "", flags)
    slo = settings[-1]
    assert slo.slo_mode and slo.max_batch_tokens == 512 and slo.slug == "slo-b512" and slo.policy == "SLO"
    assert "--slo-ttft-ms 2000 --slo-tpot-ms 200" in slo.server_args("", tmp_path / "c.json")
    assert "--slo" not in settings[0].server_args("", tmp_path / "c.json")
    with pytest.raises(ValueError, match="--slo-mode needs"):
        slo_flags(argparse.Namespace(slo_mode=True, slo_ttft=None, slo_tpot=None))


def summary(goodputs: dict[str, tuple[float, float]]) -> dict:
    return {"rows": [{"setting": k, "goodput": g, "slo_attainment": a} for k, (g, a) in goodputs.items()]}


def test_run_rates_writes_the_table_and_the_picture(tmp_path: Path) -> None:
    """Each rate's sweep runs in its own folder; goodput.json/.md carry its rows' figures; goodput.png is
    a PNG."""
    seen = []
    figures = {0.5: {"chunk 256": (0.5, 1.0), "SLO mode": (0.5, 1.0)},
               2.0: {"chunk 256": (0.8, 0.4), "SLO mode": (1.6, 0.8)}}

    def sweep_at(rate: float, folder: Path) -> dict:
        seen.append((rate, folder))
        return summary(figures[rate])

    table = run_rates([0.5, 2.0], sweep_at, tmp_path)
    assert seen == [(0.5, tmp_path / "rate0.5"), (2.0, tmp_path / "rate2")]
    assert table["settings"]["SLO mode"] == {"goodput": [0.5, 1.6], "slo_attainment": [1.0, 0.8]}
    assert json.loads((tmp_path / "goodput.json").read_text()) == table
    md = (tmp_path / "goodput.md").read_text()
    assert "| SLO mode | **0.500**, 100% | **1.600**, 80% |" in md
    assert "| chunk 256 | **0.500**, 100% | 0.800, 40% |" in md
    assert (tmp_path / "goodput.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert goodput_markdown(table) == md


def test_attainment_counts_failed_requests_as_missed() -> None:
    """slo_attainment: requests that met both SLOs over all requests (a failed one never does)."""
    ok = RequestResult(0, "short", 8, 4, ok=True, start=0.0)
    ok.token_times = [0.5, 0.6, 0.7, 0.8]
    slow = RequestResult(1, "short", 8, 4, ok=True, start=0.0)
    slow.token_times = [3.0, 3.1, 3.2, 3.3]
    failed = RequestResult(2, "short", 8, 4, ok=False, start=0.0, error="timeout")
    report = build_report([ok, slow, failed], 4.0, slo_ttft=2.0, slo_tpot=0.2)
    assert report["slo_attainment"] == pytest.approx(1 / 3) and report["goodput"] == pytest.approx(0.25)
    assert build_report([ok], 1.0)["slo_attainment"] is None


def test_several_rates_without_an_slo_is_refused(capsys) -> None:
    """Goodput needs an SLO: exit 2 and one line, before any server starts."""
    assert main(["bench", "sweep", "--request-rate", "1,2", "--out-dir", "/nonexistent/x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--slo-ttft or --slo-tpot" in err[0]
