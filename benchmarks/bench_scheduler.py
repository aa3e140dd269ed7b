"""Cost of a scheduling step under vLLM 0.8.5's v1 ``Scheduler``: vLLM's own
block manager against gpukv's (issue 17).

One engine step is ``schedule()`` followed by ``update_from_output()`` (the
model runner's answer in between is built untimed, by
``tests/test_vllm/harness.py``'s ``model_output``). The scheduling loop is
vLLM's own in every case (``gpukv.vllm`` subclasses vLLM's ``Scheduler`` and
replaces only its ``kv_cache_manager``), so a difference is the manager's:

* ``vLLM``: vLLM 0.8.5's ``Scheduler`` on its own ``KVCacheManager``;
* ``reference``: ``gpukv.vllm.ReferenceScheduler`` (gpukv's host reference
  manager, the backend on machines without CUDA);
* ``device``: ``gpukv.vllm.DeviceScheduler`` (gpukv's device manager).

Workloads (block size 16, one full-attention group, prefix caching on, the
pool sized so that nothing is evicted during a run, the token budget and
``max_num_seqs`` so that every request is scheduled every step):

* ``decode-heavy N``: N requests decode one token each per step; each step
  the ``max(1, N // 64)`` oldest finish (they sample the EOS token) and as
  many new requests arrive and are prefilled. Prompts are 100 to 115 tokens
  in turn, so about N / 16 decodes a step fill a block and get a new one;
* ``admission-heavy N``: N requests decode while each step admits 16 new
  requests of 256 tokens sharing one 128-token prefix (a system prompt); each
  finishes after its first token, so the next step admits 16 more.

Each (workload, N) is first set up (the N requests admitted and decoding),
then run for warm-up steps and timed steps; the vLLM and reference schedulers
alternate per repeat in one process (vLLM first in even repeats), on fresh
schedulers with the same requests and sampled tokens. A step's time is the
thread's CPU time (what it costs the host, free of other processes' time on
a shared machine: the scheduler and both host managers never wait). p50 and
p99 are over every timed step of every repeat; the ratio is reference /
vLLM at p50, with the range of the per-repeat p50 ratios beside it.

The device manager on a machine without CUDA runs its Triton kernels under
the interpreter (on the host, about a second of CPU per admitted request),
so its wall time is not its host cost. Its columns give, at ``--device-n``
requests only (both workloads one after the other on one scheduler, so the
set-up is paid once): Triton launches and device-to-host reads per step
(each read is a host wait on a GPU), and its host time with the kernels
taken out by ``benchmarks/bench_host.py``'s timing twin: a second
``DeviceScheduler`` gets the same requests and runs each step right after
the real one, with the kernel bodies skipped (``gpukv.kernels._common.
kernel_bodies_skipped``: each launch still goes through Triton's launch path
and its hooks) and its device reads (``_read``) answered from the real one's
record. The host learns the device's state only through those reads, so the
twin does the real step's host work; every step the benchmark checks that
both emit the same ``SchedulerOutput``, launch as many kernels, and that
the twin consumed every recorded read. Its time is thread CPU time less the
interpreter's own launch path (``kernel_seconds``, counted in thread time
too while the twin runs). A real GPU launch also costs host time in
Triton's launcher, which that figure leaves out (the launch count says how
many).

With CUDA (``torch.cuda.is_available()``) the device scheduler runs with real
kernels at every N, after the other two in each repeat, and its columns give
its wall time per step (host time, its waits on the GPU included) and the
step's span on the GPU's stream (CUDA events recorded around the step).

    PYTHONPATH=. /work/vllm085/venv/bin/python benchmarks/bench_scheduler.py [--quick] [--json PATH]

(vLLM 0.8.5 must be importable: ``pip install 'gpukv[vllm]'``, or a venv from
``../shared/tools/vllm085/setup.sh DIR``.)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # (vLLM logs each config it builds at INFO)

import gpukv  # noqa: E402
import gpukv._runtime  # noqa: E402,F401  (before vLLM imports Triton: the interpreter without CUDA)
from gpukv.kernels import _common  # noqa: E402

BS = 16
VOCAB = 32000
PROMPT_LEN = 100  # decoding requests' prompts: 100 to 115 tokens, so 1/16 of them fill a block each step
ADMIT_LEN, SHARED_LEN = 256, 128
MAX_MODEL_LEN = 2048


def _harness():
    """``tests/test_vllm/harness.py``, or None with the reason printed (it
    skips itself, pytest-style, where vLLM 0.8.5 is not importable)."""
    try:
        import pytest
    except ImportError as exc:
        print(f"note: pytest is needed for tests/test_vllm/harness.py ({exc})", file=sys.stderr)
        return None
    try:
        from tests.test_vllm import harness
    except pytest.skip.Exception as exc:
        print(f"note: {exc}", file=sys.stderr)
        return None
    return harness


# ------------------------------------------------------------------ workloads
@dataclass(frozen=True)
class Workload:
    kind: str  # "decode-heavy" or "admission-heavy"
    n: int  # requests decoding
    admit: int = 16  # admission-heavy: new requests a step

    @property
    def replace(self) -> int:
        """decode-heavy: requests finishing (and arriving) a step."""
        return max(1, self.n // 64) if self.kind == "decode-heavy" else 0

    def config(self, steps: int) -> dict:
        """make_scheduler's options: every request fits in one step's token
        budget and in max_num_seqs, and the pool holds every block a run of
        ``steps`` steps allocates (nothing is evicted)."""
        per_step = self.replace * (PROMPT_LEN + BS) + self.admit * ADMIT_LEN * (self.kind == "admission-heavy")
        budget = max(8192, 2 * (self.n + per_step))
        steps += -(-self.n * (PROMPT_LEN + BS) // budget)  # the set-up's steps
        blocks = self.n * (-(-(PROMPT_LEN + BS + steps) // BS))
        blocks += steps * (self.replace * (-(-(PROMPT_LEN + BS + steps) // BS))
                           + (self.admit * (-(-(ADMIT_LEN + 1) // BS)) if self.kind == "admission-heavy" else 0))
        return dict(max_num_seqs=self.n + max(self.replace, self.admit) + 8, max_num_batched_tokens=budget,
                    max_model_len=MAX_MODEL_LEN, enable_prefix_caching=True, num_blocks=blocks + 64,
                    block_size=BS)


class Run:
    """One scheduler (``cls``) on one workload: ``setup()`` admits the N
    decoding requests, ``step()`` runs one engine step with the workload's
    arrivals and finishes. Two runs of the same workload see the same requests
    and sampled tokens whenever they schedule alike."""

    def __init__(self, h, cls: type, work: Workload, steps: int, config: dict | None = None) -> None:
        self.h, self.work = h, work  # (work may change between steps: its kind sets the arrivals)
        self.sched = h.make_scheduler(cls, **(config or work.config(steps)))
        self.rng = random.Random(f"{work.kind}/{work.n}")
        self.prefix = [self.rng.randrange(VOCAB) for _ in range(SHARED_LEN)]
        self.next_id = 0
        self.live: deque[str] = deque()  # decoding requests, oldest first
        self.finish: set[str] = set()  # sample EOS this step
        self.ready = False
        self._add(work.n, self._decoder_prompt, MAX_MODEL_LEN, live=True)

    def _add(self, count: int, prompt, max_tokens: int, live: bool) -> None:
        reqs = self.h.make_requests(count, prompt=lambda _i: prompt(), first_id=self.next_id, max_tokens=max_tokens)
        self.next_id += count
        for r in reqs:
            self.sched.add_request(r)
            if live:
                self.live.append(r.request_id)

    def _decoder_prompt(self) -> list[int]:
        """A decoding request's prompt: 100 to 115 tokens, in turn (so that
        decodes fill blocks at an even rate, not all in one step)."""
        self.num_decoders = getattr(self, "num_decoders", 0) + 1
        return [self.rng.randrange(VOCAB) for _ in range(PROMPT_LEN + self.num_decoders % BS)]

    def _sample(self, request) -> int:
        rid = request.request_id
        if rid in self.finish:
            return self.h.EOS_TOKEN_ID
        return (int(rid) * 1_000_003 + request.num_tokens * 7919) % VOCAB

    def _arrivals(self) -> None:
        w = self.work
        if w.kind == "decode-heavy":
            self.finish = {self.live.popleft() for _ in range(w.replace)}
            self._add(w.replace, self._decoder_prompt, MAX_MODEL_LEN, live=True)
        else:
            self._add(w.admit, lambda: self.prefix + [self.rng.randrange(VOCAB) for _ in range(ADMIT_LEN - SHARED_LEN)],
                      1, live=False)

    def step(self, clock=None) -> tuple[float, float, Any]:
        """One engine step: (schedule ms, update_from_output ms, the
        SchedulerOutput). ``clock``: a function returning seconds, by default
        the thread's CPU time (``CLOCK_THREAD_CPUTIME_ID``: what the step costs
        the host, free of the time other processes take on a shared machine;
        the scheduler and both host managers never wait)."""
        clock = clock or time.thread_time
        if self.ready:
            self._arrivals()
        s = self.sched
        t0 = clock()
        out = s.schedule()
        t1 = clock()
        answer = self.h.model_output(s, out, self._sample)
        t2 = clock()
        s.update_from_output(out, answer)
        t3 = clock()
        if any(c.resumed_from_preemption for c in out.scheduled_cached_reqs):
            raise SystemExit(f"{self.work.kind} {self.work.n}: a request was preempted (the pool is too small)")
        if self.ready:
            missed = self.finish & {r.request_id for r in s.running}
            if missed:
                raise SystemExit(f"{self.work.kind} {self.work.n}: requests {sorted(missed)} did not finish")
        elif not s.waiting and len(s.running) == self.work.n and all(r.num_output_tokens for r in s.running):
            self.ready = True
        return (t1 - t0) * 1e3, (t3 - t2) * 1e3, out

    def setup(self, max_steps: int = 1000) -> None:
        for _ in range(max_steps):
            if self.ready:
                return
            self.step()
        raise SystemExit(f"{self.work.kind} {self.work.n}: not all requests decoding after {max_steps} steps")


def _digest(out) -> tuple:
    """What a SchedulerOutput decides (the timing twin must decide the same)."""
    return (tuple(out.num_scheduled_tokens.items()),
            tuple((r.req_id, tuple(r.block_ids)) for r in out.scheduled_new_reqs),
            tuple((c.req_id, tuple(c.new_block_ids), c.resumed_from_preemption) for c in out.scheduled_cached_reqs),
            tuple(sorted(out.finished_req_ids)), out.num_common_prefix_blocks)


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q))


# ------------------------------------------------------------------ vLLM and the reference
def timed_run(h, cls: type, work: Workload, warmup: int, steps: int) -> list[float]:
    """ms per timed step (schedule + update_from_output) of a fresh run."""
    gc.collect()
    run = Run(h, cls, work, warmup + steps + 8)
    run.setup()
    times = []
    for i in range(warmup + steps):
        ts, tu, _ = run.step()
        if i >= warmup:
            times.append(ts + tu)
    manager = getattr(run.sched.kv_cache_manager, "manager", None)  # gpukv's (vLLM's counts no evictions)
    if manager is not None and manager.num_evictions:
        raise SystemExit(f"{work}: {manager.num_evictions} cached blocks evicted (the pool is too small)")
    return times


# ------------------------------------------------------------------ the device manager
class _ThreadClock:
    """Stands in for the ``time`` module of ``gpukv.kernels._common`` while the
    timing twin runs: its ``kernel_seconds()`` then counts thread CPU time."""

    perf_counter = staticmethod(time.thread_time)


class DeviceCounts:
    """Launches and device reads per step of a DeviceScheduler run; on the
    interpreter, its timing twin (module docstring). ``works``: the workloads
    (same N) run one after the other on the same scheduler, so that the set-up
    (admitting N requests: about a second each under the interpreter) is paid
    once."""

    def __init__(self, h, cls: type, works: list[Workload], steps: int) -> None:
        configs = [w.config(steps) for w in works]
        config = {k: max(c[k] for c in configs) for k in configs[0]}
        config["num_blocks"] = sum(c["num_blocks"] for c in configs)
        self.works = works
        self.real = Run(h, cls, works[0], steps, config)
        self.cuda = self.real.sched.kv_cache_manager.manager.device.type == "cuda"
        self.twin = None if self.cuda else Run(h, cls, works[0], steps, config)
        self.reads: list = []
        self.num_reads = 0
        m = self.real.sched.kv_cache_manager.manager
        real_read = m._read

        def recording(t, _read=real_read):
            out = _read(t)
            self.num_reads += 1
            if self.twin is not None:
                self.reads.append(out)
            return out

        m._read = recording
        if self.twin is not None:
            tm = self.twin.sched.kv_cache_manager.manager

            def replaying(_t):  # stands in for _read(t): the answer comes from the record
                tm.counters.d2h += 1
                if not self.reads:
                    raise SystemExit("the timing twin read more than the real scheduler")
                return self.reads.pop(0)

            tm._read = replaying

    def step(self) -> dict:
        """One step of the real scheduler (and then its twin): launches,
        reads, and ms: on CUDA the wall time and the GPU time of the step,
        on the interpreter the twin's host time with the kernels out."""
        self.num_reads, self.reads[:] = 0, []
        if self.cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        l0 = _common.launches()
        ts, tu, out = self.real.step(time.perf_counter if self.cuda else None)
        launches = _common.launches() - l0
        row = {"launches": launches, "reads": self.num_reads}
        if self.cuda:
            end.record()
            end.synchronize()
            row.update(wall_ms=ts + tu, gpu_ms=start.elapsed_time(end))
            return row
        # the twin: the thread's CPU time less what the interpreter spends in
        # the (skipped) launches; kernel_seconds() counts wall time, which on a
        # shared machine includes other processes' time, so while the twin runs
        # it reads the thread's CPU clock too
        clock = lambda: time.thread_time() - _common.kernel_seconds()  # noqa: E731
        wall_clock = _common.time
        _common.time = _ThreadClock
        try:
            with _common.kernel_bodies_skipped():
                l0 = _common.launches()
                ts, tu, twin_out = self.twin.step(clock)
                twin_launches = _common.launches() - l0
        finally:
            _common.time = wall_clock
        if _digest(twin_out) != _digest(out) or twin_launches != launches or self.reads:
            raise SystemExit(f"the timing twin diverged ({self.real.work}): launches {twin_launches} vs {launches}, "
                             f"{len(self.reads)} reads left, same output: {_digest(twin_out) == _digest(out)}")
        row["host_ms"] = ts + tu
        return row

    def run(self, warmup: int, steps: int, max_setup: int = 1000) -> dict[str, list[dict]]:
        """The set-up, then each workload in turn: ``warmup`` untimed steps and
        ``steps`` measured ones; the measured steps' rows by workload kind."""
        for _ in range(max_setup):
            if self.real.ready:
                break
            self.step()
        else:
            raise SystemExit(f"{self.real.work}: not all requests decoding after {max_setup} steps")
        if self.twin is not None and not self.twin.ready:
            raise SystemExit("the timing twin is not ready when the real scheduler is")
        out = {}
        for work in self.works:
            for run in (self.real, self.twin) if self.twin is not None else (self.real,):
                run.work = work
            out[work.kind] = [self.step() for _ in range(warmup + steps)][warmup:]
        return out


