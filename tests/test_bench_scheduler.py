"""``benchmarks/bench_scheduler.py --quick`` runs, in process, at tiny sizes, so
the benchmark cannot rot: its structure (rows, columns, JSON), not its speed.
Skipped, as ``tests/test_vllm/`` is, where vLLM 0.8.5 is not importable."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys

import tests.test_vllm.harness  # noqa: F401  (skips this module without vLLM 0.8.5)

BENCH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "bench_scheduler.py"


def _load():
    spec = importlib.util.spec_from_file_location("bench_scheduler", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


def test_quick_run_structure(tmp_path, capsys):
    bench = _load()
    out = tmp_path / "sched.json"
    assert bench.main(["--quick", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [(r["workload"], r["n"]) for r in rows] == [("decode-heavy", 2), ("admission-heavy", 2)]
    for r in rows:
        for name in ("vllm", "reference"):
            assert r[name]["steps"] == result["repeats"] * result["steps"]
            assert 0 < r[name]["p50_ms"] <= r[name]["p99_ms"]
        assert r["ratio_p50"] > 0 and len(r["ratio_p50_per_repeat"]) == result["repeats"]
        device = r["device"]  # the device scheduler ran at N=2, kernels interpreted or on CUDA
        assert device["launches"]["min"] > 0 and device["reads"]["min"] > 0
        assert ("gpu_ms" in device) if result["cuda"] else ("host_ms" in device)
    assert rows[0]["replace_per_step"] == 1 and rows[1]["admit_per_step"] == 2

    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| workload | N | vLLM p50 (p99) ms | gpukv reference p50 (p99) ms")
    assert [line.split(" | ")[:2] for line in table[2:]] == [["| decode-heavy", "2"], ["| admission-heavy", "2"]]
