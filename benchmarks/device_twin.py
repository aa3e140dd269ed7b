"""The device scheduler's *honest twin*: what one engine step of gpukv's
``DeviceScheduler`` costs the host on a GPU, measured on a machine without
CUDA. ``bench_scheduler.py`` (synthetic workloads) and
``bench_mooncake.py --device`` (the Mooncake trace) drive it; their
docstrings say what a step is. The method:

1. The host's own work: a second scheduler (the *twin*) gets the same
   requests and runs each step after the real one, with the kernel bodies
   skipped (``gpukv.kernels.capture.kernel_bodies_skipped``: each launch
   still goes through the launch hooks) and its device reads (``_read``)
   answered from the real one's record. The host learns the device's state
   only through those reads, so the twin does the real step's host work;
   every step is checked to emit the same ``SchedulerOutput``, launch as
   many kernels, and consume every recorded read. Its time is thread CPU
   time less the interpreter's own launch path (``kernel_seconds``), with
   torch on one thread (a long prompt's upload split across torch's threads
   would count their spinning on a loaded machine, where a GPU makes one
   pinned copy). The twin's uploads run the pinned path's Python
   (``pinned_stand_in``): the copy into the staging buffer and its tensor
   views, which the CPU path skips. The real run's set-up and warm-up steps
   are replayed by the twin untimed first, so its first-time allocations
   are not timed (``device_summary`` gives the first timed step beside the
   p50 of the rest, to check it).
2. Triton's launch path for every launch of the step, measured: the real
   step's launches are recorded (``launch_cost.capturing``) and replayed in
   a child process through Triton's real launcher against a stub CUDA
   driver (``benchmarks/launch_cost.py``).
3. What a GPU adds to each other operation, counted in the real step and
   charged at a stated cost (``GpuCosts``, microseconds, each beyond what the
   twin already ran on the CPU; ``--gpu-costs`` changes them): a torch
   operation's kernel launch (5: the CUDA runtime's launch and the
   backend's set-up over the CPU dispatch the twin ran; published
   breakdowns put a small CUDA op's whole CPU path at 5-25 us), an upload
   (4: ``cudaMemcpyAsync`` from pinned memory), a CUDA event recorded (2)
   or waited on (1: already complete two steps later), a device read (15: a
   synchronising copy of a few hundred bytes, the wait for the GPU's queued
   work not counted) and a stream query (0.5: ``torch.cuda.current_stream``
   in each call's stream ordering).

The honest figure is 1 + 2 + 3. ``DeviceTwin.attribute`` splits it by call
(``bench_mooncake.py``'s per admission: one request's lookup and
allocation): each attributed call's own launches (their launch path timed
as a step's), counted operations and reads in the real run, and its own
host time in the twin's.

What it leans on in gpukv: the manager's
``_read`` (every device read goes through it), ``_enter_stream`` (one per
call), and its ``_staging`` (``upload``, ``upload_host``, ``begin_step``,
``end_step``, ``_host_view``, ``_alloc``, ``_pinned``); a change there is a
change here.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gpukv.kernels import capture


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q))


@dataclass(frozen=True)
class GpuCosts:
    """What a GPU adds to each operation a step makes, in microseconds of
    host time beyond what the twin ran on CPU tensors (module docstring, 3)."""

    torch_op: float = 5.0
    upload: float = 4.0
    event_record: float = 2.0
    event_wait: float = 1.0
    read: float = 15.0
    stream_query: float = 0.5

    @classmethod
    def parse(cls, text: str | None) -> GpuCosts:
        """``name=us,name=us`` (the field names) over the defaults."""
        if not text:
            return cls()
        values = {}
        for item in text.split(","):
            name, _, us = item.partition("=")
            if name.strip() not in cls.__dataclass_fields__:
                raise SystemExit(f"--gpu-costs: unknown operation {name!r}; use {', '.join(cls.__dataclass_fields__)}")
            values[name.strip()] = float(us)
        return cls(**values)

    def us(self, counts: dict) -> float:
        """The stated cost of a step's counted operations."""
        return sum(getattr(self, k) * counts.get(k, 0) for k in self.__dataclass_fields__)

    def label(self, name: str) -> str:
        """``name``'s stated cost as a table header shows it beside its count."""
        return f"{getattr(self, name):g} us"


