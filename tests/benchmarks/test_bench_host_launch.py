"""The launch-cost half of ``benchmarks/bench_host.py``'s twin
(``benchmarks/launch_cost.py``): the launches a decode step makes are
recorded under the interpreter and each goes through Triton's real launch
path, up to the (stub) driver call, in a child process. Behaviour only, no
timing thresholds."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from gpukv import _runtime
from gpukv.core.requests import NewRequest
from gpukv.device.manager import DeviceManager

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, "benchmarks"))
launch_cost = pytest.importorskip("launch_cost", reason="benchmarks/launch_cost.py not importable")

pytestmark = pytest.mark.skipif(not _runtime.INTERPRETED, reason="records launches under Triton's interpreter")


def _decode_launches(monkeypatch) -> tuple[list, int, list]:
    from gpukv.kernels import capture
    monkeypatch.setattr(capture, "host_launch", capture.host_launch)  # restored after the test
    try:
        launch_cost.install()
    except AttributeError as e:  # pragma: no cover (a gpukv without host_launch)
        pytest.skip(f"gpukv internals launch_cost needs are missing: {e}")
    m = DeviceManager(64, 4, hash_key=bytes(16), max_model_len=64, max_num_reqs=8)
    # Four rows of 5 to 8 tokens in blocks of 4: every step some row needs a block and some fills one.
    rows = m.step(new=[NewRequest(f"r{i}", list(range(i, i + 5 + i))) for i in range(4)]).rows
    m.decode(rows, torch.zeros(4, dtype=torch.int64))  # the first step of every phase prepares its launches
    try:
        with launch_cost.capturing() as rec:
            m.decode(rows, torch.ones(4, dtype=torch.int64))  # a replayed step
        launches = m.counters.launches
        with launch_cost.capturing() as freed:
            m.free("r0")  # a free: its release is launched anew every time (no fixed buffers to replay)
    except launch_cost.Unavailable as e:  # this Triton lacks the interpreter internals recording reads
        pytest.skip(f"launches cannot be recorded with this Triton: {e}")
    return list(rec), launches, list(freed)


def test_each_launch_of_a_decode_step_is_recorded_and_timed_through_the_launch_path(monkeypatch):
    rec, launches, freed = _decode_launches(monkeypatch)
    assert len(rec) == launches > 0
    assert all(ln.replayed for ln in rec)  # the decode's launches were kept and replayed
    assert freed and not any(ln.replayed for ln in freed)
    kernels = [ln.kernel for ln in rec]
    assert "decode._decode_fit_kernel" in kernels
    assert "block_hash._hash_rows_kernel" in kernels  # the interpreter's host stand-in, as the GPU launches it
    assert all(ln.grid and min(ln.grid) >= 1 for ln in rec)
    assert any(isinstance(a, launch_cost.TensorSpec) for ln in rec for a in ln.args)
    try:
        out = launch_cost.measure({"decode": [rec], "free": [freed]}, samples=3, per_kernel_reps=10, timeout=600)
    except launch_cost.Unavailable as e:
        pytest.skip(f"the launch path cannot be measured here: {e}")
    job = out["jobs"]["decode"]
    assert job["launches"] == [launches] and job["not_replayed"] == [0]
    # a launch the manager does not replay is timed through JITFunction.run, as a GPU runs it
    assert out["jobs"]["free"]["launches"] == out["jobs"]["free"]["not_replayed"] == [len(freed)]
    assert len(job["step_us"]) == 1 and len(job["step_us"][0]) == 3
    assert all(t > 0 for t in job["step_us"][0])
    # every timed launch went through Triton's launcher to the driver call
    assert out["reached_driver"] == out["timed_launches"] == (launches + len(freed)) * (1 + 3)
    # timed as the manager replays a prepared launch on a GPU (``capture.compiled_launch``), which hands
    # the compiled kernel's launcher exactly what ``JITFunction.run`` hands it, launch by launch
    assert out["path"] == "compiled" and out["same_launcher_args"] is True
    assert set(out["per_kernel_us"]) == set(kernels) | {f"{ln.kernel} (not replayed: JITFunction.run)" for ln in freed}
    assert all(v > 0 for v in out["per_kernel_us"].values())
