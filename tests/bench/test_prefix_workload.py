"""The shared-prefix workload: every prompt starts with one of the shared prefixes, questions differ."""

from __future__ import annotations

import argparse

import pytest

from mixserve.bench.workload import shared_prefix_workload
from mixserve.cli.bench import add_workload_flags, build_workload


def test_prompts_share_their_prefix_round_robin_and_differ_after_it():
    specs = shared_prefix_workload(6, 2.0, prefix_len=40, num_prefixes=2, question_len=(5, 9), seed=1)
    assert [s.index for s in specs] == list(range(6))
    arrivals = [s.arrival_s for s in specs]
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals)
    firsts = [s.prompt[:40] for s in specs]
    assert firsts[0] == firsts[2] == firsts[4] != firsts[1] == firsts[3] == firsts[5]
    assert all(5 <= len(s.prompt) - 40 <= 9 and s.prompt_len == len(s.prompt) for s in specs)
    assert len({tuple(s.prompt[40:]) for s in specs}) == 6
    assert specs == shared_prefix_workload(6, 2.0, prefix_len=40, num_prefixes=2, question_len=(5, 9), seed=1)
    with pytest.raises(ValueError, match="num_prefixes"):
        shared_prefix_workload(1, 1.0, num_prefixes=0)


def test_the_bench_cli_builds_it():
    p = argparse.ArgumentParser()
    add_workload_flags(p, "random")
    specs, desc = build_workload(p.parse_args(["--workload", "shared-prefix", "--prefix-len", "64",
                                               "--num-requests", "5", "--input-len", "10"]))
    assert desc["workload"] == "shared-prefix" and desc["prefix_tokens"] == 64 and len(specs) == 5
    assert len({tuple(s.prompt[:64]) for s in specs}) == 1
    assert all(64 + 5 <= len(s.prompt) <= 64 + 15 for s in specs)
