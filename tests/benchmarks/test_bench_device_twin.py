"""``benchmarks/device_twin.py``, the device scheduler's honest twin: it
times torch on one thread, runs its uploads through the pinned path's
Python, prints each stated cost beside its count, and gives the first timed
step beside the others (the warm-up's check). The twin runs under vLLM
0.8.5's scheduler (skipped, as ``tests/test_vllm/`` is, without it)."""

from __future__ import annotations

import pytest
import torch

import tests.test_vllm.harness  # noqa: F401  (skips this module without vLLM 0.8.5)
from benchmark_module import load_benchmark


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_twin_uploads_through_the_pinned_path_on_one_thread(two_threads):  # noqa: ARG001
    from gpukv.vllm import DeviceScheduler
    from tests.test_vllm import harness

    bench = load_benchmark("bench_scheduler")
    bench.launch_cost().install()
    counts = bench.DeviceCounts(harness, DeviceScheduler, [bench.Workload("admission-heavy", 2, 2)], 3 + 8)
    real_staging = counts.real.sched.kv_cache_manager.manager._staging
    twin_staging = counts.twin.sched.kv_cache_manager.manager._staging
    seen: dict[str, list[tuple[str, int]]] = {"real": [], "twin": []}  # (upload path, torch threads)
    for name, staging in (("real", real_staging), ("twin", twin_staging)):
        def host_view(array, _view=staging._host_view, _seen=seen[name]):
            _seen.append(("staging buffer", torch.get_num_threads()))
            return _view(array)

        def upload_host(key, out, count=None, _up=staging.upload_host, _seen=seen[name], _staging=staging):
            _seen.append(("host array" if _staging._pinned else "plain", torch.get_num_threads()))
            return _up(key, out, count)

        staging._host_view, staging.upload_host = host_view, upload_host
    rows = counts.run(1, 2)["admission-heavy"]
    assert len(rows) == 2 and all(r["host_ms"] > 0 for r in rows)
    # The twin's uploads take the pinned path, as a GPU host does (a staging buffer's views, or a host
    # array's one copy: a step's plans, the admission's included), torch on one thread; the real
    # (interpreted) scheduler's uploads stay plain CPU tensors.
    paths = {path for path, _ in seen["twin"]}
    assert "host array" in paths and paths <= {"staging buffer", "host array"}
    assert {threads for _, threads in seen["twin"]} == {1}
    assert seen["real"] and {path for path, _ in seen["real"]} == {"plain"}
    assert torch.get_num_threads() == 2  # (restored after)


def test_stated_costs_printed_beside_their_counts():
    twin = load_benchmark("device_twin")
    head = twin.twin_head(twin.GpuCosts.parse("read=20,torch_op=2.5"))
    assert head.split(" | ")[1:6] == ["torch ops (x 2.5 us)", "uploads (x 4 us)",
                                      "events recorded (x 2 us), waited (x 1 us)", "reads (x 20 us)",
                                      "stream queries (x 0.5 us)"]


def test_summary_gives_the_first_timed_step_beside_the_others():
    twin = load_benchmark("device_twin")
    counts = dict.fromkeys(twin.COUNTED, 1)
    rows = [{"launches": 3, "replayed": 3, "reads": 1, "counts": counts, "host_ms": ms} for ms in (4.0, 1.0, 2.0, 3.0)]
    summary = twin.device_summary(rows)
    assert summary["first_host_ms"] == {"first": 4.0, "p50_others": 2.0}
    assert summary["host_ms"]["p50"] == 2.5 and summary["launches"] == {"mean": 3.0, "min": 3, "max": 3}
