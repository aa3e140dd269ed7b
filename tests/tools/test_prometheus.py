"""Prometheus metrics (``gpukv.tools.prometheus``, the ``metrics`` extra): values
as the replay counts them, the names and labels vLLM uses (vLLM 0.33.0's,
and vLLM 0.8.5's block-unit counters on request), the HTTP endpoint of
``gpukv replay --metrics-port``, and the message when the extra is missing."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from conftest import ROOT
from gpukv.core.metrics import PrefixCacheStats
from gpukv.tools import prometheus
from gpukv.tools.cli import main
from gpukv.tools.replay import Replay, ReplayOptions
from gpukv.tools.traces import builtin_trace_path, load_trace


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
    metrics = prometheus.ServingMetrics(vllm085=True)
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
    assert metrics.value("vllm:gpu_prefix_cache_hits_total") >= s["hit_blocks"] > 0  # re-admissions' too


def test_replay_serves_the_metrics_over_http(capsys):
    status = main(["replay", "--backend", "reference", "--max-requests", "3", "--no-progress", "--metrics-port", "0",
                   "--served-model-name", "my-model", "--metrics-vllm085"])
    assert status == 0
    err = capsys.readouterr().err
    url = re.search(r"Prometheus metrics at (http://127\.0\.0\.1:\d+/metrics)", err).group(1)
    with urllib.request.urlopen(url, timeout=10) as response:  # the server thread outlives the replay
        text = response.read().decode()
    labels = 'engine="0",model_name="my-model"'
    for name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:kv_cache_usage_perc",
                 "vllm:num_preemptions_total", "vllm:num_requests_running", "vllm:num_requests_waiting",
                 "gpukv:evictions_total", "vllm:gpu_prefix_cache_queries_total", "vllm:gpu_prefix_cache_hits_total",
                 "vllm:gpu_cache_usage_perc"):
        assert re.search(rf"^{re.escape(name)}\{{{labels}\}} ", text, re.M), name
    assert re.search(r'^gpukv:manager_step_seconds_bucket\{engine="0",le="0.001",model_name="my-model"\} ', text, re.M)



# `import torch` held until the test says go: the replay cannot get past it, so
# an endpoint that answers meanwhile was up before torch loaded.
_HOLD_TORCH = """
import importlib.abc, os, sys, time
HELD, GO = sys.argv[1], sys.argv[2]
class HoldTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch":
            open(HELD, "w").close()
            deadline = time.monotonic() + 120
            while not os.path.exists(GO) and time.monotonic() < deadline:
                time.sleep(0.02)
        return None  # the usual finders import it
sys.meta_path.insert(0, HoldTorch())
from gpukv.tools.cli import main
sys.exit(main(["replay", "--backend", "reference", "--max-requests", "2", "--prompt-only", "--no-progress",
               "--metrics-port", sys.argv[3]]))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_metrics_answer_before_torch_is_imported(tmp_path):
    held, go, port = tmp_path / "held", tmp_path / "go", _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("GPUKV_HASH_KEY", None)
    start = time.monotonic()
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        proc = subprocess.Popen([sys.executable, "-c", _HOLD_TORCH, str(held), str(go), str(port)], cwd=ROOT,
                                env=env, stdout=out, stderr=err)
    try:
        text, answered = None, None
        while text is None and proc.poll() is None and time.monotonic() - start < 25:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
                    text, answered = response.read().decode(), time.monotonic() - start
            except OSError:  # refused: not up yet
                time.sleep(0.05)
        assert text is not None, (f"no metrics within {time.monotonic() - start:.1f} s while torch's import is "
                                  f"held (exit {proc.poll()}): {(tmp_path / 'err').read_text()}")
        assert re.search(r'^vllm:num_requests_running\{engine="0",model_name="gpukv"\} 0\.0$', text, re.M), text
        go.touch()
        assert proc.wait(timeout=120) == 0, (tmp_path / "err").read_text()
    finally:
        go.touch()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert held.exists()  # torch's import did go through the hold: the endpoint answered before it
    assert "prefix cache hit rate" in (tmp_path / "out").read_text()
    print(f"metrics answered {answered:.2f} s after the CLI started")


def test_vllm_label_sets_and_the_0_8_5_names():
    """Current vLLM's names carry its labels, model_name and engine; the
    0.8.5 counters count blocks as 0.8.5 did, re-admissions included."""
    m = prometheus.ServingMetrics(model_name="llama", engine=2, vllm085=True)
    stats = PrefixCacheStats(requests=1, queries=40, hits=32, query_blocks=3, hit_blocks=2, preempted_requests=1,
                             preempted_queries=33, preempted_hits=32, vllm085_query_blocks=4, vllm085_hit_blocks=4)
    m.observe_step(stats, usage=0.25, blocks_in_use=10, running=1, waiting=0, preemptions=0, evictions_total=0,
                   step_seconds=1e-4)
    assert m.registry.get_sample_value("vllm:prefix_cache_queries_total",
                                       {"model_name": "llama", "engine": "2"}) == 40
    assert m.registry.get_sample_value("vllm:prefix_cache_queries_total") is None  # never without the labels
    assert (m.value("vllm:gpu_prefix_cache_queries_total"), m.value("vllm:gpu_prefix_cache_hits_total")) == (4, 4)
    assert m.value("vllm:gpu_cache_usage_perc") == m.value("vllm:kv_cache_usage_perc") == 0.25
    assert prometheus.ServingMetrics().value("vllm:gpu_cache_usage_perc") is None  # only when asked for


def test_the_0_8_5_options_need_the_metrics_port(capsys):
    with pytest.raises(SystemExit) as info:
        main(["replay", "--backend", "reference", "--max-requests", "2", "--no-progress", "--metrics-vllm085"])
    assert info.value.code == 2 and "add --metrics-port" in capsys.readouterr().err


def test_without_the_extra_the_option_is_one_error_line(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import fails as if not installed
    with pytest.raises(SystemExit) as info:
        main(["replay", "--backend", "reference", "--max-requests", "2", "--no-progress", "--metrics-port", "0"])
    assert info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "need the 'metrics' extra" in lines[0], lines
    assert "pip install prometheus-client" in lines[0], lines


def test_a_metrics_port_in_use_is_a_user_error_with_a_hint(capsys):
    """``serve`` refuses a port in use with an ``AddressInUseError``, an
    OSError, so ``gpukv replay --metrics-port`` reports it as the user's
    mistake (exit status 2), not as an internal error."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(SystemExit) as info:
            main(["replay", "--backend", "reference", "--max-requests", "1", "--no-progress",
                  "--metrics-port", str(port)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"127.0.0.1:{port} is in use (Address already in use); pass another port, or 0 for any free one" in err
    assert "internal error" not in err