def _device_summary(rows: list[dict]) -> dict:
    out = {"steps": len(rows)}
    for key in ("launches", "reads"):
        xs = [r[key] for r in rows]
        out[key] = {"mean": float(np.mean(xs)), "min": min(xs), "max": max(xs)}
    for key in ("host_ms", "wall_ms", "gpu_ms"):
        xs = [r[key] for r in rows if key in r]
        if xs:
            out[key] = {"p50": pct(xs, 50), "p99": pct(xs, 99), "max": max(xs)}
    return out


# ------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    full = dict(n=[64, 256, 1024], admit=16, steps=30, warmup=3, repeats=3, device_n=64, device_steps=3,
                device_warmup=1)
    quick = dict(n=[2], admit=2, steps=3, warmup=1, repeats=2, device_n=2, device_steps=1, device_warmup=0)
    p.add_argument("--n", type=int, nargs="+", help=f"requests decoding (default {full['n']})")
    p.add_argument("--workloads", nargs="+", default=["decode-heavy", "admission-heavy"],
                   choices=["decode-heavy", "admission-heavy"])
    p.add_argument("--admit", type=int, help=f"admission-heavy: 256-token requests admitted a step ({full['admit']})")
    p.add_argument("--steps", type=int, help=f"timed steps per repeat ({full['steps']})")
    p.add_argument("--warmup", type=int, help=f"untimed steps per repeat, after the set-up ({full['warmup']})")
    p.add_argument("--repeats", type=int, help=f"repeats, vLLM and the reference alternating ({full['repeats']})")
    p.add_argument("--device-n", type=int,
                   help="without CUDA: the N at which the device scheduler's launches, reads and host time (timing "
                        "twin) are measured, 0 for none (its kernels run under Triton's interpreter: about a second "
                        f"per admitted request) ({full['device_n']})")
    p.add_argument("--device-steps", type=int,
                   help=f"without CUDA: the device scheduler's timed steps ({full['device_steps']})")
    p.add_argument("--device-warmup", type=int,
                   help=f"without CUDA: its untimed steps after the set-up ({full['device_warmup']})")
    p.add_argument("--quick", action="store_true",
                   help="smoke run (options given still apply): " + ", ".join(f"{k}={v}" for k, v in quick.items()))
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    h = _harness()
    if h is None:
        print("vLLM 0.8.5 is not importable: nothing measured", file=sys.stderr)
        return 1
    import vllm

    from gpukv.vllm import DeviceScheduler, ReferenceScheduler

    cuda = torch.cuda.is_available()
    where = (torch.cuda.get_device_name() if cuda
             else f"CPU ({platform.machine()}, {os.cpu_count()} cores), Triton interpreter")
    try:
        load = "load average {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())
    except OSError:
        load = "load average unknown"
    classes = {"vllm": h.VllmScheduler, "reference": ReferenceScheduler}
    device_cpu: dict[str, list[dict]] = {}
    if not cuda and args.device_n:  # (one scheduler for both workloads: the set-up is paid once)
        t0 = time.perf_counter()
        works = [Workload(kind, args.device_n, args.admit) for kind in args.workloads]
        device_cpu = DeviceCounts(h, DeviceScheduler, works, len(works) * (args.device_warmup + args.device_steps)
                                  + 8).run(args.device_warmup, args.device_steps)
        print(f"  device scheduler at N={args.device_n}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    rows = []
    for kind in args.workloads:
        for n in args.n:
            work = Workload(kind, n, args.admit)
            t_row = time.perf_counter()
            times: dict[str, list[float]] = {"vllm": [], "reference": []}
            per_repeat: list[float] = []
            device: list[dict] = []
            for rep in range(args.repeats):
                order = ["vllm", "reference"] if rep % 2 == 0 else ["reference", "vllm"]
                got = {name: timed_run(h, classes[name], work, args.warmup, args.steps) for name in order}
                if cuda:
                    gc.collect()
                    device += DeviceCounts(h, DeviceScheduler, [work],
                                           args.warmup + args.steps + 8).run(args.warmup, args.steps)[kind]
                for name, ts in got.items():
                    times[name] += ts
                per_repeat.append(pct(got["reference"], 50) / pct(got["vllm"], 50))
            if not cuda and n == args.device_n:
                device = device_cpu[kind]
            row = {"workload": kind, "n": n, "replace_per_step": work.replace,
                   "admit_per_step": args.admit if kind == "admission-heavy" else 0}
            for name, ts in times.items():
                row[name] = {"p50_ms": pct(ts, 50), "p99_ms": pct(ts, 99), "steps": len(ts)}
            row["ratio_p50"] = row["reference"]["p50_ms"] / row["vllm"]["p50_ms"]
            row["ratio_p99"] = row["reference"]["p99_ms"] / row["vllm"]["p99_ms"]
            row["ratio_p50_per_repeat"] = per_repeat
            if device:
                row["device"] = _device_summary(device)
            rows.append(row)
            print(f"  {kind} N={n}: vLLM {row['vllm']['p50_ms']:.3f} ms, reference "
                  f"{row['reference']['p50_ms']:.3f} ms, ratio {row['ratio_p50']:.2f}x "
                  f"({time.perf_counter() - t_row:.0f} s)", file=sys.stderr)

    print(f"Scheduling step (schedule() + update_from_output()) under vLLM's v1 Scheduler: {where}; "
          f"gpukv {gpukv.__version__}, vLLM {vllm.__version__}, torch {torch.__version__}; {load} at the end. "
          f"p50 (p99) ms over {args.repeats} x {args.steps} steps, vLLM and reference alternating per repeat.")
    if cuda:
        dev_head = "device wall p50 (p99) ms | device GPU p50 (p99) ms | launches/step | reads/step"
    else:
        dev_head = "device launches/step | device reads/step | device host p50 (max) ms, kernels out"
    print(f"| workload | N | vLLM p50 (p99) ms | gpukv reference p50 (p99) ms | ratio reference/vLLM p50 "
          f"(per repeat) | {dev_head} |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |" + (" ---: |" if cuda else ""))
    for r in rows:
        v, g = r["vllm"], r["reference"]
        lo, hi = min(r["ratio_p50_per_repeat"]), max(r["ratio_p50_per_repeat"])
        cells = [r["workload"], str(r["n"]), f"{v['p50_ms']:.3f} ({v['p99_ms']:.3f})",
                 f"{g['p50_ms']:.3f} ({g['p99_ms']:.3f})", f"{r['ratio_p50']:.2f}x ({lo:.2f}-{hi:.2f})"]
        d = r.get("device")

        def count(key, d=d) -> str:
            c = d[key]
            return f"{c['mean']:.1f}" + (f" ({c['min']}-{c['max']})" if c["min"] != c["max"] else "")

        if d is None:
            cells += ["-"] * (4 if cuda else 3)
        elif cuda:
            cells += [f"{d['wall_ms']['p50']:.3f} ({d['wall_ms']['p99']:.3f})",
                      f"{d['gpu_ms']['p50']:.3f} ({d['gpu_ms']['p99']:.3f})", count("launches"), count("reads")]
        else:
            cells += [count("launches"), count("reads"), f"{d['host_ms']['p50']:.3f} ({d['host_ms']['max']:.3f})"]
        print("| " + " | ".join(cells) + " |")
    if not cuda:
        print(f"\nNo CUDA here: the device manager's time on a GPU was not measured. Its launches, reads and host "
              f"time (timing twin) are over {args.device_steps} timed step(s) after {args.device_warmup} warm-up, at "
              f"N={args.device_n} only." if args.device_n in args.n else
              "\nNo CUDA here: the device manager was not measured (--device-n is 0 or not among --n).")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"where": where, "cuda": cuda, "gpukv": gpukv.__version__, "vllm": vllm.__version__,
                       "torch": torch.__version__, "python": sys.version.split()[0], "load": load,
                       "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats,
                       "device_n": None if cuda else args.device_n,
                       "device_steps": args.steps if cuda else args.device_steps, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
