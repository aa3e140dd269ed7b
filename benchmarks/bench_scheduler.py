"""Cost of a scheduling step under vLLM's v1 ``Scheduler`` (0.8.5, or the
0.33 generation, by what the install offers): vLLM's own block manager
against gpukv's.

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
``max_num_seqs`` so that every request is scheduled every step; under vLLM
0.33 on, ``--sliding-window TOKENS`` makes the group a sliding window, and
``--hybrid`` puts a full-attention group beside it; ``--policy priority``
runs vLLM's priority policy, every request of priority 0; ``--prefill-interval
K`` vLLM's prefill cadence, prefills held until K steps passed since the last
one while requests decode):

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
so its wall time is not its host cost. Its columns give, at each
``--device-n`` (both workloads one after the other on one scheduler, so the
set-up is paid once), what one engine step costs the host on a GPU, counted
honestly: an *honest twin* (``benchmarks/device_twin.py`` has
the method): the host's own work, measured by a twin scheduler with the
kernel bodies skipped and the real one's device reads replayed (torch on one
thread, its uploads through the pinned path's Python); Triton's launch path
for every launch of the step, measured through Triton's real launcher
against a stub driver; and what a GPU adds to each other operation, counted
and charged at a stated cost (``GpuCosts``; ``--gpu-costs`` changes them),
each printed beside its count in the table's header.

The table gives the counts per step (launches, of which replayed; torch
ops, uploads, events, reads, stream queries), the twin's own time, and the
honest figure (the three together), with its ratio to vLLM's step measured in the same
run. ``tests/benchmarks/test_bench_scheduler.py`` holds the counts flat in N.

With CUDA (``torch.cuda.is_available()``) the device scheduler runs with real
kernels at every N, after the other two in each repeat, and its columns give
its wall time per step (host time, its waits on the GPU included) and the
step's span on the GPU's stream (CUDA events recorded around the step);
``--twin-check`` then also runs this benchmark with CUDA hidden (the honest
twin, on the same host) and prints real / honest twin per row. (Not run yet:
no GPU was lent to the session that wrote it.)

    PYTHONPATH=. /work/vllm085/venv/bin/python benchmarks/bench_scheduler.py [--quick] [--json PATH]

(vLLM 0.8.5 must be importable: ``pip install -e '.[vllm085]'`` from a clone, or a venv from
``../shared/tools/vllm085/setup.sh DIR``.)
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import platform
import random
import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (ROOT, os.path.join(ROOT, "benchmarks")):  # (gpukv and tests; launch_cost beside this file)
    if _path not in sys.path:
        sys.path.insert(0, _path)

import torch  # noqa: E402

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # (vLLM logs each config it builds at INFO)

import gpukv  # noqa: E402
import gpukv._runtime  # noqa: E402,F401  (before vLLM imports Triton: the interpreter without CUDA)
from device_twin import (  # noqa: E402  (the honest twin, shared with bench_mooncake.py)
    COUNTED,  # noqa: F401  (read by tests/benchmarks/test_bench_scheduler.py)
    DeviceTwin,
    GpuCosts,
    add_launch_path,
    count_cell,
    device_summary,
    digest,
    launch_cost,
    pct,
    twin_cells,
    twin_head,
)

BS = 16
VOCAB = 32000
PROMPT_LEN = 100  # decoding requests' prompts: 100 to 115 tokens, so 1/16 of them fill a block each step
ADMIT_LEN, SHARED_LEN = 256, 128
MAX_MODEL_LEN = 2048


@dataclass(frozen=True)
class Mode:
    """One scheduler class of vLLM's measured against gpukv's two: the names
    of vLLM's class in the harness and of gpukv's in the version's module."""

    name: str  # vLLM's class, as the table names it
    vllm: str
    reference: str
    device: str


@dataclass(frozen=True)
class Version:
    """What the benchmark runs under one vLLM line: its test harness (which
    builds schedulers and requests as the engine does), gpukv's adapter
    module, and the scheduler classes measured."""

    prefix: str  # vLLM's API generation: "0.8." (no AsyncScheduler) or "0.33." (0.33 and 0.34, read by feature)
    harness: str
    gpukv: str
    modes: tuple[Mode, ...]
    n: tuple[int, ...]  # the full run's Ns
    device_n: tuple[int, ...]  # and where the device scheduler's honest twin is measured (without CUDA)


