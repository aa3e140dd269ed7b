"""``benchmarks/bench_mooncake.py --quick`` runs, in process, on the first
requests of the Mooncake trace, so the benchmark cannot rot: its structure
(tables, JSON) and its check of equal work, not its speed. Skipped, as
``tests/test_vllm033/`` is, where vLLM 0.33 or later is not importable."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

import tests.test_vllm033.harness  # noqa: F401  (skips this module without vLLM 0.33+)
from benchmark_module import load_benchmark


def test_quick_run_structure(tmp_path, capsys):
    bench = load_benchmark("bench_mooncake")
    out = tmp_path / "mooncake.json"
    assert bench.main(["--quick", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["hits_equal"] is True and result["targets"] == [4, 8]
    assert [(t["scheduler"], t["gpukv"]) for t in result["tables"]] == [
        ("Scheduler", "ReferenceScheduler"), ("AsyncScheduler", "ReferenceAsyncScheduler")]
    for table in result["tables"]:
        # (request 4 generates 3 tokens: at 8 it finishes and request 8 takes its place)
        assert [(r["target"], r["requests_scheduled"]) for r in table["rows"]] == [(4, 4), (8, 9)]
        for r in table["rows"]:
            assert r["running_max"] == r["target"]
            for name in ("vllm", "gpukv"):
                assert r[name]["steps"] == result["repeats"] * result["steps"] == 10
                assert 0 < r[name]["p50_ms"] <= r[name]["p99_ms"]
            assert r["ratio_p50"] > 0 and len(r["ratio_p50_per_repeat"]) == 2
        # vLLM's step split: two more vLLM runs (their work checked equal), one with its manager's calls timed.
        for r in table["rows"]:
            d = r["vllm_split"]
            assert d["steps"] == result["steps"] and d["calls_mean"] > 0
            assert 0 < d["manager_p50_ms"] < d["timed_step_p50_ms"] and d["outside_share"] < 1
            assert d["outside_share"] == d["outside_p50_ms"] / d["step_p50_ms"]
    buckets = [a["bucket"] for a in result["admissions"]]
    assert buckets == ["1-63", "64-255", "256-1023", "1024+"]
    assert sum(a["admissions"] for a in result["admissions"]) == 4 + 9  # (every request the two runs admitted)

    lines = capsys.readouterr().out.splitlines()
    tables = [i for i, line in enumerate(lines) if line.startswith("| target | running")]
    assert len(tables) == 2
    assert sum(line.startswith("| target | vLLM step p50 ms | the same, its manager timed |") for line in lines) == 2
    assert [line.split(" | ")[0] for line in lines[tables[0] + 2:tables[0] + 4]] == ["| 4", "| 8"]
    assert any(line.startswith("| prompt blocks of 16 | admissions |") for line in lines)


def test_quick_run_under_a_long_prefill_threshold(tmp_path, capsys, monkeypatch):
    """``--long-prefill-token-threshold N`` reaches every scheduler the run
    builds, vLLM's and gpukv's; the work stays equal (the run checks it), and
    gpukv's batched runs admit the trace's long prompts chunked at N; the
    summary and the JSON say which threshold."""
    bench = load_benchmark("bench_mooncake")
    harness = tests.test_vllm033.harness
    built = []
    make = harness.make_scheduler

    def recording(cls, **options):
        built.append(make(cls, **options))
        return built[-1]

    monkeypatch.setattr(harness, "make_scheduler", recording)
    out = tmp_path / "mooncake.json"
    assert bench.main(["--quick", "--targets", "4", "--no-admissions", "--schedulers", "Scheduler",
                       "--long-prefill-token-threshold", "256", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["long_prefill_token_threshold"] == 256
    assert {s.scheduler_config.long_prefill_token_threshold for s in built} == {256}
    runs = [s.kv_cache_manager.admissions for s in built if hasattr(s.kv_cache_manager, "admissions")]
    assert runs and all(r.num_chunked > 0 for r in runs)
    assert "long-prefill threshold 256." in capsys.readouterr().out


class _Pool:
    def take(self):
        return 7


class _Pending:
    """gpukv's adapter's pending step (``PendingGrowth``): run from inside a manager call or from the scheduler."""

    def __init__(self):
        self.flushes = 0

    def flush(self):
        self.flushes += 1


class _Manager:
    def __init__(self):
        self.block_pool, self.coordinator = _Pool(), None
        self.pending = _Pending()

    def allocate(self):
        assert type(self.block_pool) is _Pool  # (inside a timed call the manager sees its own pool)
        return self.block_pool.take()

    def free(self):
        assert self.usage == 0.5  # (a call into the manager inside a timed one: counted in it, once)
        self.pending.flush()  # (and the pending step inside one)

    @property
    def usage(self):
        return 0.5


class _Run:
    """A stand-in for ``TraceRun``: a step calls the manager, its pool and the hasher."""

    def __init__(self):
        self.sched = SimpleNamespace(kv_cache_manager=_Manager())
        self.hasher = lambda _request: []

    def step(self, clock):
        t0 = clock()
        kvm = self.sched.kv_cache_manager
        assert kvm.allocate() == 7 and kvm.free() is None and kvm.usage == 0.5 and self.hasher(None) == []
        assert kvm.block_pool.take() == 7
        kvm.pending.flush()  # (the scheduler reading a pending block: the step runs outside any manager call)
        return (clock() - t0) * 1e3


class _Ticks:
    """A clock that reads one second more at each reading."""

    def __init__(self):
        self.t = 0.0

    def __call__(self):
        self.t += 1.0
        return self.t


def test_manager_timer_counts_each_call_once():
    """``ManagerTimer``: each call the scheduler makes into the manager, its
    block pool, its ``usage`` property, the hasher and gpukv's pending step
    (from the scheduler; inside a manager call it is the call's) timed once (inside a
    timed call the manager sees its own pool, unwrapped), what they return
    unchanged, exactly by a clock that ticks once per reading."""
    bench = load_benchmark("bench_mooncake")
    run = _Run()
    timer = bench.ManagerTimer(run, clock=_Ticks())
    assert isinstance(run.sched.kv_cache_manager, _Manager)
    # The step reads the clock 14 times: its own 2, and 2 for each of its 6 timed calls (the calls inside
    # allocate and free read nothing), each of which spans one tick.
    assert timer.step() == (13_000.0, 6_000.0, 6)
    assert timer.step() == (13_000.0, 6_000.0, 6)  # (per step: the counts start again)
    kvm = run.sched.kv_cache_manager
    assert kvm.pending.flushes == 4
    pool = kvm.block_pool
    assert type(pool) is not _Pool and pool.take() == 7  # (the scheduler's view between calls)
    # A run stepped by someone else (the twin's split) takes the figures since the last take: the view's take
    # above and this flush, a tick each.
    kvm.pending.flush()
    assert timer.take() == (2_000.0, 2) and timer.take() == (0.0, 0)


def test_materialised_prompts_share_the_trace_prefixes():
    """Equal hash ids give equal tokens, block for block, and a request's last
    block is cut at its input length."""
    bench = load_benchmark("bench_mooncake")
    first, second = bench.load_prompts(2)  # hash ids 0..13 and 0, 14..27
    assert (first.index, first.input_length, first.max_tokens, first.blocks) == (0, 6758, 500, 423)
    assert (second.index, second.input_length, second.max_tokens, second.blocks) == (1, 7322, 490, 458)
    a, b = first.tokens(), second.tokens()
    assert a == list(range(6758))  # (ids 0..13 in order: block h holds h*512 .. h*512+511; cut at 6758)
    assert b[:512] == a[:512] and b[512:1024] == list(range(14 * 512, 15 * 512)) and len(b) == 7322
    assert [bench.bucket_of(n) for n in (1, 63, 64, 255, 256, 1023, 1024, 8000)] == [
        "1-63", "1-63", "64-255", "64-255", "256-1023", "256-1023", "1024+", "1024+"]


def test_unequal_work_exits_nonzero():
    """A gpukv run whose hits differ from vLLM's ends the benchmark with status 1."""
    bench = load_benchmark("bench_mooncake")
    ref = bench.Work({"0": 32, "1": 0}, [(("0", 16), ("1", 16))])
    got = bench.Work({"0": 16, "1": 0}, [(("0", 16), ("1", 16))])
    with pytest.raises(SystemExit) as exc:
        bench.same_work("test", ref, got)
    assert exc.value.code == 1
    with pytest.raises(SystemExit) as exc:
        bench.same_work("test", ref, bench.Work(dict(ref.hits), [(("0", 16), ("1", 8))]))
    assert exc.value.code == 1
    bench.same_work("test", ref, bench.Work(dict(ref.hits), list(ref.decisions)))  # equal: no exit