#: The operations counted per step besides launches (``GpuCosts``' fields).
COUNTED = tuple(GpuCosts.__dataclass_fields__)


class _ThreadClock:
    """Stands in for the ``time`` module of ``gpukv.kernels.capture`` while the
    timing twin runs: its ``kernel_seconds()`` then counts thread CPU time."""

    perf_counter = staticmethod(time.thread_time)


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch on one thread inside (as a GPU's one pinned copy), restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def pinned_stand_in(staging: Any) -> None:
    """Make a CPU ``gpukv.device.staging.Staging`` run its pinned (CUDA) upload
    path: each upload copied into the step's staging buffer through its
    tensor views, then copied out, as on a GPU. Its buffers are pageable
    (pinning needs CUDA) and no CUDA event is recorded at a step's end (its
    cost is stated: ``GpuCosts.event_record``); the copy out is a real
    memcpy on the CPU where a GPU's is a DMA (so the twin pays a little
    more here than a GPU host would, never less)."""
    staging._alloc = lambda nbytes: torch.empty(nbytes, dtype=torch.uint8)
    staging._pinned = True
    end_step = staging.end_step

    def end_step_without_event() -> None:
        staging._pinned = False
        try:
            end_step()
        finally:
            staging._pinned = True

    staging.end_step = end_step_without_event


class _Counting:
    """Counts, while ``on`` and only for ``manager``, what a GPU step pays
    for besides launches: torch operations (``gpukv.device.staging.TorchOpCounter``
    around the step), uploads, the staging's CUDA events, device reads and
    stream queries (each call's ``_enter_stream``), by wrapping the methods
    that make them. Installed once per real scheduler."""

    def __init__(self, manager: Any) -> None:
        self.manager, self.on, self.counts = manager, False, dict.fromkeys(COUNTED, 0)
        staging = manager._staging
        self._wrap(staging, "upload", "upload")
        self._wrap(staging, "upload_host", "upload")
        self._wrap(staging, "begin_step", "event_wait")
        self._wrap(staging, "end_step", "event_record")
        self._wrap(manager, "_enter_stream", "stream_query")

    def _wrap(self, obj: Any, name: str, what: str) -> None:
        real = getattr(obj, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            if self.on:
                self.counts[what] += 1
            return real(*args, **kwargs)

        setattr(obj, name, counted)

    def start(self) -> None:
        from gpukv.core.metrics import StepCounters
        from gpukv.device.staging import TorchOpCounter

        self.counts = dict.fromkeys(COUNTED, 0)
        self._ops = StepCounters()
        self._torch = TorchOpCounter(self._ops)
        self._torch.__enter__()
        self.on = True

    def now(self, reads: int) -> dict:
        """The counts so far in the step under way (``reads``: its reads so far)."""
        return dict(self.counts, torch_op=self._ops.torch_ops, read=reads)

    def stop(self, reads: int) -> dict:
        self.on = False
        self._torch.__exit__(None, None, None)
        return self.now(reads)


def launch_cost():
    """``benchmarks/launch_cost.py`` (the launch path's measurement)."""
    import launch_cost as module

    return module


def _groups(ids) -> tuple | None:
    """Block ids per KV-cache group as tuples (None: no new blocks)."""
    return None if ids is None else tuple(tuple(group) for group in ids)


def digest(out) -> tuple:
    """What a SchedulerOutput decides (the timing twin must decide the same):
    tokens scheduled per request, new requests' blocks, running requests' new
    blocks (and, under 0.33, their computed and output tokens), resumed,
    finished and preempted requests, the common prefix."""
    cached = out.scheduled_cached_reqs
    if isinstance(cached, list):  # vLLM 0.8.x: one CachedRequestData per request, one group
        return (tuple(out.num_scheduled_tokens.items()),
                tuple((r.req_id, tuple(r.block_ids)) for r in out.scheduled_new_reqs),
                tuple((c.req_id, tuple(c.new_block_ids), c.resumed_from_preemption) for c in cached),
                tuple(sorted(out.finished_req_ids)), out.num_common_prefix_blocks)
    # vLLM 0.33: one CachedRequestData of lists, block ids per group
    return (tuple(out.num_scheduled_tokens.items()),
            tuple((r.req_id, _groups(r.block_ids), r.num_computed_tokens) for r in out.scheduled_new_reqs),
            tuple(zip(cached.req_ids, map(_groups, cached.new_block_ids), cached.num_computed_tokens,
                      cached.num_output_tokens, strict=True)),
            tuple(sorted(getattr(cached, "resumed_req_ids", ()))), tuple(sorted(out.finished_req_ids)),
            tuple(sorted(out.preempted_req_ids or ())), tuple(getattr(out, "num_common_prefix_blocks", ())))


#: A run's step: ``step(run, clock)`` -> (the step's ms by ``clock``, its SchedulerOutput).
Step = Callable[[Any, Callable[[], float]], tuple[float, Any]]


class DeviceTwin:
    """A device scheduler's run (``real``) and, without CUDA, its timing twin
    (``twin``: a second run of the same class on the same requests), hooked
    up as the module docstring says. ``step`` runs one engine step of either;
    ``digest`` reduces a SchedulerOutput to what it decides. ``real_step``
    runs the real one and returns its row; ``twin_steps`` then times the
    twin through the same steps, back to back."""

    def __init__(self, real: Any, twin: Any | None, step: Step, digest: Callable[[Any], Any]) -> None:
        self.real, self.twin, self.step, self.digest = real, twin, step, digest
        m = real.sched.kv_cache_manager.manager
        self.cuda = m.device.type == "cuda"
        self.reads: list = []
        self.num_reads = 0
        self.counting = _Counting(m)
        real_read = m._read

        def recording(t, _read=real_read):
            out = _read(t)
            self.num_reads += 1
            if self.twin is not None:
                self.reads.append(out)
            return out

        m._read = recording
        if twin is not None:
            self.set_twin(twin)
        self.calls: list[dict] = []  # the attributed calls of the real step under way
        self.twin_calls: list[tuple] = []  # and of the twin's: (key, method, returned, host ms)
        self.recorded: list = []  # the real step's recorded launches
        self.inside = False  # in an attributed call (calls inside it are its own)

    def set_twin(self, twin: Any) -> None:
        """``twin`` (a fresh run of the real one's class on the same requests)
        hooked up as the timing twin: its reads answered from the record, its
        uploads through the pinned path's Python. A second twin can then go
        through the steps the first went through (``twin_steps`` on copies of
        their rows made before: ``replay_copy``)."""
        self.twin = twin
        tm = twin.sched.kv_cache_manager.manager
        pinned_stand_in(tm._staging)

        def replaying(_t):  # stands in for _read(t): the answer comes from the record
            tm.counters.d2h += 1
            if not self.reads:
                raise SystemExit("the timing twin read more than the real scheduler")
            return self.reads.pop(0)

        tm._read = replaying

    def attribute(self, name: str, owner: Callable[[Any], Any], key: Callable[..., Any]) -> None:
        """Split each step by call: the method ``name`` of ``owner(run)`` (the
        real run's and the twin's) is wrapped so that each call for which
        ``key(*args, **kwargs)``, asked before the call, is not None leaves a
        record in its step's row's ``calls``, in order: ``key``, ``call``
        (``name``), ``returned`` (whether it returned something other than
        None), and the call's own ``launches``, ``replayed``, ``launch_list``
        (recorded when the step is ``measured``), ``counts`` and ``reads``;
        the twin's run of the step adds each call's ``host_ms`` (its thread
        time less the skipped launches', as the step's), after checking that
        it made the same calls in the same order. A call inside an attributed
        call is its own."""
        real = getattr(owner(self.real), name)

        def real_call(*args: Any, **kwargs: Any) -> Any:
            k = None if self.inside else key(*args, **kwargs)
            if k is None:
                return real(*args, **kwargs)
            l0, n0, c0, r0 = capture.launches(), len(self.recorded), self.counting.now(0), self.num_reads
            self.inside = True
            try:
                out = real(*args, **kwargs)
            finally:
                self.inside = False
            mine = self.recorded[n0:]
            counts = self.counting.now(self.num_reads - r0)
            self.calls.append({"key": k, "call": name, "returned": out is not None,
                               "launches": capture.launches() - l0, "replayed": sum(ln.replayed for ln in mine),
                               "launch_list": mine, "reads": self.num_reads - r0,
                               "counts": {c: counts[c] - c0.get(c, 0) for c in COUNTED}})
            return out

        setattr(owner(self.real), name, real_call)
        if self.twin is not None:
            setattr(owner(self.twin), name, self._twin_call(name, getattr(owner(self.twin), name), key))

    def _twin_call(self, name: str, twin: Callable[..., Any], key: Callable[..., Any]) -> Callable[..., Any]:
        """``attribute``'s wrapper on the twin's method ``twin``: its host time per call."""
        def twin_call(*args: Any, **kwargs: Any) -> Any:
            k = None if self.inside else key(*args, **kwargs)
            if k is None:
                return twin(*args, **kwargs)
            clock = lambda: time.thread_time() - capture.kernel_seconds()  # noqa: E731  (as _twin_step's)
            self.inside = True
            t0 = clock()
            try:
                out = twin(*args, **kwargs)
            finally:
                self.inside = False
            self.twin_calls.append((k, name, out is not None, (clock() - t0) * 1e3))
            return out

        return twin_call

    def real_step(self, measured: bool) -> dict:
        """One step of the real scheduler: launches (and, when ``measured``
        on the interpreter, the launches themselves, to time their launch
        path), the counted operations, its reads (for the twin), and on CUDA
        the wall time and the GPU time of the step."""
        self.num_reads, self.reads, self.calls = 0, [], []
        if self.cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        l0 = capture.launches()
        self.counting.start()
        recorder = launch_cost().capturing() if measured and not self.cuda else contextlib.nullcontext([])
        with one_thread(), recorder as recorded:
            self.recorded = recorded
            ms, out = self.step(self.real, time.perf_counter if self.cuda else time.thread_time)
        self.recorded = []
        counts = self.counting.stop(self.num_reads)
        row = {"launches": capture.launches() - l0, "reads": self.num_reads, "counts": counts,
               "replayed": sum(ln.replayed for ln in recorded), "launch_list": list(recorded),
               "digest": self.digest(out), "recorded_reads": self.reads, "calls": self.calls}
        if self.cuda:
            end.record()
            end.synchronize()
            row.update(wall_ms=ms, gpu_ms=start.elapsed_time(end))
        return row

    def twin_steps(self, rows: list[dict], before: Callable[[int], None] = lambda _i: None) -> None:
        """The twin through every step ``rows`` recorded, in order, back to
        back (interleaved with the interpreter's kernels its caches would be
        cold), torch on one thread; each row gets its ``host_ms``.
        ``before(i)`` runs ahead of step i, untimed."""
        with one_thread():
            for i, row in enumerate(rows):
                before(i)
                self._twin_step(row)

    def _twin_step(self, row: dict) -> None:
        """The twin's run of the step ``row`` recorded: its host time with the
        kernels out (the thread's CPU time less what the interpreter spends in
        the skipped launches; while the twin runs, ``kernel_seconds()`` reads
        the thread's CPU clock too, not the wall clock, which on a shared
        machine includes other processes' time)."""
        assert self.twin is not None
        self.reads, self.twin_calls = list(row.pop("recorded_reads")), []
        clock = lambda: time.thread_time() - capture.kernel_seconds()  # noqa: E731
        wall_clock = capture.time
        capture.time = _ThreadClock
        try:
            with capture.kernel_bodies_skipped():
                l0 = capture.launches()
                ms, twin_out = self.step(self.twin, clock)
                twin_launches = capture.launches() - l0
        finally:
            capture.time = wall_clock
        digest = self.digest(twin_out)
        if digest != row["digest"] or twin_launches != row["launches"] or self.reads:
            raise SystemExit(f"the timing twin diverged: launches {twin_launches} vs {row['launches']}, "
                             f"{len(self.reads)} reads left, same output: {digest == row['digest']}")
        made = [(c["key"], c["call"], c["returned"]) for c in row["calls"]]
        if [call[:3] for call in self.twin_calls] != made:
            raise SystemExit(f"the timing twin's attributed calls diverged: {len(self.twin_calls)} vs {len(made)}")
        for call, (*_, call_ms) in zip(row["calls"], self.twin_calls, strict=True):
            call["host_ms"] = call_ms
        row["host_ms"] = ms


def replay_copy(row: dict) -> dict:
    """What ``twin_steps`` needs of a real step's ``row`` for another twin,
    copied (a twin's run consumes the row's recorded reads)."""
    return {"recorded_reads": copy.deepcopy(row["recorded_reads"]), "digest": row["digest"],
            "launches": row["launches"], "calls": [dict(c) for c in row["calls"]]}


def add_launch_path(rows_by_key: dict[str, list[dict]], costs: GpuCosts, samples: int) -> str | None:
    """Each interpreter row's honest figure (module docstring): the twin's
    host time, the launch path of its recorded launches (timed in a child
    process, ``launch_cost.measure``) and the counted operations at
    ``costs``. Returns why the launch path could not be measured, or None."""
    jobs = {key: [r["launch_list"] for r in rows] for key, rows in rows_by_key.items() if rows}
    why = None
    try:
        timed = launch_cost().measure(jobs, samples=samples)["jobs"] if jobs else {}
    except (launch_cost().Unavailable, RuntimeError) as e:
        timed, why = {}, str(e).splitlines()[0]
    for key, rows in rows_by_key.items():
        for i, r in enumerate(rows):
            launch_us = float(np.median(timed[key]["step_us"][i])) if key in timed else 0.0
            r["launch_path_ms"] = launch_us / 1e3 if key in timed else None
            r["stated_ms"] = costs.us(r["counts"]) / 1e3
            r["honest_ms"] = r["host_ms"] + r["stated_ms"] + launch_us / 1e3 if key in timed else None
            del r["launch_list"]
    return why


def device_summary(rows: list[dict]) -> dict:
    """Counts (mean, min, max) and times (p50, p99, min, max) over the
    measured steps ``rows``; ``first_host_ms``: the first timed step's twin
    host time beside the p50 of the others (a first step far above them
    would be a first-time cost timed)."""
    out: dict[str, Any] = {"steps": len(rows)}
    for key in ("launches", "replayed", "reads"):
        xs = [r[key] for r in rows]
        out[key] = {"mean": float(np.mean(xs)), "min": min(xs), "max": max(xs)}
    out["counts"] = {k: {"mean": float(np.mean([r["counts"][k] for r in rows])),
                         "min": min(r["counts"][k] for r in rows), "max": max(r["counts"][k] for r in rows)}
                     for k in COUNTED}
    for key in ("host_ms", "launch_path_ms", "stated_ms", "honest_ms", "wall_ms", "gpu_ms"):
        xs = [r[key] for r in rows if r.get(key) is not None]
        if xs:
            out[key] = {"p50": pct(xs, 50), "p99": pct(xs, 99), "max": max(xs), "min": min(xs)}
    if len(rows) > 1 and "host_ms" in rows[0]:
        out["first_host_ms"] = {"first": rows[0]["host_ms"], "p50_others": pct([r["host_ms"] for r in rows[1:]], 50)}
    return out


def twin_head(costs: GpuCosts) -> str:
    """The honest twin's columns (``twin_cells``): each counted operation
    with its stated cost beside it."""
    c = costs.label
    return (f"launches/step | torch ops (x {c('torch_op')}) | uploads (x {c('upload')}) | events recorded "
            f"(x {c('event_record')}), waited (x {c('event_wait')}) | reads (x {c('read')}) | stream queries "
            f"(x {c('stream_query')}) | twin host ms | launch path ms | stated ms | honest p50 ms [min-max]")


def count_cell(d: dict, key: str) -> str:
    """A count's mean, and its range where it varies (a count shared out by
    several admissions, ``share_admitting_steps``, is a fraction: one decimal)."""
    c = d[key]
    low, high = (f"{x:.1f}" if isinstance(x, float) and not x.is_integer() else f"{int(x)}"
                 for x in (c["min"], c["max"]))
    return f"{c['mean']:.1f}" + (f" ({low}-{high})" if c["min"] != c["max"] else "")


def twin_cells(d: dict) -> list[str]:
    """A ``device_summary``'s cells under ``twin_head``."""
    c, honest = d["counts"], d.get("honest_ms")
    return [f"{count_cell(d, 'launches')}, {d['replayed']['mean']:.1f} replayed", count_cell(c, "torch_op"),
            count_cell(c, "upload"), f"{c['event_record']['mean']:.1f}, {c['event_wait']['mean']:.1f}",
            count_cell(c, "read"), count_cell(c, "stream_query"), f"{d['host_ms']['p50']:.3f}",
            f"{d['launch_path_ms']['p50']:.3f}" if "launch_path_ms" in d else "-", f"{d['stated_ms']['p50']:.3f}",
            f"{honest['p50']:.3f} [{honest['min']:.3f}-{honest['max']:.3f}]" if honest else "-"]
