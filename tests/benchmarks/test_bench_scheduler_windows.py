"""``benchmarks/bench_scheduler.py --sliding-window`` (a window model's step,
vLLM 0.33 on) and ``--policy priority`` run in process at tiny sizes, so the
options cannot rot; and are refused where they cannot run. Skipped, as ``tests/test_vllm033/`` is,
where vLLM 0.33's generation is not importable."""

from __future__ import annotations

import json

import pytest

import tests.test_vllm033.harness  # noqa: F401  (skips this module without vLLM 0.33 or later)
from benchmark_module import load_benchmark


def test_quick_window_run_structure(tmp_path, capsys):
    bench = load_benchmark("bench_scheduler")
    out = tmp_path / "windows.json"
    assert bench.main(["--quick", "--sliding-window", "32", "--hybrid", "--schedulers", "Scheduler", "--device-n",
                       "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert (result["sliding_window"], result["hybrid"], result["schedulers"]) == (32, True, ["Scheduler"])
    rows = result["rows"]
    assert [(r["workload"], r["n"]) for r in rows] == [("decode-heavy", 2), ("admission-heavy", 2)]
    for r in rows:
        for name in ("vllm", "reference"):
            assert r[name]["steps"] == result["repeats"] * result["steps"]
    printed = capsys.readouterr().out
    assert "The model's KV cache: a full-attention group and a 32-token sliding-window group." in printed


def test_a_window_run_takes_the_window_into_the_schedulers_config():
    bench = load_benchmark("bench_scheduler")
    config = bench.Workload("decode-heavy", 4, 2, 32, True).config(3)
    plain = bench.Workload("decode-heavy", 4, 2).config(3)
    assert (config["sliding_window"], config["hybrid"]) == (32, True)
    assert "sliding_window" not in plain
    assert config["num_blocks"] - 64 == 2 * (plain["num_blocks"] - 64)  # (both groups hold blocks, from one pool)


@pytest.mark.parametrize(("argv", "version", "says"), [
    (["--sliding-window", "32"], 0, "--sliding-window needs vLLM 0.33 or later"),
    (["--sliding-window", "1"], 1, "a window of 2 tokens or more"),
    (["--hybrid"], 1, "--hybrid needs --sliding-window TOKENS"),
    (["--policy", "priority"], 0, "--policy needs vLLM 0.33 or later"),
    (["--prefill-interval", "3"], 0, "--prefill-interval needs vLLM 0.33 or later"),
    (["--prefill-interval", "0"], 1, "K >= 1"),
])
def test_window_options_are_refused_where_they_cannot_run(argv, version, says, capsys):
    bench = load_benchmark("bench_scheduler")
    with pytest.raises(SystemExit) as exit_info:
        bench._args(argv, bench.VERSIONS[version])
    assert exit_info.value.code == 2
    assert says in capsys.readouterr().err


SCHEDULER_OPTIONS = [
    # (argv, the JSON's key and value, the header's words, Workload's field and value, make_scheduler's option)
    pytest.param(["--policy", "priority"], ("policy", "priority"),
                 "The model's KV cache: one full-attention group; vLLM's priority policy.",
                 dict(policy="priority"), ("policy", "priority"), id="priority"),
    pytest.param(["--prefill-interval", "3"], ("prefill_interval", 3),
                 "one full-attention group; vLLM's prefill cadence of 3 steps.",
                 dict(prefill_interval=3), ("prefill_schedule_interval", 3), id="prefill-cadence"),
]


@pytest.mark.parametrize(("argv", "recorded", "header", "workload", "option"), SCHEDULER_OPTIONS)
def test_quick_run_structure_with_a_scheduler_option(argv, recorded, header, workload, option, tmp_path, capsys):
    bench = load_benchmark("bench_scheduler")
    out = tmp_path / "run.json"
    assert bench.main(["--quick", *argv, "--schedulers", "Scheduler", "--device-n", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result[recorded[0]] == recorded[1]
    assert all(r["reference"]["steps"] == result["repeats"] * result["steps"] for r in result["rows"])
    assert header in capsys.readouterr().out
    assert bench.Workload("admission-heavy", 4, 2, **workload).config(3)[option[0]] == option[1]
    assert option[0] not in bench.Workload("admission-heavy", 4, 2).config(3)