def test_quick_run_with_the_device_twin(tmp_path, capsys):
    """``--device``: the device scheduler on vLLM's plan (its work checked
    equal), a third column beside vLLM and the reference, and without CUDA
    its honest twin's table, each stated cost beside its count; with
    ``--worker`` a fourth, the same scheduler bound as under gpukv's worker:
    no block id read back, the process's binding undone after."""
    from gpukv.vllm.v0_33.binding import BINDING

    bench = load_benchmark("bench_mooncake")
    out = tmp_path / "mooncake.json"
    assert bench.main(["--quick", "--device", "--worker", "--targets", "4", "--no-admissions", "--schedulers",
                       "Scheduler", "--json", str(out)]) == 0
    assert BINDING.expected is None and BINDING.manager is None
    result = json.loads(out.read_text())
    assert result["device"] is True and result["admissions"] == []
    (table,) = result["tables"]
    assert (table["scheduler"], table["gpukv"], table["device"]) == ("Scheduler", "ReferenceScheduler",
                                                                     "DeviceScheduler")
    (row,) = table["rows"]
    device = row["device"]
    assert device["steps"] == result["steps"] == 5
    assert device["launches"]["min"] > 0 and device["reads"]["max"] > 0  # (a decode step may read nothing)
    worker = row["worker"]
    assert worker["steps"] == 5 and worker["launches"]["min"] > 0
    assert worker["reads"]["max"] == 0  # (the step that read its new blocks' ids reads nothing bound)
    lines = capsys.readouterr().out.splitlines()
    assert lines[lines.index("vLLM's Scheduler against gpukv's ReferenceScheduler and DeviceScheduler"
                             + ("" if result["cuda"] else " (its honest twin: host time + stated GPU costs)")
                             + ":") + 1].endswith("| gpukv device p50 (p99) ms | ratio device/vLLM p50 [against "
                                                  "vLLM stepped beside it, its p50 ms] | gpukv device, worker "
                                                  "binding p50 (p99) ms | ratio worker/vLLM p50 [against vLLM "
                                                  "stepped beside it, its p50 ms] |")
    # vLLM stepped in lockstep with each device column's timed run (its work checked equal): the bracket's figure.
    line = next(x for x in lines if x.startswith("| 4 | "))  # (the step table, before the counts)
    for d in (device, worker):
        beside = d["vllm_beside"]
        assert beside["steps"] == 5 and 0 < beside["p50_ms"] <= beside["p99_ms"]
        f = d.get("honest_ms") or d.get("wall_ms")
        if f:
            assert (f"| {f['p50'] / row['vllm']['p50_ms']:.2f}x [{f['p50'] / beside['p50_ms']:.2f}x, "
                    f"{beside['p50_ms']:.3f}] |") in line
    if result["cuda"]:
        return
    assert set(device["counts"]) == {"torch_op", "upload", "event_record", "event_wait", "read", "stream_query"}
    assert set(device["first_host_ms"]) == {"first", "p50_others"}
    assert any(line.startswith("| target | binding | launches/step | torch ops (x 5 us) | uploads (x 4 us) |")
               for line in lines)
    assert [line.split(" | ")[1] for line in lines if line.startswith("| 4 | ") and " | " in line][-2:] == [
        "none", "worker"]
    if row["launch_path_unmeasured"] is None:
        assert device["honest_ms"]["p50"] > device["host_ms"]["p50"]
    # The twins' step split: a second twin through the same steps (checked alike), its manager's calls timed.
    for d in (device, worker):
        split = d["manager_split"]
        assert split["steps"] == 5 and split["calls_mean"] > 0
        assert 0 < split["manager_host_p50_ms"] < split["timed_step_p50_ms"]
        assert split["gpu_parts_measured"] is (row["launch_path_unmeasured"] is None)
        if split["gpu_parts_measured"]:
            assert split["manager_mean_ms"] > split["manager_host_mean_ms"]
    head = next(i for i, x in enumerate(lines) if x.startswith("| target | binding | gpukv's calls/step |"))
    assert [x.split(" | ")[:2] for x in lines[head + 2:head + 4]] == [["| 4", "none"], ["| 4", "worker"]]


