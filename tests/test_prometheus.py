"""Prometheus metrics (``gpukv.prometheus``, the ``metrics`` extra): values
as the replay counts them, the names vLLM uses, the HTTP endpoint of
``gpukv replay --metrics-port``, and the message when the extra is missing."""

from __future__ import annotations

import re
import sys
import urllib.request

import pytest

from gpukv import prometheus
from gpukv.cli import main
from gpukv.metrics import PrefixCacheStats
from gpukv.replay import Replay, ReplayOptions
from gpukv.traces import builtin_trace_path, load_trace


def test_a_step_updates_every_metric():
    m = prometheus.ServingMetrics()
    stats = PrefixCacheStats(requests=2, queries=96, hits=32, query_blocks=6, hit_blocks=2, preempted_requests=1,
                             preempted_queries=40, preempted_hits=16)
    m.observe_step(stats, usage=0.25, blocks_in_use=10, running=3, waiting=4, preemptions=1, evictions_total=7,
                   step_seconds=2e-4)
    m.observe_step(PrefixCacheStats(requests=1, queries=4, hits=0), usage=0.5, blocks_in_use=20, running=4,
                   waiting=1, preemptions=0, evictions_total=9, step_seconds=5e-3)
    assert m.value("vllm:prefix_cache_queries_total") == 100
    assert m.value("vllm:prefix_cache_hits_total") == 32
    assert m.value("gpukv:prefix_cache_preempted_queries_total") == 40
    assert m.value("gpukv:prefix_cache_preempted_hits_total") == 16
    assert m.value("vllm:kv_cache_usage_perc") == 0.5
    assert m.value("gpukv:blocks_in_use") == 20
    assert (m.value("vllm:num_requests_running"), m.value("vllm:num_requests_waiting")) == (4, 1)
    assert m.value("vllm:num_preemptions_total") == 1
    assert m.value("gpukv:evictions_total") == 9  # a running total in, increments out
    assert m.value("gpukv:manager_step_seconds_count") == 2
    assert m.value("gpukv:manager_step_seconds_bucket", {"le": "0.0003"}) == 1


def test_the_replay_feeds_the_metrics_what_its_report_says():
    metrics = prometheus.ServingMetrics()
    trace = load_trace(builtin_trace_path(), max_requests=20)
    report = Replay(trace, ReplayOptions(num_blocks=1200, metrics=metrics)).run()
    s = report["summary"]
    assert s["preemptions"] > 0  # the small pool preempts, so every counter moves
    assert metrics.value("vllm:prefix_cache_queries_total") == s["queries"]
    assert metrics.value("vllm:prefix_cache_hits_total") == s["hits"] > 0
    assert metrics.value("gpukv:prefix_cache_preempted_queries_total") == s["preempted_queries"]
    assert metrics.value("vllm:num_preemptions_total") == s["preemptions"]
    assert metrics.value("gpukv:evictions_total") == s["evictions"]
    assert metrics.value("gpukv:manager_step_seconds_count") == s["steps"]
    assert metrics.value("gpukv:blocks_in_use") == report["blocks_in_use"][-1]


def test_replay_serves_the_metrics_over_http(capsys):
    status = main(["replay", "--backend", "reference", "--max-requests", "3", "--no-progress", "--metrics-port", "0"])
    assert status == 0
    err = capsys.readouterr().err
    url = re.search(r"Prometheus metrics at (http://127\.0\.0\.1:\d+/metrics)", err).group(1)
    with urllib.request.urlopen(url, timeout=10) as response:  # the server thread outlives the replay
        text = response.read().decode()
    for name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:kv_cache_usage_perc",
                 "gpukv:evictions_total", "gpukv:manager_step_seconds_bucket"):
        assert re.search(rf"^{re.escape(name)}(\{{[^}}]*\}})? ", text, re.M), name


def test_without_the_extra_the_option_is_one_error_line(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import fails as if not installed
    with pytest.raises(SystemExit) as info:
        main(["replay", "--backend", "reference", "--max-requests", "2", "--no-progress", "--metrics-port", "0"])
    assert info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "need the 'metrics' extra" in lines[0] and "gpukv[metrics]" in lines[0], lines
