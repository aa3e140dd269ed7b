"""``benchmarks/bench_worker.py --quick`` runs, in process, so the benchmark
cannot rot: its rows and what it counts per step (bytes, ids, launches),
which do not depend on the machine. Skipped, as ``tests/test_vllm033/`` is,
where vLLM 0.33 or later is not importable."""

from __future__ import annotations

import json

import tests.test_vllm033.harness  # noqa: F401  (skips this module without vLLM 0.33+)
from benchmark_module import load_benchmark

# (workload, path): ids handed, d2h bytes, runner h2d bytes, runner launches
COUNTS = {
    # 16 rows start a block; vLLM uploads the 16 ids and their row, start and
    # end (4 x 64 B) and every row's block count (256 x 4 B); the worker the
    # block counts alone (no request added: the row map stays)
    ("decode-256", "vllm"): (16, 64, 1280, 3),
    ("decode-256", "worker"): (16, 64, 1024, 2),
    ("decode-256", "worker, no handoff"): (0, 0, 1024, 2),
    # 512 ids, 4 B each; the worker: the block counts and the row map (257 x 8 B)
    ("admit-8k", "vllm"): (512, 2048, 1024 + 2048 + 12, 3),
    ("admit-8k", "worker"): (512, 2048, 1024 + 2056, 2),
    ("admit-8k", "worker, no handoff"): (0, 0, 1024 + 2056, 2),
    ("admit-128k", "vllm"): (8192, 32768, 1024 + 32768 + 12, 3),
    ("admit-128k", "worker"): (8192, 32768, 1024 + 2056, 2),
    ("admit-128k", "worker, no handoff"): (0, 0, 1024 + 2056, 2),
}


def test_quick_run_counts_each_paths_bytes_and_launches(tmp_path, capsys):
    bench = load_benchmark("bench_worker")
    out = tmp_path / "worker.json"
    assert bench.main(["--quick", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert (result["steps"], result["warmup"]) == (2, 1)
    seen = {}
    for r in result["rows"]:
        hand, run = r["handoff"], r["runner"]
        seen[r["workload"], r["path"]] = (hand["ids"] if hand else 0, hand["d2h"] if hand else 0, run["h2d"],
                                          run["launches"])
        assert run["ms"] > 0 and (hand is None or hand["ms"] > 0)
        if hand is not None:
            assert hand["objects"] >= hand["ids"]  # (an int object an id, at least: the lists SchedulerOutput holds)
    assert seen == COUNTS

    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| workload | path | ids handed | d2h B | pickled B |")
    assert [line.split(" | ")[:2] for line in table[2:]] == [[f"| {w}", p] for w, p in COUNTS]
