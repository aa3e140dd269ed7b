"""``benchmarks/bench_scheduler.py --quick`` runs, in process, at tiny sizes, so
the benchmark cannot rot: its structure (rows, columns, JSON), not its speed.
Skipped, as ``tests/test_vllm/`` is, where vLLM 0.8.5 is not importable."""

from __future__ import annotations

import json

import tests.test_vllm.harness  # noqa: F401  (skips this module without vLLM 0.8.5)
from benchmark_module import load_benchmark


def test_quick_run_structure(tmp_path, capsys):
    bench = load_benchmark("bench_scheduler")
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
        if not result["cuda"]:  # the honest twin: counted operations at the stated costs, and the launch path
            assert set(device["counts"]) == {"torch_op", "upload", "event_record", "event_wait", "read",
                                             "stream_query"}
            assert device["stated_ms"]["p50"] > 0
            if result["launch_path_unmeasured"] is None:
                honest = device["honest_ms"]["p50"]
                assert honest > device["host_ms"]["p50"] and device["launch_path_ms"]["p50"] > 0
    assert rows[0]["replace_per_step"] == 1 and rows[1]["admit_per_step"] == 2

    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| workload | N | vLLM p50 (p99) ms | gpukv reference p50 (p99) ms")
    assert [line.split(" | ")[:2] for line in table[2:]] == [["| decode-heavy", "2"], ["| admission-heavy", "2"]]


def _counts_per_step(bench, n: int) -> dict[str, list[tuple]]:
    """Each workload's counts per measured step of the device scheduler at N."""
    from gpukv.vllm import DeviceScheduler
    from tests.test_vllm import harness

    out = {}
    for kind in ("decode-heavy", "admission-heavy"):  # (one scheduler each: their prompts fill a block every step)
        (rows,) = bench.DeviceCounts(harness, DeviceScheduler, [bench.Workload(kind, n, 4)], 5 + 8).run(2, 3).values()
        out[kind] = [(r["launches"], r["replayed"], *(r["counts"][k] for k in bench.COUNTED)) for r in rows]
    return out


def test_what_a_step_pays_does_not_grow_with_the_requests():
    """Launches (and how many are replayed), torch operations,
    uploads, CUDA events, reads and stream queries per engine step are the
    same at N=16 and N=32, decode-heavy (one request finishing and one
    arriving a step) and admission-heavy (4 new requests a step). (The
    decoders' prompts are 100 to 115 tokens, so from N=16 on a row fills a
    block every step; with fewer, a step may fill none, and the decode then
    skips its phases with no work: fewer launches, never more.)"""
    bench = load_benchmark("bench_scheduler")
    bench.launch_cost().install()  # (host stand-ins recorded as the launches they stand for)
    small, large = _counts_per_step(bench, 16), _counts_per_step(bench, 32)
    for kind in small:
        steps = small[kind] + large[kind]
        others = {x[2:] for x in steps}
        assert len(others) == 1, kind  # torch ops, uploads, events, reads, stream queries: the same every step
        launches = min(x[0] for x in small[kind])
        assert min(x[0] for x in large[kind]) == launches, kind
        # A step launches its fixed sequence, all replayed, and now and then the
        # hash table's rebuild (2 launches) when the host's bound says it is due.
        assert all(x[0] == x[1] == launches or (x[0] == launches + 2 and x[1] >= launches) for x in steps), steps
    torch_ops, uploads, records, waits, reads, queries = next(iter({x[2:] for x in small["decode-heavy"]}))
    assert reads == 1  # the step's one read (update_from_output's usage comes from the free count's host mirror)