SYNC = Mode("Scheduler", "VllmScheduler", "ReferenceScheduler", "DeviceScheduler")
VERSIONS = (
    Version("0.8.", "tests.test_vllm.harness", "gpukv.vllm", (SYNC,), (16, 64, 256, 1024), (16, 64, 256)),
    # 0.33's engine runs AsyncScheduler by default (one batch in flight): both are measured.
    Version("0.33.", "tests.test_vllm033.harness", "gpukv.vllm.v0_33",
            (SYNC, Mode("AsyncScheduler", "VllmAsyncScheduler", "ReferenceAsyncScheduler", "DeviceAsyncScheduler")),
            (1, 16, 64, 256, 1024), (1, 16, 64, 256)),
)


def installed_version() -> tuple[Version | None, str]:
    """The entry of ``VERSIONS`` for the importable vLLM (None, with the
    reason, for none or another line) and vLLM's version string."""
    try:
        import vllm
    except Exception as exc:  # noqa: BLE001 (any failure to import means: no usable vLLM here)
        return None, f"vLLM is not importable ({type(exc).__name__}: {exc})"
    from gpukv.vllm_plugin import has_async_scheduler

    # (the generation by what vLLM offers, as gpukv.vllm picks its adapter: 0.33 and 0.34 are one)
    generation = "0.33." if has_async_scheduler() else "0.8."
    return next(v for v in VERSIONS if v.prefix == generation), vllm.__version__


def _harness(version: Version | None = None):
    """The version's test harness (by default the installed vLLM's), or None
    with the reason printed (a harness skips itself, pytest-style, where its
    vLLM is not importable)."""
    if version is None:
        version, why = installed_version()
        if version is None:
            print(f"note: {why}", file=sys.stderr)
            return None
    try:
        import pytest
    except ImportError as exc:
        print(f"note: pytest is needed for {version.harness} ({exc})", file=sys.stderr)
        return None
    try:
        return importlib.import_module(version.harness)
    except pytest.skip.Exception as exc:
        print(f"note: {exc}", file=sys.stderr)
        return None


# ------------------------------------------------------------------ workloads
@dataclass(frozen=True)
class Workload:
    kind: str  # "decode-heavy" or "admission-heavy"
    n: int  # requests decoding
    admit: int = 16  # admission-heavy: new requests a step
    window: int | None = None  # a sliding-window group of this many tokens (None: one full-attention group)
    hybrid: bool = False  # with window: a full-attention group, then the window group
    policy: str = "fcfs"  # the scheduler config's policy ("priority": the waiting queue in priority order)
    prefill_interval: int = 1  # the scheduler config's prefill_schedule_interval (> 1: the prefill cadence)

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
        groups = {} if self.window is None else dict(sliding_window=self.window, hybrid=self.hybrid)
        blocks *= 2 if self.hybrid else 1  # (each request holds blocks in both groups, from one pool)
        policy = {} if self.policy == "fcfs" else dict(policy=self.policy)
        if self.prefill_interval > 1:
            policy["prefill_schedule_interval"] = self.prefill_interval
        return dict(max_num_seqs=self.n + max(self.replace, self.admit) + 8, max_num_batched_tokens=budget,
                    max_model_len=MAX_MODEL_LEN, enable_prefix_caching=True, num_blocks=blocks + 64,
                    block_size=BS, **groups, **policy)


