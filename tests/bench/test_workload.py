"""Workloads: reproducible from a seed, exact prompt lengths, workload M's shape."""

from __future__ import annotations

import json

import pytest

from mixserve.bench.workload import load_dataset, poisson_arrivals, random_workload, workload_m


def test_workload_m_has_perf_md_shape():
    specs = workload_m(seed=3)
    short = [s for s in specs if s.kind == "short"]
    long_ = [s for s in specs if s.kind == "long"]
    assert len(short) == 48 and len(long_) == 4
    assert all(32 <= s.prompt_len <= 128 and len(s.prompt) == s.prompt_len for s in short)
    assert all(s.output_len == 64 for s in short)
    assert all(s.prompt_len == 1500 and len(s.prompt) == 1500 and s.output_len == 8 for s in long_)
    span = max(s.arrival_s for s in short)
    assert [s.arrival_s / span for s in long_] == pytest.approx([0.2, 0.4, 0.6, 0.8])
    assert [s.arrival_s for s in specs] == sorted(s.arrival_s for s in specs)
    assert [s.index for s in specs] == list(range(52))


def test_workload_m_is_reproducible_from_its_seed():
    assert workload_m(seed=1) == workload_m(seed=1)
    assert workload_m(seed=1) != workload_m(seed=2)


def test_poisson_arrivals_average_the_rate_and_inf_sends_all_at_once():
    import random

    arrivals = poisson_arrivals(4000, 2.0, random.Random(0))
    assert arrivals[0] == 0.0
    mean_gap = arrivals[-1] / (len(arrivals) - 1)
    assert mean_gap == pytest.approx(0.5, rel=0.1)
    assert poisson_arrivals(5, float("inf"), random.Random(0)) == [0.0] * 5
    with pytest.raises(ValueError):
        poisson_arrivals(3, 0.0, random.Random(0))


def test_random_workload_lengths_classes_and_vocabulary():
    specs = random_workload(20, 4.0, input_len=100, input_len_range=0.5, output_len=7,
                            long_prompt_fraction=0.25, long_input_len=300, long_output_len=3,
                            vocab_size=500, seed=5)
    long_ = [s for s in specs if s.kind == "long"]
    assert len(long_) == 5 and all(s.prompt_len == 300 and s.output_len == 3 for s in long_)
    short = [s for s in specs if s.kind == "short"]
    assert all(50 <= s.prompt_len <= 150 and s.output_len == 7 for s in short)
    assert all(100 <= t < 500 for s in specs for t in s.prompt)
    assert specs == random_workload(20, 4.0, input_len=100, input_len_range=0.5, output_len=7,
                                    long_prompt_fraction=0.25, long_input_len=300, long_output_len=3,
                                    vocab_size=500, seed=5)


def test_dataset_file_gives_text_or_token_prompts(tmp_path):
    path = tmp_path / "d.jsonl"
    rows = [{"prompt": "hello"}, {"prompt": [5, 6, 7], "output_len": 3, "kind": "long"}, {"prompt": "x"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    specs = load_dataset(path, 2, float("inf"), output_len=9)
    assert [(s.prompt, s.prompt_len, s.output_len, s.kind) for s in specs] == [
        ("hello", -1, 9, "short"), ([5, 6, 7], 3, 3, "long")]