def test_quick_run_with_the_device_twin_per_admission(tmp_path, capsys):
    """``--device`` with the per-admission pass: gpukv's unbatched device
    scheduler on the admission runs' plan (its work checked equal to vLLM's),
    each admission's lookup and allocation attributed, a device column per
    bucket beside vLLM's, each stated cost beside its count; ``--worker``
    the same bound as under gpukv's worker (no block id read back)."""
    bench = load_benchmark("bench_mooncake")
    out = tmp_path / "mooncake.json"
    assert bench.main(["--quick", "--device", "--worker", "--targets", "4", "--schedulers", "Scheduler",
                       "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    if result["cuda"]:
        pytest.skip("the per-admission device column is the interpreter twin's")
    rows = {a["bucket"]: a for a in result["admissions"]}
    # The first 4 requests: 1 prompt of 64-255 blocks and 3 of 256-1023, each admitted once by every run.
    assert [(b, a["admissions"]) for b, a in rows.items()] == [("1-63", 0), ("64-255", 1), ("256-1023", 3),
                                                                ("1024+", 0)]
    for bucket, a in rows.items():
        for key in ("device", "worker", "batched", "batched_worker"):
            if not a["admissions"]:
                assert key not in a
                continue
            d = a[key]
            assert d["steps"] == a["admissions"]  # (the device admitted vLLM's requests, no more, no fewer)
            assert d["launches"]["min"] > 0 and set(d["counts"]) == set(bench.COUNTED)
            assert d["ratio_p50"] == d["honest_ms"]["p50"] / a["vllm_p50_ms"]
            # (vLLM's pass again after the device runs: the ratio against each vLLM pass)
            vllm = sorted([a["vllm_p50_ms"], a["vllm_after_p50_ms"]])
            assert d["ratio_p50_range"] == [d["honest_ms"]["p50"] / vllm[1], d["honest_ms"]["p50"] / vllm[0]]
            # (vLLM stepped in lockstep with the twin: its admissions of the bucket, timed alike)
            assert d["ratio_beside"] == d["honest_ms"]["p50"] / d["vllm_beside_p50_ms"] and d["vllm_beside_p50_ms"] > 0
            assert d["honest_ms"]["p50"] > d["host_ms"]["p50"] > 0, bucket
            if key.startswith("batched"):  # (a run's step shared by its admissions; those made alone apart)
                assert 1 <= d["shared_mean"] <= a["admissions"] and 0 <= d["alone"]["admissions"] <= a["admissions"]
                assert (d["alone"]["honest_p50_ms"] is None) == (d["alone"]["admissions"] == 0)
        if a["admissions"]:  # (bound, the lookup's hit is read as a size, the admitted ids not at all)
            assert a["worker"]["reads"]["mean"] < a["device"]["reads"]["mean"]
            # (batched: one step an admission at most, where the unbatched path makes a lookup and a step)
            assert a["batched_worker"]["launches"]["max"] < a["worker"]["launches"]["min"]
    assert set(result["device_host_us_per_block"]) == {"device", "worker", "batched", "batched_worker"}
    lines = capsys.readouterr().out.splitlines()
    head = next(i for i, x in enumerate(lines) if x.startswith("Per admission, gpukv's device schedulers' honest "
                                                                "twins on vLLM's plan")) + 1
    assert lines[head].startswith("| prompt blocks of 16 | scheduler | binding | admissions | mean blocks | vLLM "
                                  "total p50 ms, before / after the device runs | launches/admission | torch ops "
                                  "(x 5 us) | uploads (x 4 us) |")
    assert lines[head].endswith("| ratio device/vLLM p50 [against each vLLM pass] | vLLM stepped beside it: p50 ms, "
                                "ratio | admissions per step, mean; admitted alone: count, honest p50 ms |")
    assert [line.split(" | ")[:4] for line in lines[head + 2:head + 10]] == [
        ["| 64-255", "unbatched", "none", "1"], ["| 256-1023", "unbatched", "none", "3"],
        ["| 64-255", "unbatched", "worker", "1"], ["| 256-1023", "unbatched", "worker", "3"],
        ["| 64-255", "batched", "none", "1"], ["| 256-1023", "batched", "none", "3"],
        ["| 64-255", "batched", "worker", "1"], ["| 256-1023", "batched", "worker", "3"]]
    d = rows["256-1023"]["worker"]
    assert lines[head + 5].endswith(f"| {d['vllm_beside_p50_ms']:.3f}, {d['ratio_beside']:.2f}x | - |")
    d = rows["256-1023"]["batched_worker"]
    alone = d["alone"]["honest_p50_ms"]
    assert lines[head + 9].endswith(f"| {d['shared_mean']:.2f}; {d['alone']['admissions']}, "
                                    + ("-" if alone is None else f"{alone:.3f}") + " |")


def test_a_step_admitting_several_requests_is_shared_equally_by_them():
    """The batched scheduler's waiting run is one gpukv step made inside the
    first request's lookup: each request it admitted gets the mean of the
    run's figures and counts, and how many shared it; an admission alone in
    its step keeps its own."""
    bench = load_benchmark("bench_mooncake")

    def admitted(step, host_ms, launches, reads, honest_ms):
        return {"step": step, "host_ms": host_ms, "launches": launches, "replayed": launches, "reads": reads,
                "launch_path_ms": 0.01 * launches, "stated_ms": 0.015 * reads, "honest_ms": honest_ms,
                "counts": {"read": reads, "upload": launches // 6}}

    rows = [admitted(3, 0.30, 12, 1, 0.5), admitted(3, 0.02, 0, 0, 0.02), admitted(4, 0.25, 12, 1, 0.4),
            admitted(3, 0.04, 0, 0, 0.08)]
    bench.share_admitting_steps(rows)
    for a in (rows[0], rows[1], rows[3]):  # (step 3 admitted three)
        assert a == {"step": 3, "host_ms": pytest.approx(0.12), "launches": 4.0, "replayed": 4.0,
                     "reads": pytest.approx(1 / 3), "launch_path_ms": pytest.approx(0.04),
                     "stated_ms": pytest.approx(0.005), "honest_ms": pytest.approx(0.2), "shared": 3,
                     "counts": {"read": pytest.approx(1 / 3), "upload": pytest.approx(2 / 3)}}
    assert rows[2] == dict(admitted(4, 0.25, 12, 1, 0.4), shared=1)


def test_the_batched_runs_admission_is_timed_without_the_running_phase():
    """``apply_running_growth_first``: the running loop's answered
    allocations are applied before the lookup they would ride on, outside
    it, and only when there are some; the lookup's answer is the adapter's."""
    bench = load_benchmark("bench_mooncake")
    order: list = []

    class Pending:
        calls: list = []

        def flush(self):
            order.append(("flush", list(self.calls)))
            self.calls.clear()

    class Adapter:
        pending = Pending()

        def get_computed_blocks(self, request, max_cache_hit_length=None):
            order.append(("lookup", request, max_cache_hit_length))
            return "blocks", 32, 0

    adapter = Adapter()
    bench.apply_running_growth_first(adapter)
    adapter.pending.calls.extend(["r1", "r2"])
    assert adapter.get_computed_blocks("a") == ("blocks", 32, 0)
    assert adapter.get_computed_blocks("b", 16) == ("blocks", 32, 0)
    assert order == [("flush", ["r1", "r2"]), ("lookup", "a", None), ("lookup", "b", 16)]


def test_admission_sums_its_calls_up_to_the_allocation_that_admits():
    """A request's lookups and allocations are summed until an allocation
    returns blocks; a failed allocation (None) leaves it open, and calls
    after its admission are not its admission's."""
    bench = load_benchmark("bench_mooncake")

    def call(rid, name, returned, n):
        return {"key": rid, "call": name, "returned": returned, "launches": n, "replayed": 1, "reads": 1,
                "host_ms": 0.5 * n, "launch_list": [f"{rid}{n}"], "counts": dict.fromkeys(bench.COUNTED, n)}

    calls = [call("a", "get_computed_blocks", True, 1), call("a", "allocate_slots", False, 2),
             call("b", "get_computed_blocks", True, 3), call("a", "get_computed_blocks", True, 4),
             call("a", "allocate_slots", True, 5), call("b", "allocate_slots", True, 6),
             call("a", "allocate_slots", True, 7), call("c", "get_computed_blocks", True, 8)]
    got = bench.admissions_of(calls)
    assert list(got) == ["a", "b"]  # (c never admitted)
    assert got["a"] == {"launches": 12, "replayed": 4, "reads": 4, "host_ms": 6.0,
                        "launch_list": ["a1", "a2", "a4", "a5"], "counts": dict.fromkeys(bench.COUNTED, 12)}
    assert got["b"] == {"launches": 9, "replayed": 2, "reads": 2, "host_ms": 4.5, "launch_list": ["b3", "b6"],
                        "counts": dict.fromkeys(bench.COUNTED, 9)}
    # (calls tagged with their engine step: an admission keeps the step of the allocation that admitted it)
    tagged = bench.admissions_of([dict(c, step=i // 3) for i, c in enumerate(calls)])
    assert {rid: a["step"] for rid, a in tagged.items()} == {"a": 1, "b": 1}
    assert [dict(a, step=None) for a in tagged.values()] == [dict(a, step=None) for a in got.values()]