class Run:
    """One scheduler (``cls``) on one workload: ``setup()`` admits the N
    decoding requests, ``step()`` runs one engine step with the workload's
    arrivals and finishes. Two runs of the same workload see the same requests
    and sampled tokens whenever they schedule alike.

    An ``AsyncScheduler`` (the harness's ``is_async``) runs as vLLM's engine
    runs it (``EngineCore.step_with_batch_queue``; ``Engine`` in
    ``tests/test_vllm033/harness.py``): one batch stays in flight, so a step
    schedules batch k and then updates from batch k-1's output (the model's
    answer to a batch is made when it is scheduled, as the GPU samples it)."""

    def __init__(self, h, cls: type, work: Workload, steps: int, config: dict | None = None) -> None:
        self.h, self.work = h, work  # (work may change between steps: its kind sets the arrivals)
        self.sched = h.make_scheduler(cls, **(config or work.config(steps)))
        self.depth = 2 if getattr(h, "is_async", lambda _cls: False)(cls) else 1  # batches in flight, at most
        self.in_flight: deque[tuple[Any, Any, set[str]]] = deque()  # (output, model answer, its finishing ids)
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

    def _sample(self, request, drafts=()) -> int:  # noqa: ARG002  (0.33's harness hands the step's drafts too)
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
        SchedulerOutput scheduled). ``clock``: a function returning seconds,
        by default the thread's CPU time (``CLOCK_THREAD_CPUTIME_ID``: what the
        step costs the host, free of the time other processes take on a shared
        machine; the scheduler and both host managers never wait). An async
        run's first step updates nothing (0 ms): no batch was in flight."""
        clock = clock or time.thread_time
        if self.ready:
            self._arrivals()
        s = self.sched
        t0 = clock()
        out = s.schedule()
        t1 = clock()
        if _preempted(out):
            raise SystemExit(f"{self.work.kind} {self.work.n}: a request was preempted (the pool is too small)")
        self.in_flight.append((out, self.h.model_output(s, out, self._sample), self.finish))
        update_ms = 0.0
        if len(self.in_flight) == self.depth or not out.total_num_scheduled_tokens:
            done, answer, finish = self.in_flight.popleft()
            t2 = clock()
            s.update_from_output(done, answer)
            update_ms = (clock() - t2) * 1e3
            missed = finish & {r.request_id for r in s.running}  # (empty before the set-up is done)
            if missed:
                raise SystemExit(f"{self.work.kind} {self.work.n}: requests {sorted(missed)} did not finish")
        if not self.ready and not s.waiting and len(s.running) == self.work.n \
                and all(r.num_output_tokens for r in s.running):
            self.ready = True
        return (t1 - t0) * 1e3, update_ms, out

    def setup(self, max_steps: int = 1000) -> None:
        for _ in range(max_steps):
            if self.ready:
                return
            self.step()
        raise SystemExit(f"{self.work.kind} {self.work.n}: not all requests decoding after {max_steps} steps")


def _preempted(out) -> bool:
    """Whether a SchedulerOutput resumes or preempts a request (the
    workloads are sized so that none is)."""
    cached = out.scheduled_cached_reqs
    if isinstance(cached, list):  # vLLM 0.8.x: one CachedRequestData per request
        return any(c.resumed_from_preemption for c in cached)
    return bool(getattr(cached, "resumed_req_ids", ()) or out.preempted_req_ids)  # (0.34 re-sends them as new)


def _run_step(run: Run, clock) -> tuple[float, Any]:
    """``DeviceTwin``'s step: one engine step's ms by ``clock`` and its output."""
    ts, tu, out = run.step(clock)
    return ts + tu, out


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
class DeviceCounts:
    """Launches, reads and the other counted operations per step of a
    DeviceScheduler run; on the interpreter, its timing twin (module
    docstring). ``works``: the workloads (same N) run one after the other on
    the same scheduler, so that the set-up (admitting N requests: about a
    second each under the interpreter) is paid once."""

    def __init__(self, h, cls: type, works: list[Workload], steps: int) -> None:
        configs = [w.config(steps) for w in works]
        config = {k: max(c[k] for c in configs) for k in configs[0]}
        config["num_blocks"] = sum(c["num_blocks"] for c in configs)
        self.works = works
        real = Run(h, cls, works[0], steps, config)
        cuda = real.sched.kv_cache_manager.manager.device.type == "cuda"
        self.device = DeviceTwin(real, None if cuda else Run(h, cls, works[0], steps, config), _run_step, digest)
        self.real, self.twin, self.cuda = real, self.device.twin, cuda

    def run(self, warmup: int, steps: int, max_setup: int = 1000) -> dict[str, list[dict]]:
        """The set-up, then each workload in turn: ``warmup`` untimed steps and
        ``steps`` measured ones; the measured steps' rows by workload kind.
        The real scheduler runs every step first (its reads recorded), then
        the twin runs them all back to back, as vLLM's own runs are timed:
        interleaved with the interpreter's kernels, its caches would be cold."""
        plan: list[tuple[Workload, bool, dict]] = []
        for _ in range(max_setup):
            if self.real.ready:
                break
            plan.append((self.works[0], False, self.device.real_step(False)))
        else:
            raise SystemExit(f"{self.real.work}: not all requests decoding after {max_setup} steps")
        for work in self.works:
            self.real.work = work
            plan += [(work, i >= warmup, self.device.real_step(i >= warmup)) for i in range(warmup + steps)]
        if self.twin is not None:
            twin = self.twin

            def before(i: int) -> None:
                twin.work = plan[i][0]

            self.device.twin_steps([row for _, _, row in plan], before)
            if not self.twin.ready:
                raise SystemExit("the timing twin is not ready when the real scheduler is")
        out: dict[str, list[dict]] = {w.kind: [] for w in self.works}
        for work, measured, row in plan:
            row.pop("recorded_reads", None)
            row.pop("digest")
            if measured:
                out[work.kind].append(row)
        return out


