"""Prefix caching as an operator sees it: the flag, the /metrics counters, the engine's log line."""

from __future__ import annotations

import argparse
import logging
import re
from dataclasses import replace

import pytest

from mixserve import SamplingParams
from mixserve.config import ConfigError, add_engine_flags, config_from_args
from mixserve.core import SchedulerStats
from mixserve.engine.stats_log import StatsLog
from mixserve.metrics import ServerMetrics


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} ([0-9.e+]+)$", text, re.M)
    assert m is not None, name
    return float(m.group(1))


def stats(queries: int, hits: int) -> SchedulerStats:
    return SchedulerStats(1, 0, 64, 60, 0, 1, 0, prefix_cache_queries=queries, prefix_cache_hits=hits)


def test_flag_and_config_default() -> None:
    p = argparse.ArgumentParser()
    add_engine_flags(p)
    assert config_from_args(p.parse_args([])).engine.enable_prefix_caching is True
    off = p.parse_args(["--enable-prefix-caching", "off"])
    assert config_from_args(off).engine.enable_prefix_caching is False
    with pytest.raises(ConfigError, match="--enable-prefix-caching: must be on or off"):
        config_from_args(p.parse_args(["--enable-prefix-caching", "maybe"]))


def test_metrics_count_queries_and_hits_in_tokens_across_an_engine_restart() -> None:
    m = ServerMetrics()
    m.observe_stats(stats(100, 40), stepped=True)
    m.observe_stats(stats(150, 60), stepped=True)
    text = m.render()[0].decode()
    assert metric(text, "mixserve:prefix_cache_queries_total") == 150
    assert metric(text, "mixserve:prefix_cache_hits_total") == 60
    m.observe_stats(stats(10, 5), stepped=True)  # a new scheduler counts from 0 again
    text = m.render()[0].decode()
    assert metric(text, "mixserve:prefix_cache_queries_total") == 160
    assert metric(text, "mixserve:prefix_cache_hits_total") == 65


def test_the_engine_log_line_reports_the_hit_rate(make_llm, caplog: pytest.LogCaptureFixture) -> None:
    llm = make_llm(prefill_chunk=8, max_batch_tokens=16, max_num_seqs=1)
    system = list(range(10, 30))  # 20 tokens: 5 blocks of 4
    llm.generate([system + [40], system + [41]], SamplingParams(max_tokens=2, temperature=0.0))
    s = llm.engine.stats()
    assert (s.scheduler.prefix_cache_queries, s.scheduler.prefix_cache_hits) == (42, 20)
    log = StatsLog(interval_s=10.0)
    with caplog.at_level(logging.INFO, logger="mixserve.engine"):
        assert log.maybe_log(llm.engine.stats, now=100.0) is None  # the first interval starts
        assert log.maybe_log(llm.engine.stats, now=105.0) is None
        line = log.maybe_log(llm.engine.stats, now=110.0)
    assert line is not None and line in caplog.text
    assert "prefix cache hit rate 47.6% (47.6% since start)" in line
    later = replace(s, scheduler=replace(s.scheduler, prefix_cache_queries=52, prefix_cache_hits=30))
    assert "hit rate 100.0% (57.7% since start)" in log.line(later, 10.0)  # the interval's own rate
    quiet = StatsLog()
    logging.getLogger("mixserve.engine").setLevel(logging.WARNING)
    try:  # INFO off: no line, however long the interval
        assert quiet.maybe_log(llm.engine.stats, now=0.0) is None
        assert quiet.maybe_log(llm.engine.stats, now=1000.0) is None
    finally:
        logging.getLogger("mixserve.engine").setLevel(logging.NOTSET)