# ------------------------------------------------------------------ main
def _args(argv: list[str] | None, version: Version) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # (4 device warm-up steps: a hybrid model's admission-heavy run still met a new admission bucket, its
    # launches kept for the first time, in the third step)
    full = dict(n=list(version.n), admit=16, steps=30, warmup=3, repeats=3, device_n=list(version.device_n),
                device_steps=5, device_warmup=4, launch_samples=20)
    names = [m.name for m in version.modes]
    quick = dict(n=[2], admit=2, steps=3, warmup=1, repeats=2, device_n=[2], device_steps=1, device_warmup=1,
                 launch_samples=3)
    p.add_argument("--n", type=int, nargs="+", help=f"requests decoding (default {full['n']})")
    p.add_argument("--workloads", nargs="+", default=["decode-heavy", "admission-heavy"],
                   choices=["decode-heavy", "admission-heavy"])
    p.add_argument("--admit", type=int, help=f"admission-heavy: 256-token requests admitted a step ({full['admit']})")
    p.add_argument("--steps", type=int, help=f"timed steps per repeat ({full['steps']})")
    p.add_argument("--warmup", type=int, help=f"untimed steps per repeat, after the set-up ({full['warmup']})")
    p.add_argument("--repeats", type=int, help=f"repeats, vLLM and the reference alternating ({full['repeats']})")
    p.add_argument("--device-n", type=int, nargs="*",
                   help="without CUDA: the Ns at which the device scheduler's honest twin is measured, none for "
                        "none (its kernels run under Triton's interpreter: a set-up of about 0.3 s per request, "
                        f"and seconds a step at N=1024) ({full['device_n']})")
    p.add_argument("--device-steps", type=int,
                   help=f"without CUDA: the device scheduler's timed steps ({full['device_steps']})")
    p.add_argument("--device-warmup", type=int,
                   help=f"without CUDA: its untimed steps after the set-up ({full['device_warmup']})")
    p.add_argument("--launch-samples", type=int,
                   help=f"without CUDA: samples of each step's launch path ({full['launch_samples']})")
    p.add_argument("--gpu-costs", help="without CUDA: the stated costs, us, as name=us,... over the defaults "
                                       f"({', '.join(f'{k}={v}' for k, v in vars(GpuCosts()).items())})")
    p.add_argument("--twin-check", action="store_true",
                   help="on CUDA: also run with CUDA hidden (the honest twin) and print real / twin per row")
    p.add_argument("--quick", action="store_true",
                   help="smoke run (options given still apply): " + ", ".join(f"{k}={v}" for k, v in quick.items()))
    p.add_argument("--schedulers", nargs="+", choices=names, default=names,
                   help=f"vLLM {version.prefix}x's scheduler classes to measure (default: {' '.join(names)})")
    p.add_argument("--sliding-window", type=int, metavar="TOKENS",
                   help="vLLM 0.33 on: the model's one KV-cache group a sliding window of TOKENS tokens (default: "
                        "full attention)")
    p.add_argument("--hybrid", action="store_true",
                   help="with --sliding-window: a full-attention group beside the window group")
    p.add_argument("--policy", choices=("fcfs", "priority"), default="fcfs",
                   help="vLLM 0.33 on: the scheduling policy (every request of priority 0; default fcfs)")
    p.add_argument("--prefill-interval", type=int, default=1, metavar="K",
                   help="vLLM 0.33 on: the prefill cadence (prefill_schedule_interval; default 1: none)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if args.prefill_interval != 1 and (version.prefix == "0.8." or args.prefill_interval < 1):
        p.error("--prefill-interval needs vLLM 0.33 or later and K >= 1")
    if args.policy != "fcfs" and version.prefix == "0.8.":
        p.error("--policy needs vLLM 0.33 or later (vLLM 0.8.5's v1 scheduler is first come, first served)")
    if args.sliding_window is not None and (version.prefix == "0.8." or args.sliding_window < 2):
        p.error("--sliding-window needs vLLM 0.33 or later (the installed harness builds full attention only) "
                "and a window of 2 tokens or more")
    if args.hybrid and args.sliding_window is None:
        p.error("--hybrid needs --sliding-window TOKENS (the window group beside the full-attention one)")
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.costs = GpuCosts.parse(args.gpu_costs)
    return args


def _workload(kind: str, n: int, args: argparse.Namespace) -> Workload:
    return Workload(kind, n, args.admit, args.sliding_window, args.hybrid, args.policy, args.prefill_interval)


def _groups_note(args: argparse.Namespace) -> str:
    """The model's KV-cache groups, as the header says them."""
    if args.sliding_window is None:
        return "one full-attention group"
    window = f"a {args.sliding_window}-token sliding-window group"
    return f"a full-attention group and {window}" if args.hybrid else window


def _policy_note(args: argparse.Namespace) -> str:
    cadence = (f"; vLLM's prefill cadence of {args.prefill_interval} steps" if args.prefill_interval > 1 else "")
    return ("; vLLM's priority policy" if args.policy == "priority" else "") + cadence


def _device_twins(h, cls: type, args: argparse.Namespace) -> tuple[dict, str | None]:
    """Without CUDA: the honest twin's rows by (kind, N), both workloads one
    after the other on one scheduler per N; and why the launch path could not
    be measured (None when it was)."""
    rows: dict[tuple[str, int], list[dict]] = {}
    for n in args.device_n:
        t0 = time.perf_counter()
        works = [_workload(kind, n, args) for kind in args.workloads]
        got = DeviceCounts(h, cls, works, len(works) * (args.device_warmup + args.device_steps) + 8).run(
            args.device_warmup, args.device_steps)
        for kind, r in got.items():
            rows[(kind, n)] = r
            first = device_summary(r).get("first_host_ms")
            if first:  # (a first-time cost timed would show here: raise --device-warmup)
                print(f"  device twin {kind} N={n}: first timed step {first['first']:.3f} ms, the others' p50 "
                      f"{first['p50_others']:.3f} ms", file=sys.stderr)
        print(f"  device scheduler at N={n}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    why = add_launch_path({f"{k}/{n}": r for (k, n), r in rows.items()}, args.costs, args.launch_samples)
    return rows, why


def _measure_row(h, classes: dict, kind: str, n: int, args: argparse.Namespace, device_cls: type, cuda: bool) -> dict:
    """vLLM and the reference, alternating over repeats (and on CUDA the
    device scheduler after them): one row of the table."""
    work = _workload(kind, n, args)
    times: dict[str, list[float]] = {"vllm": [], "reference": []}
    per_repeat: list[float] = []
    device: list[dict] = []
    for rep in range(args.repeats):
        order = ["vllm", "reference"] if rep % 2 == 0 else ["reference", "vllm"]
        got = {name: timed_run(h, classes[name], work, args.warmup, args.steps) for name in order}
        if cuda:
            gc.collect()
            device += DeviceCounts(h, device_cls, [work], args.warmup + args.steps + 8).run(args.warmup,
                                                                                           args.steps)[kind]
        for name, ts in got.items():
            times[name] += ts
        per_repeat.append(pct(got["reference"], 50) / pct(got["vllm"], 50))
    row: dict[str, Any] = {"workload": kind, "n": n, "replace_per_step": work.replace,
                           "admit_per_step": args.admit if kind == "admission-heavy" else 0}
    for name, ts in times.items():
        row[name] = {"p50_ms": pct(ts, 50), "p99_ms": pct(ts, 99), "steps": len(ts)}
    row["ratio_p50"] = row["reference"]["p50_ms"] / row["vllm"]["p50_ms"]
    row["ratio_p99"] = row["reference"]["p99_ms"] / row["vllm"]["p99_ms"]
    row["ratio_p50_per_repeat"] = per_repeat
    if device:
        row["device"] = device_summary(device)
    return row


def _print_table(rows: list[dict], cuda: bool, costs: GpuCosts) -> None:
    if cuda:
        dev_head = ("device wall p50 (p99) ms | device GPU p50 (p99) ms | ratio device wall/vLLM | launches/step "
                    "| reads/step")
        ndev = 5
    else:
        dev_head = twin_head(costs) + " | ratio honest/vLLM p50"
        ndev = 11
    print(f"| workload | N | vLLM p50 (p99) ms | gpukv reference p50 (p99) ms | ratio reference/vLLM p50 "
          f"[per repeat] | {dev_head} |")
    print("| --- | ---: | ---: | ---: | ---: |" + " ---: |" * ndev)
    for r in rows:
        v, g = r["vllm"], r["reference"]
        lo, hi = min(r["ratio_p50_per_repeat"]), max(r["ratio_p50_per_repeat"])
        cells = [r["workload"], str(r["n"]), f"{v['p50_ms']:.3f} ({v['p99_ms']:.3f})",
                 f"{g['p50_ms']:.3f} ({g['p99_ms']:.3f})", f"{r['ratio_p50']:.2f}x [{lo:.2f}-{hi:.2f}]"]
        d = r.get("device")
        if d is None:
            cells += ["-"] * ndev
        elif cuda:
            cells += [f"{d['wall_ms']['p50']:.3f} ({d['wall_ms']['p99']:.3f})",
                      f"{d['gpu_ms']['p50']:.3f} ({d['gpu_ms']['p99']:.3f})",
                      f"{d['wall_ms']['p50'] / v['p50_ms']:.2f}x", count_cell(d, "launches"), count_cell(d, "reads")]
        else:
            honest = d.get("honest_ms")
            cells += [*twin_cells(d), f"{honest['p50'] / v['p50_ms']:.2f}x" if honest else "-"]
        print("| " + " | ".join(cells) + " |")


def _twin_check(argv: list[str], rows: list[dict]) -> None:
    """On CUDA: this benchmark again with CUDA hidden (the honest twin on the
    same host), and per row real wall / honest twin."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "twin.json")
        ns = sorted({r["n"] for r in rows})
        cmd = [sys.executable, os.path.abspath(__file__), *argv, "--device-n", *map(str, ns), "--json", out]
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
        subprocess.run(cmd, env=env, check=True)
        with open(out) as f:
            twin = {(r["scheduler"], r["workload"], r["n"]): r.get("device") for r in json.load(f)["rows"]}
    print("\n| scheduler | workload | N | device wall p50 ms (GPU) | honest twin p50 ms (no GPU) | real / twin |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        t = twin.get((r["scheduler"], r["workload"], r["n"]))
        if r.get("device") and t and t.get("honest_ms"):
            real, est = r["device"]["wall_ms"]["p50"], t["honest_ms"]["p50"]
            print(f"| {r['scheduler']} | {r['workload']} | {r['n']} | {real:.3f} | {est:.3f} | {real / est:.2f} |")


def _measure_mode(h, version: Version, mode: Mode, args: argparse.Namespace,
                  cuda: bool) -> tuple[list[dict], str | None]:
    """One scheduler class's rows (vLLM's, gpukv's reference, the device
    scheduler or its honest twin), and why the launch path could not be
    measured (None when it was, or was not asked for)."""
    gk = importlib.import_module(version.gpukv)
    classes = {"vllm": getattr(h, mode.vllm), "reference": getattr(gk, mode.reference)}
    device_cls = getattr(gk, mode.device)
    twins: dict = {}
    why = None
    if not cuda and args.device_n:
        twins, why = _device_twins(h, device_cls, args)
    rows = []
    for kind in args.workloads:
        for n in args.n:
            t_row = time.perf_counter()
            row = {"scheduler": mode.name, **_measure_row(h, classes, kind, n, args, device_cls, cuda)}
            if (kind, n) in twins:
                row["device"] = device_summary(twins[(kind, n)])
            rows.append(row)
            print(f"  {mode.name} {kind} N={n}: vLLM {row['vllm']['p50_ms']:.3f} ms, reference "
                  f"{row['reference']['p50_ms']:.3f} ms, ratio {row['ratio_p50']:.2f}x "
                  f"({time.perf_counter() - t_row:.0f} s)", file=sys.stderr)
    return rows, why


def _step_note(mode: Mode) -> str:
    if mode.name == "AsyncScheduler":
        return (" (async scheduling: one batch in flight, so a step is schedule() of batch k then "
                "update_from_output() of batch k-1, as vLLM's engine runs it)")
    return ""


def main(argv: list[str] | None = None) -> int:
    version, found = installed_version()
    if version is None:
        print(f"{found}: nothing measured", file=sys.stderr)
        return 1
    args = _args(argv, version)
    h = _harness(version)
    if h is None:
        print(f"vLLM {found}'s test harness ({version.harness}) is not importable: nothing measured", file=sys.stderr)
        return 1
    cuda = torch.cuda.is_available()
    where = (torch.cuda.get_device_name() if cuda
             else f"CPU ({platform.machine()}, {os.cpu_count()} cores), Triton interpreter")
    if not cuda and args.device_n:
        launch_cost().install()  # before any manager prepares its launches (host stand-ins recordable)
    modes = [m for m in version.modes if m.name in args.schedulers]
    measured = [(mode, *_measure_mode(h, version, mode, args, cuda)) for mode in modes]
    try:
        load = "load average {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())
    except OSError:
        load = "load average unknown"
    print(f"Scheduling step (schedule() + update_from_output()) under vLLM {found}'s v1 "
          f"{' and '.join(m.name for m in modes)}: {where}; gpukv {gpukv.__version__}, vLLM {found}, "
          f"torch {torch.__version__}; {load} at the end. The model's KV cache: {_groups_note(args)}"
          f"{_policy_note(args)}. p50 (p99) ms over {args.repeats} x {args.steps} steps, vLLM and reference "
          f"alternating per repeat.")
    for mode, rows, _ in measured:
        if len(modes) > 1:
            print(f"\nvLLM's {mode.name} against gpukv's {mode.reference} and {mode.device}{_step_note(mode)}:")
        _print_table(rows, cuda, args.costs)
    whys = sorted({why for _, _, why in measured if why})
    if not cuda:
        print(f"\nNo CUDA here: the device scheduler is its honest twin (module docstring) over "
              f"{args.device_steps} timed step(s) after {args.device_warmup} warm-up, at N in {args.device_n}; "
              f"stated costs (us): {', '.join(f'{k}={v}' for k, v in vars(args.costs).items())}."
              + (f" The launch path was not measured ({'; '.join(whys)}): no honest figure." if whys else ""))
    elif args.twin_check:
        _twin_check([a for a in (argv or sys.argv[1:]) if a != "--twin-check"], [r for _, rows, _ in measured
                                                                                  for r in rows])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"where": where, "cuda": cuda, "gpukv": gpukv.__version__, "vllm": found,
                       "torch": torch.__version__, "python": sys.version.split()[0], "load": load,
                       "schedulers": [m.name for m in modes], "sliding_window": args.sliding_window,
                       "hybrid": args.hybrid, "policy": args.policy, "prefill_interval": args.prefill_interval,
                       "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats,
                       "device_n": None if cuda else args.device_n, "gpu_costs": vars(args.costs),
                       "launch_path_unmeasured": "; ".join(whys) or None,
                       "device_steps": args.steps if cuda else args.device_steps,
                       "rows": [r for _, rows, _ in measured for r in rows]}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
