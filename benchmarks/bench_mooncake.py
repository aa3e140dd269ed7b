"""Cost of an engine step on real traffic: the Mooncake conversation trace
under vLLM 0.33+'s v1 schedulers, vLLM's own block manager against gpukv's
reference manager.

The traffic. The requests of ``gpukv/data/mooncake_conversation_trace.jsonl.xz``
(``gpukv.tools.traces``; ``docs/traces.md``) in the trace's order, which is arrival
(timestamp) order. Their prompts are materialised as ``gpukv replay`` does:
hash id ``h`` names a 512-token block holding the tokens ``h * 512 + k``, so
equal ids give equal tokens and requests share prefixes exactly as in the
trace (a Mooncake block is 32 blocks of 16); the prompt is cut to
``input_length`` (its last block partial). Each request generates
``output_length`` tokens (``max_tokens``; the sampled tokens are a function
of the request and the position, below ``2**31`` since vLLM 0.34 keeps token
ids as int32, never EOS).

The running count. Arrivals are not replayed by time: before each step, the
next requests of the trace are added while the scheduler holds fewer than
``target`` unfinished requests (running and waiting), and ``max_num_seqs`` is
``target``. So once the first ``target`` requests are in, a request arrives
whenever one finishes, and the running count stays at the target (the table
gives its mean over the timed steps). The rows are ``--targets`` (40 and 200:
the issue's "about 40" and "about 200 running").

The engine. Block size 16, one full-attention group, prefix caching on
(vLLM's default hash, sha256), chunked prefill on, token budget 8192
(``max_num_batched_tokens``), no long-prefill threshold (vLLM's default;
``--long-prefill-token-threshold N`` caps each request's prefill chunk at N
tokens, as the server's option does), ``max_model_len`` the longest request loaded
(prompt and output). The pool: one null block, plus the blocks of the
``target`` largest requests loaded (prompt and output together) and 64 more,
so that the running set always fits (no preemption: a run that preempts stops
with an error) while finished requests' cached blocks are evicted as the
pool fills, as on a server.

A step is what vLLM's engine does with the scheduler, timed as thread CPU
time (``time.thread_time``; the scheduler and both host managers never wait,
so other processes on a shared machine do not count), with
``torch.set_num_threads(1)``:

* arrivals: each new ``Request`` built with the engine's block hasher (the
  request hashes its full prompt blocks as it is built:
  ``Request.__init__`` calls ``update_block_hashes``) and
  ``scheduler.add_request``. (vLLM 0.34 also takes hashes a frontend
  computed, ``EngineCoreRequest.block_hashes``; measured here is the engine
  hashing the prompt itself, which it does when none are handed over.) For
  gpukv's scheduler the engine builds no hasher (gpukv hashes the tokens
  itself, once: ``gpukv.vllm.v0_33.engine_hashing``), so its requests are
  built without;
* ``schedule()``;
* ``update_from_output()`` (which appends the sampled tokens, and so hashes
  the blocks they fill). Under ``AsyncScheduler`` one batch stays in flight
  (``EngineCore.step_with_batch_queue``): a step schedules batch k and
  updates from batch k-1's output, as ``benchmarks/bench_scheduler.py``'s
  ``Run`` does.

The model runner's answer is built between them, untimed
(``tests/test_vllm033/harness.py``'s ``model_output``).

Each row alternates vLLM's scheduler and gpukv's (``ReferenceScheduler``,
``ReferenceAsyncScheduler``: the reference manager, gpukv's backend without
CUDA) over ``--repeats`` fresh runs in one process (vLLM first in even
repeats) on the same requests and sampled tokens. A run steps until the
running count first reaches the target (or ``--fill-steps`` pass), then
``--warmup`` untimed steps, then ``--steps`` timed ones. Equal work is
checked, not assumed: every run must give each request the same prefix-cache
hit (tokens, at its first scheduling) and schedule the same tokens per
request every step as vLLM's run; if not, the benchmark exits with status 1.
p50 and p99 are over every timed step of every repeat; the ratio is gpukv /
vLLM at p50, with the range of the per-repeat p50 ratios.

The step split: two more runs of vLLM's scheduler per row (their work
checked equal), stepped in lockstep: one with its KV-cache manager timed
(``ManagerTimer``: every call into the manager, its block pool and its
coordinator, which the scheduler calls directly too, its ``usage`` property
and the engine's block hasher), one plain. Per step, the plain step less the
time inside the manager is at most what is outside it (the wrappers add to
the manager's figure only, and to the timed run's step, which is given too).
What is outside the manager is vLLM's scheduler code, which runs unchanged
under gpukv's schedulers: no manager's step goes below it, so ``outside /
step`` bounds from below the ratio to vLLM any manager can reach on that
row's traffic. With ``--device``, each device column's twin gets the same
split (without CUDA): a second twin goes through the steps the timed one
went through (the same recorded reads) with its manager's calls timed the
same way, kernels out; each step's launch path and stated GPU costs, all of
which are made inside those calls, are added from the timed twin's same
step. Beside vLLM's own manager figure this says what gpukv's calls cost
against vLLM's manager's, and what is left of the twin's step outside them.

Per admission (``--admissions``): one more pair of runs per target, vLLM's
``Scheduler`` against gpukv's ``UnbatchedReferenceScheduler``, with the
manager's calls timed per request: for vLLM, its hashing of the prompt when
the request is built (the block hasher's call in ``Request.__init__``) plus
``get_computed_blocks`` and ``allocate_slots`` up to and including the
allocation that admits it (its first chunk); for gpukv, the same two calls,
which hash the prompt themselves (gpukv keys its cache by its own digests;
the engine hashes nothing for it).
The unbatched class because gpukv's batched path admits a run of waiting
requests as one gpukv step inside the run's first lookup, a cost no single
admission owns (the device pass below shares it out). Admissions are
bucketed by prompt length in blocks of 16 (1-63, 64-255, 256-1023, 1024
and more); the table gives p50 per bucket and the ratio of the p50s. This pass times each call through a wrapper, so its
figures are not the step table's.

The device manager (``--device``, off by default): gpukv's
``DeviceScheduler`` and ``DeviceAsyncScheduler`` run once per row on the plan
vLLM's runs followed (fill, warm-up, timed steps) and are checked to do
vLLM's work (hits and tokens scheduled, as above). Without CUDA their
kernels run under Triton's interpreter (seconds per admitted request of
this length), so the column is the honest twin of
``benchmarks/device_twin.py`` (host time of a twin with the kernels out,
Triton's launch path measured, stated GPU costs per counted operation); a
second table gives its counts, each stated cost beside its count, and the
first timed step beside the others' p50 (a first-time cost timed would
show there). Keep it small: ``--targets 40 --steps 20``. With the
per-admission pass on, ``--device`` adds gpukv's ``UnbatchedDeviceScheduler``
there too (the unbatched class for the reason above), one run per target on
the admission runs' plan, checked to do vLLM's work: the honest twin of each
admission, its calls (the lookups and the admitting allocation, as for the
reference) attributed through ``DeviceTwin.attribute``: the twin's host time
in those calls, the launch path of their own launches, and their counted
operations at the stated costs; a table per bucket, each stated cost beside
its count, and the twin host time's slope in prompt blocks (admissions of
64 blocks and more); not on CUDA. Beside it, what an engine runs: gpukv's
batched ``DeviceScheduler``, whose waiting run (every request vLLM's loop
will admit this step) is one gpukv step made inside the run's first
lookup. That step would also apply the running loop's answered
allocations (its running phase, no admission's cost), so here they are
applied as a step of their own just before that lookup, outside the timed
calls (``apply_running_growth_first``; the decisions are the same, and
checked): the admission's step then pays alone the fixed cost it shares
with the running phase in the engine. A run's figures (its calls, their
launch path and stated costs) are shared equally by the K requests it
admitted (``share_admitting_steps``), and the table gives the mean K and,
apart, the admissions made alone (K = 1). vLLM's admission run is made again after
the device runs (its work checked equal), and the device's ratio is given
against each of vLLM's two p50s (vLLM's figures have read up to 1.9x apart
between runs of one tree), and against a vLLM run stepped in lockstep with
the twin's steps (its admissions timed alike, in the same minutes). The step table's device columns give, in
brackets, their ratio to a vLLM run stepped in lockstep with the timed run
(its step i just before the device's step i, untimed for the device: the
twin's steps without CUDA, the real run's on CUDA), with that run's p50:
both figures from the same minutes of the machine's load. Every admission is sampled, the fill's included (as
vLLM's and the reference's), so every step's launches are recorded: about
1 s of interpreter time per long admission. ``--worker`` adds a column: the
device scheduler built as under ``gpukv.vllm.Worker``, whose model runner
reads gpukv's block tables on the device (``worker_bound``): the adapter
reads no block id back and vLLM's SchedulerOutput carries none, the
configuration gpukv's worker runs (Model Runner V2). Under it the admission pass's
device run is bound too (the adapter's lookup then reads the hit's size,
``read_prefix_hit``, and the admission reads no id back). Every device
scheduler is built as on CUDA, its admission buckets prepared before its
first step (``prepare_as_on_cuda``; ``--cold-buckets``: not, so each prompt
length class's first admission pays its first-time launches).

    PYTHONPATH=. VENV/bin/python benchmarks/bench_mooncake.py [--quick] [--device [--worker]] [--json PATH]

(VENV: one with vLLM 0.33 or later: ``tests/test_vllm033/harness.py``'s
``INSTALL_HINT``.)
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import os
import platform
import sys
import time
from collections import defaultdict, deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (ROOT, os.path.join(ROOT, "benchmarks")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import numpy as np  # noqa: E402
import torch  # noqa: E402

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import gpukv  # noqa: E402
import interpreter_shortcut  # noqa: E402  (the interpreter's untimed kernel work, faster)
from device_twin import (  # noqa: E402  (the honest twin, shared with bench_scheduler.py)
    COUNTED,
    DeviceTwin,
    GpuCosts,
    add_launch_path,
    device_summary,
    digest,
    launch_cost,
    pct,
    replay_copy,
    twin_cells,
    twin_head,
)
from gpukv.kernels import capture  # noqa: E402
from gpukv.tools.traces import conversation_trace_path, load_trace, mooncake_tokens  # noqa: E402

BS = 16
BUDGET = 8192
HASH_ALGO = "sha256"  # vLLM's default prefix_caching_hash_algo
TOKEN_IDS = 2**31  # vLLM 0.34 keeps a request's token ids as int32
#: Prompt-length buckets, in blocks of 16: [low, high) (None: no upper bound).
BUCKETS = ((1, 64), (64, 256), (256, 1024), (1024, None))
HARNESS = "tests.test_vllm033.harness"


def load_harness():
    """vLLM 0.33+'s test harness, or None with the reason printed (it skips
    itself, pytest-style, without vLLM or without vLLM's AsyncScheduler)."""
    try:
        import pytest
    except ImportError as exc:
        print(f"note: pytest is needed for {HARNESS} ({exc})", file=sys.stderr)
        return None
    try:
        return importlib.import_module(HARNESS)
    except pytest.skip.Exception as exc:
        print(f"note: {exc}", file=sys.stderr)
        return None


# ------------------------------------------------------------------ the traffic
@dataclass(frozen=True)
class Prompt:
    """One trace request: its index (and request id), hash ids, prompt and output lengths."""

    index: int
    hash_ids: Any
    input_length: int
    max_tokens: int

    @property
    def blocks(self) -> int:
        """Prompt length in blocks of 16 (the last one partial)."""
        return -(-self.input_length // BS)

    def tokens(self) -> list[int]:
        return mooncake_tokens(self.hash_ids, self.input_length).tolist()


def load_prompts(max_requests: int) -> list[Prompt]:
    trace = load_trace(conversation_trace_path(), max_requests=max_requests)
    return [Prompt(r.index, r.hash_ids, r.input_length, max(1, int(r.output_length or 0))) for r in trace.requests]


def bucket_of(blocks: int) -> str:
    for low, high in BUCKETS:
        if blocks >= low and (high is None or blocks < high):
            return f"{low}-{high - 1}" if high else f"{low}+"
    raise ValueError(f"a prompt of {blocks} blocks")


def config(prompts: list[Prompt], target: int, long_prefill_token_threshold: int = 0) -> dict:
    """make_scheduler's options (module docstring: the engine)."""
    sizes = sorted((-(-(p.input_length + p.max_tokens) // BS) for p in prompts), reverse=True)
    longest = max(p.input_length + p.max_tokens for p in prompts)
    return dict(max_num_seqs=target, max_num_batched_tokens=BUDGET, max_model_len=-(-longest // BS) * BS,
                enable_prefix_caching=True, num_blocks=1 + sum(sizes[:target]) + 64, block_size=BS,
                hash_algo=HASH_ALGO, long_prefill_token_threshold=long_prefill_token_threshold)


# ------------------------------------------------------------------ one run
def preempted(out) -> bool:
    """Whether a SchedulerOutput preempts or resumes a request (vLLM 0.34
    re-sends a resumed request as a new one: its preemption shows)."""
    return bool(out.preempted_req_ids or getattr(out.scheduled_cached_reqs, "resumed_req_ids", ()))


class TraceRun:
    """One scheduler of class ``cls`` on the trace at ``target`` running
    requests; ``step()`` is one engine step (module docstring). ``hits``: each
    request's prefix-cache hit in tokens at its first scheduling;
    ``decisions``: tokens scheduled per request, step by step."""

    def __init__(self, h, cls: type, prompts: list[Prompt], target: int, options: dict) -> None:
        self.h, self.prompts, self.target = h, prompts, target
        self.sched = h.make_scheduler(cls, **options)
        self.depth = 2 if h.is_async(cls) else 1
        self.hasher = self.sched.harness_hasher  # (the engine's: none for gpukv's scheduler, which hashes itself)
        self.next = 0
        self.in_flight: deque[tuple[Any, Any]] = deque()
        self.hits: dict[str, int] = {}
        self.decisions: list[tuple] = []

    def _arrivals(self, clock) -> float:
        """Add trace requests while fewer than ``target`` are unfinished: ms
        to build them (the engine's hashing) and add them."""
        s, h = self.sched, self.h
        made = []
        while len(s.requests) + len(made) < self.target and self.next < len(self.prompts):
            p = self.prompts[self.next]
            self.next += 1
            params = h.SamplingParams(max_tokens=p.max_tokens)
            params.update_from_generation_config({}, h.EOS_TOKEN_ID)
            made.append((str(p.index), p.tokens(), params))
        t0 = clock()
        for rid, tokens, params in made:
            s.add_request(h.Request(request_id=rid, prompt_token_ids=tokens, sampling_params=params,
                                    pooling_params=None, arrival_time=0.0, block_hasher=self.hasher))
        return (clock() - t0) * 1e3

    def _sample(self, request, drafts=()) -> int:  # noqa: ARG002  (the harness hands the step's drafts too)
        token = (int(request.request_id) * 1_000_003 + request.num_output_tokens * 7919) % TOKEN_IDS
        return token + 1 if token == self.h.EOS_TOKEN_ID else token

    def step(self, clock=time.thread_time) -> float:
        """One engine step; returns its ms (arrivals + schedule + update)."""
        return self.step_out(clock)[0]

    def step_out(self, clock=time.thread_time) -> tuple[float, Any]:
        """One engine step: its ms and the SchedulerOutput it scheduled."""
        arrive_ms = self._arrivals(clock)
        s = self.sched
        t0 = clock()
        out = s.schedule()
        schedule_ms = (clock() - t0) * 1e3
        if preempted(out):
            raise SystemExit(f"{type(s).__name__} at {self.target}: a request was preempted (the pool is too small)")
        for new in out.scheduled_new_reqs:
            self.hits.setdefault(new.req_id, new.num_computed_tokens)
        self.decisions.append(tuple(out.num_scheduled_tokens.items()))
        self.in_flight.append((out, self.h.model_output(s, out, self._sample)))
        update_ms = 0.0
        if len(self.in_flight) == self.depth or not out.total_num_scheduled_tokens:
            done, answer = self.in_flight.popleft()
            t1 = clock()
            s.update_from_output(done, answer)
            update_ms = (clock() - t1) * 1e3
        return arrive_ms + schedule_ms + update_ms, out

    def run(self, fill: int, warmup: int, steps: int, step=None) -> tuple[list, list[int]]:
        """Fill (until ``target`` run, at most ``fill`` steps), warm up, then
        ``steps`` timed steps: what ``step(timed)`` returned for them (by
        default ``self.step()``'s ms) and their running counts."""
        step = step or (lambda _timed: self.step())
        for _ in range(fill):
            if len(self.sched.running) >= self.target:
                break
            step(False)
        for _ in range(warmup):
            step(False)
        times, running = [], []
        for _ in range(steps):
            times.append(step(True))
            running.append(len(self.sched.running))
        if self.next == len(self.prompts) and len(self.sched.requests) < self.target:
            raise SystemExit(f"the {len(self.prompts)} trace requests loaded ran out before the timed steps ended "
                             f"(target {self.target}): raise --max-requests")
        return times, running


@dataclass(frozen=True)
class Work:
    """What a run decided (``TraceRun.hits`` and ``decisions``): runs doing
    equal work decide alike."""

    hits: dict[str, int]
    decisions: list[tuple]


def same_work(label: str, ref: Work | TraceRun, got: TraceRun) -> None:
    """Exit with status 1 unless ``got`` hit and scheduled as ``ref`` did."""
    if got.hits != ref.hits:
        diff = sorted(r for r in set(ref.hits) | set(got.hits) if ref.hits.get(r) != got.hits.get(r))
        print(f"{label}: prefix-cache hits differ from vLLM's for requests {diff[:10]} "
              f"(vLLM {[ref.hits.get(r) for r in diff[:10]]}, gpukv {[got.hits.get(r) for r in diff[:10]]})",
              file=sys.stderr)
        raise SystemExit(1)
    if got.decisions != ref.decisions:
        n = min(len(ref.decisions), len(got.decisions))
        first = next((i for i in range(n) if ref.decisions[i] != got.decisions[i]), n)
        print(f"{label}: the tokens scheduled differ from vLLM's at step {first}", file=sys.stderr)
        raise SystemExit(1)


# ------------------------------------------------------------------ the step table
class ManagerTimer:
    """Thread time a vLLM scheduler's run spends in its KV-cache manager,
    step by step: every public method of the manager, its ``usage``
    property, the public methods of its block pool and coordinator as the
    scheduler sees them (it calls some of theirs directly: ``_TimedView``),
    and the engine's block hasher (the arrivals' hashing); on gpukv's
    adapter also its pending step (``PendingGrowth.flush``), which vLLM's
    scheduler runs from outside any manager call when it reads a running
    request's new blocks before the adapter applied them. Inside a timed
    call the manager's code sees its own block pool and coordinator, so
    its calls into them pay no wrapper; a call into the manager made inside
    a timed one counts once, in it. ``clock``: seconds (a stand-in in
    tests). What is left of the step is scheduler code that runs unchanged
    whatever the manager (module docstring, "the step split")."""

    def __init__(self, run: TraceRun, clock=time.thread_time) -> None:
        self.run, self.clock = run, clock
        self.seconds = 0.0  # inside the manager since the last ``step``
        self.calls = 0  # timed calls (outermost) since the last ``step``
        self._depth = 0
        kvm = self._kvm = run.sched.kv_cache_manager
        for name in dir(type(kvm)):
            attr = getattr(type(kvm), name, None)
            if not name.startswith("_") and callable(attr) and not isinstance(attr, type):
                setattr(kvm, name, self._timed(getattr(kvm, name)))
        usage = getattr(type(kvm), "usage", None)
        if isinstance(usage, property):  # (a property: timed on a subclass made for this instance)
            kvm.__class__ = type(type(kvm).__name__, (type(kvm),), {"usage": property(self._timed(usage.fget))})
        if run.hasher is not None:
            run.hasher = self._timed(run.hasher)
        pending = getattr(kvm, "pending", None)  # (gpukv's adapter: see ``twin_manager_split``)
        if pending is not None:
            pending.flush = self._timed(pending.flush)
        self._own = {name: getattr(kvm, name) for name in ("block_pool", "coordinator")
                     if getattr(kvm, name, None) is not None}
        self._views = {name: _TimedView(obj, self._timed) for name, obj in self._own.items()}
        self._show(self._views)

    def _show(self, objects: dict) -> None:
        for name, obj in objects.items():
            setattr(self._kvm, name, obj)

    def _timed(self, method):
        def timed(*args, **kwargs):
            if self._depth:
                return method(*args, **kwargs)
            self._depth += 1
            self.calls += 1
            self._show(self._own)
            t0 = self.clock()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds += self.clock() - t0
                self._show(self._views)
                self._depth -= 1

        return timed

    def step(self) -> tuple[float, float, int]:
        """One engine step (``TraceRun.step`` by this clock): its ms, the ms
        inside the manager and the timed calls."""
        self.take()
        ms = self.run.step(self.clock)
        return ms, *self.take()

    def take(self) -> tuple[float, int]:
        """The ms inside the manager and the timed calls since the last
        ``take`` (or ``step``), then counted again from zero: a step's, for
        a run stepped by someone else (``twin_manager_split``)."""
        out = self.seconds * 1e3, self.calls
        self.seconds, self.calls = 0.0, 0
        return out


class _TimedView:
    """``obj`` (a manager's block pool or coordinator) as the scheduler sees
    it under ``ManagerTimer``: its public methods through ``timed``, every
    other attribute its own."""

    def __init__(self, obj: Any, timed) -> None:
        self._obj, self._timed, self._methods = obj, timed, {}

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._obj, name)
        if name.startswith("_") or not callable(value):
            return value
        method = self._methods.get(name)
        if method is None:
            method = self._methods[name] = self._timed(value)
        return method


def measure_split(h, cls: type, prompts: list[Prompt], target: int, options: dict, args: argparse.Namespace,
                  ref: Work) -> dict:
    """Two more runs of vLLM's ``cls``, checked to do ``ref``'s work and
    stepped in lockstep: one with its manager timed (``ManagerTimer``), and
    one plain, each of whose steps runs just before the timed run's same
    step. Per step, the plain step's ms less the manager's ms in the timed
    one is at most what was outside the manager (the wrappers can only add
    to the manager's figure, their clock readings): its p50 and mean, its
    share of the plain step's p50 (a lower bound on the floor no manager's
    step goes below), the manager's p50 and mean, the timed calls per step,
    and the timed run's own step p50 (wrappers and all)."""
    gc.collect()
    run = TraceRun(h, cls, prompts, target, options)
    plain = _LockstepRun(TraceRun(h, cls, prompts, target, options))
    timer = ManagerTimer(run)

    def step(timed: bool) -> tuple[float, float, int]:
        plain.step(timed)
        return timer.step()

    steps, _ = run.run(args.fill_steps, args.warmup, args.steps, step)
    for r in (run, plain.run):
        same_work(f"{cls.__name__} at {target}, for its step split", ref, r)
    step_ms, manager = plain.times, [m for _, m, _ in steps]
    outside = [s - m for s, m in zip(step_ms, manager, strict=True)]
    return {"steps": len(steps), "calls_mean": float(np.mean([c for *_, c in steps])),
            "step_p50_ms": pct(step_ms, 50), "timed_step_p50_ms": pct([t for t, _, _ in steps], 50),
            "manager_p50_ms": pct(manager, 50), "manager_mean_ms": float(np.mean(manager)),
            "outside_p50_ms": pct(outside, 50), "outside_mean_ms": float(np.mean(outside)),
            "outside_share": pct(outside, 50) / pct(step_ms, 50)}


def measure_row(h, classes: dict, prompts: list[Prompt], target: int, args: argparse.Namespace) -> dict:
    """vLLM and gpukv alternating over repeats at one target: one row."""
    options = config(prompts, target, args.long_prefill_token_threshold)
    times: dict[str, list[float]] = {"vllm": [], "gpukv": []}
    running: list[int] = []
    per_repeat: list[float] = []
    first: Work | None = None
    for rep in range(args.repeats):
        order = ["vllm", "gpukv"] if rep % 2 == 0 else ["gpukv", "vllm"]
        got: dict[str, tuple[TraceRun, list[float]]] = {}
        for name in order:
            gc.collect()
            run = TraceRun(h, classes[name], prompts, target, options)
            ts, rs = run.run(args.fill_steps, args.warmup, args.steps)
            got[name] = (run, ts)
            if name == "vllm":
                running += rs
        first = first or Work(got["vllm"][0].hits, got["vllm"][0].decisions)
        for name in order:
            same_work(f"{classes[name].__name__} at {target}, repeat {rep}", first, got[name][0])
            times[name] += got[name][1]
        per_repeat.append(pct(got["gpukv"][1], 50) / pct(got["vllm"][1], 50))
        del got
    assert first is not None
    row: dict[str, Any] = {"target": target, "running_mean": sum(running) / len(running),
                           "running_min": min(running), "running_max": max(running),
                           "requests_scheduled": len(first.hits), "num_blocks": options["num_blocks"],
                           "max_model_len": options["max_model_len"],
                           "hit_tokens": sum(first.hits.values()),
                           "prompt_tokens": sum(p.input_length for p in prompts if str(p.index) in first.hits)}
    for name, ts in times.items():
        row[name] = {"p50_ms": pct(ts, 50), "p99_ms": pct(ts, 99), "steps": len(ts)}
    row["ratio_p50"] = row["gpukv"]["p50_ms"] / row["vllm"]["p50_ms"]
    row["ratio_p50_per_repeat"] = per_repeat
    row["vllm_split"] = measure_split(h, classes["vllm"], prompts, target, options, args, first)
    if "device" in classes:
        whys = []
        for key, worker in (("device", False), ("worker", True)):
            if worker and not args.worker:
                continue
            t0 = time.perf_counter()
            row[key], why = measure_device(h, classes["device"], prompts, target, options, args, first, worker,
                                           beside_cls=classes["vllm"])
            whys += [why] if why else []
            print(f"  device scheduler{' (worker binding)' if worker else ''} at {target}: "
                  f"{time.perf_counter() - t0:.0f} s", file=sys.stderr)
        row["launch_path_unmeasured"] = "; ".join(whys) or None
    return row


def _step_out(run: TraceRun, clock) -> tuple[float, Any]:
    return run.step_out(clock)


@contextlib.contextmanager
def worker_bound(options: dict, bound: bool) -> Iterator[None]:
    """Inside, when ``bound``, schedulers are built as under ``gpukv.vllm.Worker``:
    a model runner of ``max_num_seqs`` rows, one group whose table spans
    ``max_model_len``, has said what it reads (``BINDING.expect``, as the
    worker's runner does before the engine builds its scheduler), so the
    adapter reads no block id back (``ids_on_device``) and vLLM's
    SchedulerOutput carries none. Unbound again after."""
    if not bound:
        yield
        return
    from gpukv.vllm.v0_33.binding import BINDING

    BINDING.expect(max_num_reqs=options["max_num_seqs"], widths=[options["max_model_len"] // BS], block_sizes=[BS])
    try:
        yield
    finally:
        BINDING.reset()


def prepare_as_on_cuda(real: TraceRun, twin: TraceRun | None) -> None:
    """What the device scheduler does when built on CUDA
    (``prepare_admissions_at_start``): every admission bucket a prompt up to
    ``max_model_len`` can meet prepared before the first step, so no
    admission is timed on a first-time launch. Done here for the interpreted
    run and its twin with the kernel bodies skipped (the launches still
    kept, and their bodies run when replayed): a round admitting no request
    changes nothing a call reads (``tests/device/test_prepare_admissions.py``),
    and its buffers are then as a bucket's first admission finds them, while
    running its programs under the interpreter would take a minute a run at
    128k tokens. Every hit is still checked against vLLM's. On CUDA the
    scheduler did it itself."""
    if real.sched.kv_cache_manager.manager.device.type == "cuda":
        return
    with capture.kernel_bodies_skipped():
        for run in (real, twin):
            if run is not None:
                run.sched.prepare_admissions()


def measure_device(h, cls: type, prompts: list[Prompt], target: int, options: dict, args: argparse.Namespace,
                   ref: Work, worker: bool = False, beside_cls: type | None = None) -> tuple[dict, str | None]:
    """The device scheduler on the plan vLLM's runs followed (fill, warm-up,
    timed steps), checked to do vLLM's work; without CUDA its honest twin
    (``benchmarks/device_twin.py``): the summary of its timed steps, and why
    the launch path could not be measured (None when it was). ``worker``:
    both schedulers built under the gpukv worker's binding (``worker_bound``).
    ``beside_cls`` (vLLM's scheduler): a run of it stepped in lockstep with
    the timed one, each of its steps just before the device's same step
    (``_LockstepRun``), its timed steps in the summary's ``vllm_beside``:
    a ratio of two figures taken in one window of the machine's load."""
    gc.collect()
    beside = None if beside_cls is None else _LockstepRun(TraceRun(h, beside_cls, prompts, target, options))
    with worker_bound(options, worker):
        real = TraceRun(h, cls, prompts, target, options)
        cuda = real.sched.kv_cache_manager.manager.device.type == "cuda"
        twin = None if cuda else TraceRun(h, cls, prompts, target, options)
    if args.prepare:
        prepare_as_on_cuda(real, twin)
    if worker and not all(r.sched.kv_cache_manager.ids_on_device for r in (real, twin) if r is not None):
        raise SystemExit(f"{cls.__name__} at {target}: the worker's binding did not take (block ids still read back)")
    device = DeviceTwin(real, twin, _step_out, digest)
    rows: list[tuple[bool, dict]] = []

    def step(timed: bool) -> None:
        if cuda and beside is not None:  # (on CUDA the real run is the timed one)
            beside.step(timed)
        rows.append((timed, device.real_step(timed)))

    real.run(args.fill_steps, args.warmup, args.steps, step)
    same_work(f"{cls.__name__} at {target}", ref, real)
    flags = [t for t, _ in rows]
    spare = [replay_copy(row) for _, row in rows] if device.twin is not None else []
    if device.twin is not None:
        device.twin_steps([row for _, row in rows], (lambda i: beside.step(flags[i])) if beside else lambda _i: None)
    timed = [row for t, row in rows if t]
    for _, row in rows:
        row.pop("recorded_reads", None)
        row.pop("digest")
    why = None if cuda else add_launch_path({"device": timed}, args.costs, args.launch_samples)
    summary = device_summary(timed)
    if spare:
        with worker_bound(options, worker):
            second = TraceRun(h, cls, prompts, target, options)
        if args.prepare:
            prepare_as_on_cuda(second, None)
        summary["manager_split"] = twin_manager_split(device, second, spare, flags, timed)
    if beside is not None:
        same_work(f"{beside_cls.__name__} stepped beside {cls.__name__} at {target}", ref, beside.run)
        summary["vllm_beside"] = {"p50_ms": pct(beside.times, 50), "p99_ms": pct(beside.times, 99),
                                  "steps": len(beside.times)}
    return summary, why


def twin_manager_split(device: DeviceTwin, twin: TraceRun, rows: list[dict], flags: list[bool],
                       timed: list[dict]) -> dict:
    """The twin's step split (module docstring): ``twin``, a fresh run of the
    device scheduler, through the steps ``rows`` recorded (``replay_copy``s
    made before the timed twin's run; ``flags``: which were timed) with its
    manager's calls timed (``ManagerTimer``, the twin's clock: thread time
    less the skipped launches'); each timed step's calls get the launch path
    and stated costs of the timed twin's same step (``timed``, where
    measured). Returns the calls per step, the calls' host time and with the
    GPU parts (p50, mean), the second twin's own step (its wrappers' cost
    in it), and, as vLLM's split takes it, what of the timed twin's step is
    outside the calls: its host time less the calls' (p50; at least, as the
    calls' figure carries their clock readings). The adapter's batched step
    is timed wherever it runs: unbound, vLLM's ``schedule()`` reading a
    running request's new blocks applies the pending allocations from
    outside any manager call (``PendingGrowth.flush``, timed too)."""
    device.set_twin(twin)
    timer = ManagerTimer(twin, clock=lambda: time.thread_time() - capture.kernel_seconds())
    taken: list[tuple[float, int]] = []  # (each step's figures, taken when the next one starts)
    gc.collect()
    device.twin_steps(rows, lambda _i: taken.append(timer.take()))
    taken = [*taken[1:], timer.take()]
    host = [ms for (ms, _), t in zip(taken, flags, strict=True) if t]
    calls = [n for (_, n), t in zip(taken, flags, strict=True) if t]
    steps = [r["host_ms"] for r, t in zip(rows, flags, strict=True) if t]
    gpu = [(r["honest_ms"] - r["host_ms"]) if r.get("honest_ms") is not None else 0.0 for r in timed]
    with_gpu = [m + g for m, g in zip(host, gpu, strict=True)]
    return {"steps": len(host), "calls_mean": float(np.mean(calls)),
            "manager_host_p50_ms": pct(host, 50), "manager_host_mean_ms": float(np.mean(host)),
            "manager_p50_ms": pct(with_gpu, 50), "manager_mean_ms": float(np.mean(with_gpu)),
            "gpu_parts_measured": all(r.get("honest_ms") is not None for r in timed),
            "timed_step_p50_ms": pct(steps, 50),
            "outside_p50_ms": pct([r["host_ms"] - m for r, m in zip(timed, host, strict=True)], 50)}


class _LockstepRun:
    """A vLLM run stepped beside another timed run (the device scheduler's,
    or vLLM's with its manager timed: ``measure_split``), one step before
    each of its steps (outside their timing), so both figures come
    from the same minutes of the machine: a separate run's p50 has read up
    to 1.6x apart from the next run's on this machine. ``times``: its timed
    steps' ms (arrivals + schedule + update, as ``TraceRun.step``)."""

    def __init__(self, run: TraceRun) -> None:
        self.run = run
        self.times: list[float] = []

    def step(self, timed: bool) -> None:
        ms = self.run.step()
        if timed:
            self.times.append(ms)


# ------------------------------------------------------------------ per admission
class AdmissionTimer:
    """Times, per request, a scheduler's admission calls (module docstring:
    per admission), through wrappers on its manager and the block hasher."""

    def __init__(self, h, run: TraceRun) -> None:
        self.hash_ms: dict[str, float] = defaultdict(float)
        self.calls_ms: dict[str, float] = defaultdict(float)
        self.samples: dict[str, tuple[float, float]] = {}  # request id: (hash ms, lookup + allocate ms)
        kvm = run.sched.kv_cache_manager
        running = h.RequestStatus.RUNNING
        real_lookup, real_allocate, real_hasher = kvm.get_computed_blocks, kvm.allocate_slots, run.hasher

        def lookup(request, *args, **kwargs):
            t0 = time.thread_time()
            out = real_lookup(request, *args, **kwargs)
            self.calls_ms[request.request_id] += (time.thread_time() - t0) * 1e3
            return out

        def allocate(request, *args, **kwargs):
            admitting = request.status != running and request.request_id not in self.samples
            t0 = time.thread_time()
            out = real_allocate(request, *args, **kwargs)
            if admitting:
                rid = request.request_id
                self.calls_ms[rid] += (time.thread_time() - t0) * 1e3
                if out is not None:
                    self.samples[rid] = (self.hash_ms.pop(rid, 0.0), self.calls_ms.pop(rid))
            return out

        def hasher(request):
            t0 = time.thread_time()
            out = real_hasher(request)
            if not request.num_output_tokens:  # (the prompt, as the request is built)
                self.hash_ms[request.request_id] += (time.thread_time() - t0) * 1e3
            return out

        kvm.get_computed_blocks, kvm.allocate_slots = lookup, allocate
        if real_hasher is not None:
            run.hasher = hasher


def measure_admissions(h, classes: dict, prompts: list[Prompt], targets: list[int],
                       args: argparse.Namespace) -> tuple[list[dict], dict[str, float | None]]:
    """vLLM's and gpukv's per-admission costs by prompt bucket, over one run
    of each per target (the same requests admitted, checked); with
    ``classes["device"]`` the device twin's too (``device_admissions``), and
    its host time's slope in prompt blocks (``add_device_admissions``)."""
    samples: dict[str, list[tuple[str, float, float]]] = {"vllm": [], "gpukv": [], "vllm_after": []}
    device: dict[str, list[dict]] = defaultdict(list)  # column: one pseudo-row per admission
    beside: dict[str, list[tuple[str, float, float]]] = defaultdict(list)  # column: vLLM's lockstep samples
    for target in targets:
        options = config(prompts, target, args.long_prefill_token_threshold)
        runs = {}
        for name in ("vllm", "gpukv"):
            runs[name], got = admission_run(h, classes[name], prompts, target, options, args)
            samples[name] += got
        same_work(f"per admission, {classes['gpukv'].__name__} at {target}", runs["vllm"], runs["gpukv"])
        if "device" in classes:
            for key, batched, worker in ADMISSION_COLUMNS:
                if worker and not args.worker:
                    continue
                t0 = time.perf_counter()
                cls = classes["batched" if batched else "device"]
                admitted, lockstep = device_admissions(h, cls, prompts, target, options, args, runs["vllm"], worker,
                                                       classes["vllm"], batched)
                device[key] += admitted
                beside[key] += lockstep
                print(f"  {cls.__name__} per admission{' (worker binding)' if worker else ''} at {target}: "
                      f"{time.perf_counter() - t0:.0f} s", file=sys.stderr)
            # vLLM's pass again, after the device runs: the device's ratio is given against both (vLLM's
            # figures have read up to 1.9x apart between runs of one tree).
            runs["vllm_after"], got = admission_run(h, classes["vllm"], prompts, target, options, args)
            samples["vllm_after"] += got
            same_work(f"per admission, vLLM again at {target}", runs["vllm"], runs["vllm_after"])
    rows = []
    for low, _ in BUCKETS:
        name = bucket_of(low)
        v = [(hs, cs) for b, hs, cs in samples["vllm"] if b == name]
        g = [cs for b, _, cs in samples["gpukv"] if b == name]
        after = [hs + cs for b, hs, cs in samples["vllm_after"] if b == name]
        row: dict[str, Any] = {"bucket": name, "admissions": len(v)}
        if v and g:
            row.update(vllm_hash_p50_ms=pct([hs for hs, _ in v], 50), vllm_calls_p50_ms=pct([cs for _, cs in v], 50),
                       vllm_p50_ms=pct([hs + cs for hs, cs in v], 50), gpukv_p50_ms=pct(g, 50))
            row["ratio_p50"] = row["gpukv_p50_ms"] / row["vllm_p50_ms"]
            if after:
                row["vllm_after_p50_ms"] = pct(after, 50)
        rows.append(row)
    return rows, add_device_admissions(rows, device, beside, args) if device else {}


def admission_run(h, cls: type, prompts: list[Prompt], target: int, options: dict,
                  args: argparse.Namespace) -> tuple[TraceRun, list[tuple[str, float, float]]]:
    """One run of ``cls`` with its admission calls timed (``AdmissionTimer``):
    the run, and per admitted request (bucket, hashing ms, calls ms)."""
    blocks = {str(p.index): p.blocks for p in prompts}
    gc.collect()
    run = TraceRun(h, cls, prompts, target, options)
    timer = AdmissionTimer(h, run)
    run.run(args.fill_steps, args.warmup, args.steps)
    return run, [(bucket_of(blocks[rid]), hash_ms, calls_ms) for rid, (hash_ms, calls_ms) in timer.samples.items()]


def _admission_key(h):
    """``DeviceTwin.attribute``'s key for the admission calls (``AdmissionTimer``'s):
    every lookup, and an allocation for a request not yet running."""
    running = h.RequestStatus.RUNNING

    def lookup(request, *_args, **_kwargs):
        return request.request_id

    def allocate(request, *_args, **_kwargs):
        return request.request_id if request.status != running else None

    return lookup, allocate


def device_admissions(h, cls: type, prompts: list[Prompt], target: int, options: dict, args: argparse.Namespace,
                      ref: TraceRun, worker: bool, beside_cls: type,
                      batched: bool = False) -> tuple[list[dict], list[tuple]]:
    """The device twin per admission (module docstring): ``cls`` (gpukv's
    unbatched device scheduler; with ``batched`` its batched one, the
    running loop's growth applied first, outside the admission's calls:
    ``apply_running_growth_first``) on ``ref``'s plan, checked to do its
    work, every step's launches recorded and each admission's calls
    attributed (``DeviceTwin.attribute``); one pseudo-row per admission, as
    ``device_twin``'s per step (``launch_list`` still in, ``bucket`` and the
    ``step`` that admitted it added). Beside them, ``beside_cls`` (vLLM's
    scheduler) stepped in lockstep with the twin's steps (each of its steps
    just before the twin's same step), its admissions timed as
    ``admission_run``'s: (bucket, hashing ms, calls ms) per admitted
    request, figures from the same minutes as the twin's."""
    gc.collect()
    with worker_bound(options, worker):
        real = TraceRun(h, cls, prompts, target, options)
        twin = None if real.sched.kv_cache_manager.manager.device.type == "cuda" else \
            TraceRun(h, cls, prompts, target, options)
    if twin is None:
        raise SystemExit("the device per admission is the interpreter twin's: it needs a machine without CUDA")
    if args.prepare:
        prepare_as_on_cuda(real, twin)
    device = DeviceTwin(real, twin, _step_out, digest)
    lookup, allocate = _admission_key(h)
    device.attribute("get_computed_blocks", lambda run: run.sched.kv_cache_manager, lookup)
    device.attribute("allocate_slots", lambda run: run.sched.kv_cache_manager, allocate)
    if batched:
        for run in (real, twin):
            apply_running_growth_first(run.sched.kv_cache_manager)
    rows: list[dict] = []
    real.run(args.fill_steps, args.warmup, args.steps, lambda _timed: rows.append(device.real_step(True)))
    same_work(f"per admission, {cls.__name__}{' (worker binding)' if worker else ''} at {target}", ref, real)
    if worker and not all(r.sched.kv_cache_manager.ids_on_device for r in (real, twin)):
        raise SystemExit(f"{cls.__name__} at {target}: the worker's binding did not take (block ids still read back)")
    gc.collect()
    lockstep = TraceRun(h, beside_cls, prompts, target, options)
    timer = AdmissionTimer(h, lockstep)
    device.twin_steps(rows, lambda _i: lockstep.step())
    same_work(f"per admission, {beside_cls.__name__} stepped beside {cls.__name__} at {target}", ref, lockstep)
    blocks = {str(p.index): p.blocks for p in prompts}
    calls = [dict(c, step=i) for i, r in enumerate(rows) for c in r["calls"]]
    admitted = [dict(a, bucket=bucket_of(blocks[rid]), blocks=blocks[rid]) for rid, a in admissions_of(calls).items()]
    return admitted, [(bucket_of(blocks[rid]), hs, cs) for rid, (hs, cs) in timer.samples.items()]


def apply_running_growth_first(adapter: Any) -> None:
    """The batched device scheduler's admission timed alone: its waiting run
    is admitted as one gpukv step inside the run's first lookup, which also
    applies the running loop's answered allocations (``PendingGrowth.flush``:
    that step's running phase, no admission's cost). Here they are applied
    as a step of their own just before that lookup, outside the attributed
    calls, so the admission's step is the waiting run alone, paying the
    whole fixed cost of a step that in the engine it shares with the
    running phase. The decisions are the same (the run's step applies them
    first too; the run is checked to do vLLM's work)."""
    lookup = adapter.get_computed_blocks  # (the attributed one: this wraps it from outside)

    def get_computed_blocks(request: Any, *args: Any, **kwargs: Any) -> Any:
        if adapter.pending.calls:
            adapter.pending.flush()
        return lookup(request, *args, **kwargs)

    adapter.get_computed_blocks = get_computed_blocks


def admissions_of(calls: list[dict]) -> dict[str, dict]:
    """Each admitted request's calls (``DeviceTwin.attribute``'s records, in
    order) summed up to the allocation that admitted it: a pseudo-row
    ``device_twin.device_summary`` reads, with the ``step`` of that
    allocation where the calls carry one."""
    open_: dict[str, dict] = {}
    done: dict[str, dict] = {}
    for c in calls:
        rid = c["key"]
        if rid in done:
            continue
        a = open_.setdefault(rid, {"launches": 0, "replayed": 0, "reads": 0, "host_ms": 0.0, "launch_list": [],
                                   "counts": dict.fromkeys(COUNTED, 0)})
        for k in ("launches", "replayed", "reads", "host_ms"):
            a[k] += c[k]
        a["launch_list"] += c["launch_list"]
        for k in COUNTED:
            a["counts"][k] += c["counts"][k]
        if c["call"] == "allocate_slots" and c["returned"]:
            done[rid] = open_.pop(rid)
            if "step" in c:
                done[rid]["step"] = c["step"]
    return done


#: Per-admission figures a step admitting several requests shares out equally (``share_admitting_steps``).
SHARED_FIELDS = ("launches", "replayed", "reads", "host_ms", "launch_path_ms", "stated_ms", "honest_ms")


def share_admitting_steps(admitted: list[dict]) -> None:
    """The batched scheduler admits a waiting run of K requests in one gpukv
    step, made inside the first one's lookup (the others' calls are answered
    from it): each of the K gets the mean of their figures (``SHARED_FIELDS``
    and the counts), and ``shared`` = K (1: admitted alone). In place, after
    the launch path (``add_launch_path``), so that each launch is timed once."""
    by_step: dict[int, list[dict]] = defaultdict(list)
    for a in admitted:
        by_step[a["step"]].append(a)
    for group in by_step.values():
        if len(group) == 1:  # (admitted alone: its own figures)
            group[0]["shared"] = 1
            continue
        means = {f: float(np.mean([a[f] for a in group])) for f in SHARED_FIELDS
                 if all(a.get(f) is not None for a in group)}
        counts = {c: float(np.mean([a["counts"][c] for a in group])) for c in group[0]["counts"]}
        for a in group:
            a.update(means, shared=len(group), counts=dict(counts))


def add_device_admissions(rows: list[dict], device: dict[str, list[dict]],
                          beside: dict[str, list[tuple[str, float, float]]],
                          args: argparse.Namespace) -> dict[str, float | None]:
    """The device columns of the per-admission rows: each bucket's admissions'
    honest figure (``device_twin.add_launch_path``: the launch path of their
    own launches) summarised, its ratio to vLLM's total p50 and to the p50 of
    vLLM stepped beside the twin (``beside``, per column), and the twin
    host time's slope in prompt blocks over the admissions of 64 blocks and
    more (a flat host cost: about 0), returned per column, in us a block."""
    by_key = {f"{key} {r['bucket']}": [a for a in admitted if a["bucket"] == r["bucket"]]
              for key, admitted in device.items() for r in rows}
    why = add_launch_path(by_key, args.costs, args.launch_samples)
    for key in device:
        if key in BATCHED_KEYS:
            share_admitting_steps(device[key])
        for r in rows:
            mine = by_key[f"{key} {r['bucket']}"]
            if not mine:
                continue
            d = device_summary(mine)
            d.pop("first_host_ms", None)
            if key in BATCHED_KEYS:
                alone = [a["honest_ms"] for a in mine if a["shared"] == 1 and a.get("honest_ms") is not None]
                d["shared_mean"] = float(np.mean([a["shared"] for a in mine]))
                d["alone"] = {"admissions": sum(a["shared"] == 1 for a in mine),
                              "honest_p50_ms": pct(alone, 50) if alone else None}
            d["blocks_mean"] = float(np.mean([a["blocks"] for a in mine]))
            figure = d.get("honest_ms")
            if figure and r.get("vllm_p50_ms"):
                d["ratio_p50"] = figure["p50"] / r["vllm_p50_ms"]
                vllm = [r["vllm_p50_ms"], r.get("vllm_after_p50_ms", r["vllm_p50_ms"])]
                d["ratio_p50_range"] = [figure["p50"] / max(vllm), figure["p50"] / min(vllm)]
            lockstep = [hs + cs for b, hs, cs in beside.get(key, ()) if b == r["bucket"]]
            if figure and lockstep:
                d["vllm_beside_p50_ms"] = pct(lockstep, 50)
                d["ratio_beside"] = figure["p50"] / d["vllm_beside_p50_ms"]
            r[key] = d
    for r in rows:
        r["launch_path_unmeasured"] = why
    slopes = {}
    for key, admitted in device.items():
        long = [a for a in admitted if a["blocks"] >= 64]
        xs, ys = [a["blocks"] for a in long], [a["host_ms"] for a in long]
        slopes[key] = float(np.polyfit(xs, ys, 1)[0]) * 1e3 if len(set(xs)) > 1 else None
    return slopes


# ------------------------------------------------------------------ output
def _device_figure(d: dict) -> dict | None:
    """The device column's figure: the honest twin's, or on CUDA the wall time (None: not measured)."""
    return d.get("honest_ms") or d.get("wall_ms")


#: The device columns: a row's key, and its name in the tables.
DEVICE_COLUMNS = (("device", "gpukv device"), ("worker", "gpukv device, worker binding"))
#: The per-admission device columns: (key, the batched scheduler's, bound as under gpukv's worker).
ADMISSION_COLUMNS = (("device", False, False), ("worker", False, True), ("batched", True, False),
                     ("batched_worker", True, True))
BATCHED_KEYS = frozenset(key for key, batched, _ in ADMISSION_COLUMNS if batched)


def print_step_table(rows: list[dict]) -> None:
    columns = [(key, name) for key, name in DEVICE_COLUMNS if any(key in r for r in rows)]
    print("| target | running (mean, min-max) | prefix hits | vLLM p50 (p99) ms | gpukv reference p50 (p99) ms "
          "| ratio gpukv/vLLM p50 [per repeat] |"
          + "".join(f" {name} p50 (p99) ms | ratio {key}/vLLM p50 [against vLLM stepped beside it, its p50 ms] |"
                    for key, name in columns))
    print("| ---: | ---: | ---: | ---: | ---: | ---: |" + " ---: | ---: |" * len(columns))
    for r in rows:
        v, g = r["vllm"], r["gpukv"]
        lo, hi = min(r["ratio_p50_per_repeat"]), max(r["ratio_p50_per_repeat"])
        line = (f"| {r['target']} | {r['running_mean']:.1f} ({r['running_min']}-{r['running_max']}) "
                f"| {100 * r['hit_tokens'] / r['prompt_tokens']:.0f}% of {r['requests_scheduled']} prompts "
                f"| {v['p50_ms']:.3f} ({v['p99_ms']:.3f}) | {g['p50_ms']:.3f} ({g['p99_ms']:.3f}) "
                f"| {r['ratio_p50']:.2f}x [{lo:.2f}-{hi:.2f}] |")
        for key, _ in columns:
            d = r.get(key, {})
            f = _device_figure(d)
            beside = d.get("vllm_beside", v)["p50_ms"]
            line += (f" {f['p50']:.3f} ({f['p99']:.3f}) | {f['p50'] / v['p50_ms']:.2f}x [{f['p50'] / beside:.2f}x,"
                     f" {beside:.3f}] |" if f else " - | - |")
        print(line)


def print_split_table(rows: list[dict]) -> None:
    """vLLM's step split (``measure_split``): one line per target."""
    print("| target | vLLM step p50 ms | the same, its manager timed | timed calls/step | in its manager + hashing "
          "p50 (mean) ms, at most | outside it p50 (mean) ms, at least | outside / step p50, at least |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        d = r["vllm_split"]
        print(f"| {r['target']} | {d['step_p50_ms']:.3f} | {d['timed_step_p50_ms']:.3f} | {d['calls_mean']:.0f} "
              f"| {d['manager_p50_ms']:.3f} ({d['manager_mean_ms']:.3f}) "
              f"| {d['outside_p50_ms']:.3f} ({d['outside_mean_ms']:.3f}) | {d['outside_share']:.2f} |")


def print_twin_split_table(rows: list[dict]) -> None:
    """The device twins' step split (``twin_manager_split``) beside vLLM's
    manager: one line per target and device column."""
    print("| target | binding | gpukv's calls/step | in gpukv's calls p50 (mean) ms, twin host | the same with "
          "launch path and stated costs | vLLM's manager + hashing p50 (mean) ms | ratio gpukv/vLLM, means "
          "| the second twin's step p50 ms, its calls timed | outside gpukv's calls p50 ms, at least |")
    print("| ---: | --- |" + " ---: |" * 7)
    for r in rows:
        v = r["vllm_split"]
        for key, _ in DEVICE_COLUMNS:
            d = r.get(key, {}).get("manager_split")
            if d is None:
                continue
            gpu = f"{d['manager_p50_ms']:.3f} ({d['manager_mean_ms']:.3f})" if d["gpu_parts_measured"] else "-"
            print(f"| {r['target']} | {'worker' if key == 'worker' else 'none'} | {d['calls_mean']:.0f} "
                  f"| {d['manager_host_p50_ms']:.3f} ({d['manager_host_mean_ms']:.3f}) | {gpu} "
                  f"| {v['manager_p50_ms']:.3f} ({v['manager_mean_ms']:.3f}) "
                  f"| {d['manager_mean_ms'] / v['manager_mean_ms']:.2f}x | {d['timed_step_p50_ms']:.3f} "
                  f"| {d['outside_p50_ms']:.3f} |")


def print_device_table(rows: list[dict], costs: GpuCosts) -> None:
    """The honest twin's counts and parts per step, each stated cost beside
    its count: one line per target and device column."""
    print(f"| target | binding | {twin_head(costs)} | first timed step / others' p50 host ms |")
    print("| ---: | --- |" + " ---: |" * 11)
    for r in rows:
        for key, _ in DEVICE_COLUMNS:
            if key not in r:
                continue
            d = r[key]
            first = d.get("first_host_ms")
            print(f"| {r['target']} | {'worker' if key == 'worker' else 'none'} | " + " | ".join(twin_cells(d))
                  + (f" | {first['first']:.3f} / {first['p50_others']:.3f} |" if first else " | - |"))


def print_admission_table(rows: list[dict]) -> None:
    print("| prompt blocks of 16 | admissions | vLLM hashing p50 ms | vLLM lookup + allocate p50 ms "
          "| vLLM total p50 ms | gpukv lookup + allocate p50 ms | ratio gpukv/vLLM p50 |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        if "ratio_p50" not in r:
            print(f"| {r['bucket']} | {r['admissions']} | - | - | - | - | - |")
            continue
        print(f"| {r['bucket']} | {r['admissions']} | {r['vllm_hash_p50_ms']:.3f} | {r['vllm_calls_p50_ms']:.3f} "
              f"| {r['vllm_p50_ms']:.3f} | {r['gpukv_p50_ms']:.3f} | {r['ratio_p50']:.2f}x |")


def print_device_admission_table(rows: list[dict], slopes: dict[str, float | None], costs: GpuCosts) -> None:
    """The device twin per admission, by bucket and binding: its counts,
    each stated cost beside its count, and its honest p50 against vLLM's
    total p50 (the table above); then the twin host time's slope."""
    head = twin_head(costs).replace("launches/step", "launches/admission")
    print(f"| prompt blocks of 16 | scheduler | binding | admissions | mean blocks | vLLM total p50 ms, before / after "
          f"the device runs | {head} | ratio device/vLLM p50 [against each vLLM pass] | vLLM stepped beside it: p50 "
          f"ms, ratio | admissions per step, mean; admitted alone: count, honest p50 ms |")
    print("| --- | --- | --- |" + " ---: |" * 16)
    for key, batched, worker in ADMISSION_COLUMNS:
        for r in rows:
            d = r.get(key)
            if d is None:
                continue
            ratio = "-"
            if "ratio_p50" in d:
                lo, hi = d.get("ratio_p50_range", [d["ratio_p50"]] * 2)
                ratio = f"{d['ratio_p50']:.2f}x [{lo:.2f}-{hi:.2f}]"
            vllm = "-" if "vllm_p50_ms" not in r else f"{r['vllm_p50_ms']:.3f}" + (
                f" / {r['vllm_after_p50_ms']:.3f}" if "vllm_after_p50_ms" in r else "")
            lockstep = (f"{d['vllm_beside_p50_ms']:.3f}, {d['ratio_beside']:.2f}x" if "ratio_beside" in d
                        else "-")
            alone = "-"
            if batched:
                p50 = d["alone"]["honest_p50_ms"]
                alone = f"{d['shared_mean']:.2f}; {d['alone']['admissions']}, " + ("-" if p50 is None else f"{p50:.3f}")
            print(f"| {r['bucket']} | {'batched' if batched else 'unbatched'} | {'worker' if worker else 'none'} "
                  f"| {d['steps']} | {d['blocks_mean']:.0f} | {vllm} | " + " | ".join(twin_cells(d))
                  + f" | {ratio} | {lockstep} | {alone} |")
    for key, slope in slopes.items():
        text = "-" if slope is None else f"{slope:.3f} us"
        print(f"Twin host time per admission, slope in prompt blocks from 64 up ({key}): {text} a block.")
    whys = sorted({r["launch_path_unmeasured"] for r in rows if r.get("launch_path_unmeasured")})
    if whys:
        print(f"The launch path was not measured ({'; '.join(whys)}): no honest figure.")


MODES = (("Scheduler", "VllmScheduler", "ReferenceScheduler", "DeviceScheduler"),
         ("AsyncScheduler", "VllmAsyncScheduler", "ReferenceAsyncScheduler", "DeviceAsyncScheduler"))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    full = dict(targets=[40, 200], max_requests=600, fill_steps=400, warmup=20, steps=300, repeats=3)
    quick = dict(targets=[4, 8], max_requests=30, fill_steps=20, warmup=2, steps=5, repeats=2)
    p.add_argument("--targets", type=int, nargs="+", help=f"running requests to hold (default {full['targets']})")
    p.add_argument("--max-requests", type=int, help=f"trace requests loaded, the first ones ({full['max_requests']})")
    p.add_argument("--fill-steps", type=int, help=f"at most this many steps to reach the target ({full['fill_steps']})")
    p.add_argument("--warmup", type=int, help=f"untimed steps after the fill ({full['warmup']})")
    p.add_argument("--steps", type=int, help=f"timed steps per run ({full['steps']})")
    p.add_argument("--repeats", type=int, help=f"runs of each, vLLM and gpukv alternating ({full['repeats']})")
    p.add_argument("--schedulers", nargs="+", choices=[m[0] for m in MODES], default=[m[0] for m in MODES])
    p.add_argument("--long-prefill-token-threshold", type=int, default=0, metavar="N",
                   help="cap each request's prefill chunk at N tokens (vLLM's option; 0: none, its default)")
    p.add_argument("--no-admissions", dest="admissions", action="store_false",
                   help="skip the per-admission pass")
    p.add_argument("--device", action="store_true",
                   help="also gpukv's DeviceScheduler / DeviceAsyncScheduler, once per row on the plan vLLM's runs "
                        "follow: without CUDA its honest twin (benchmarks/device_twin.py; its kernels run under "
                        "Triton's interpreter, seconds per admitted request: use a small --targets and few "
                        "--steps)")
    p.add_argument("--worker", action="store_true",
                   help="--device: also the device scheduler built as under gpukv.vllm.Worker (its runner reads "
                        "gpukv's tables: no block id read back, none in SchedulerOutput), a column beside the "
                        "unbound one")
    p.add_argument("--cold-buckets", dest="prepare", action="store_false",
                   help="--device: skip the admission buckets' preparation the scheduler makes at start on CUDA "
                        "(prepare_admissions_at_start), so each prompt length's first admission pays its "
                        "first-time launches, as before it")
    p.add_argument("--launch-samples", type=int, default=5,
                   help="--device without CUDA: samples of each step's launch path (5)")
    p.add_argument("--gpu-costs", help="--device without CUDA: the stated costs, us, as name=us,... over the "
                                       f"defaults ({', '.join(f'{k}={v}' for k, v in vars(GpuCosts()).items())})")
    p.add_argument("--quick", action="store_true",
                   help="smoke run (options given still apply): " + ", ".join(f"{k}={v}" for k, v in quick.items()))
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for key in ("max_requests", "steps", "repeats"):
        if getattr(args, key) < 1:
            p.error(f"--{key.replace('_', '-')} must be at least 1")
    if min(args.targets) < 1:
        p.error("--targets must be at least 1")
    if args.long_prefill_token_threshold < 0:
        p.error("--long-prefill-token-threshold must be at least 0 (0: none)")
    if args.worker and not args.device:
        p.error("--worker needs --device")
    args.costs = GpuCosts.parse(args.gpu_costs)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    h = load_harness()
    if h is None:
        print(f"vLLM 0.33 or later's test harness ({HARNESS}) is not importable: nothing measured", file=sys.stderr)
        return 1
    torch.set_num_threads(1)
    if args.device and not torch.cuda.is_available():
        launch_cost().install()  # before any manager prepares its launches (host stand-ins recordable)
        interpreter_shortcut.install()  # the real run's kernels faster; nothing timed changes
    gk = importlib.import_module("gpukv.vllm.v0_33")
    prompts = load_prompts(args.max_requests)
    t_all = time.perf_counter()
    tables = []
    for name, vllm_cls, gpukv_cls, device_cls in MODES:
        if name not in args.schedulers:
            continue
        classes = {"vllm": getattr(h, vllm_cls), "gpukv": getattr(gk, gpukv_cls)}
        if args.device:
            classes["device"] = getattr(gk, device_cls)
        rows = []
        for target in args.targets:
            t0 = time.perf_counter()
            rows.append(measure_row(h, classes, prompts, target, args))
            print(f"  {name} at {target}: ratio {rows[-1]['ratio_p50']:.2f}x ({time.perf_counter() - t0:.0f} s)",
                  file=sys.stderr)
        tables.append({"scheduler": name, "gpukv": gpukv_cls, "device": device_cls if args.device else None,
                       "rows": rows})
    admissions: list[dict] = []
    slopes: dict[str, float | None] = {}
    if args.admissions:
        t0 = time.perf_counter()
        classes = {"vllm": h.VllmScheduler, "gpukv": gk.UnbatchedReferenceScheduler}
        if args.device and torch.cuda.is_available():
            print("note: the device per admission is the interpreter twin's (no CUDA); on a GPU not measured",
                  file=sys.stderr)
        elif args.device:
            classes["device"], classes["batched"] = gk.UnbatchedDeviceScheduler, gk.DeviceScheduler
        admissions, slopes = measure_admissions(h, classes, prompts, args.targets, args)
        print(f"  per admission: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    report(h, args, tables, {"rows": admissions, "device_host_us_per_block": slopes}, time.perf_counter() - t_all)
    return 0


def report(h, args: argparse.Namespace, tables: list[dict], per_admission: dict, seconds: float) -> None:
    """The tables, and the JSON (``--json``). ``per_admission``: its bucket
    ``rows`` and the device twin's ``device_host_us_per_block``."""
    admissions = per_admission["rows"]
    try:
        load = "load average {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())
    except OSError:
        load = "load average unknown"
    where = f"CPU ({platform.machine()}, {os.cpu_count()} cores)"
    version = h.vllm_version()
    print(f"Engine step (arrivals' hashing + schedule() + update_from_output()) on the Mooncake conversation "
          f"trace (first {args.max_requests} requests) under vLLM {version}: {where}; gpukv {gpukv.__version__}, "
          f"torch {torch.__version__}; {load} at the end; {seconds:.0f} s; long-prefill threshold "
          f"{args.long_prefill_token_threshold or 'none'}. Thread CPU ms, p50 (p99) over "
          f"{args.repeats} x {args.steps} steps, vLLM and gpukv alternating per repeat; prefix-cache hits and "
          "scheduled tokens equal request by request.")
    cuda = torch.cuda.is_available()
    for t in tables:
        device = f" and {t['device']}" + ("" if cuda else " (its honest twin: host time + stated GPU costs)")
        print(f"\nvLLM's {t['scheduler']} against gpukv's {t['gpukv']}{device if t['device'] else ''}:")
        print_step_table(t["rows"])
        print(f"\nvLLM's {t['scheduler']} step split (two more runs in lockstep: one plain, one with its KV-cache "
              "manager's calls and its arrivals' hashing timed through wrappers; outside them: scheduler code that "
              "runs whatever the manager):")
        print_split_table(t["rows"])
        if t["device"] and not cuda:
            print(f"\n{t['device']}'s honest twin, per timed step (one run on vLLM's plan):")
            print_device_table(t["rows"], args.costs)
            whys = sorted({r["launch_path_unmeasured"] for r in t["rows"] if r.get("launch_path_unmeasured")})
            if whys:
                print(f"The launch path was not measured ({'; '.join(whys)}): no honest figure.")
            print(f"\n{t['device']}'s step split (a second twin through the same steps, its manager's calls timed "
                  "as vLLM's are; the launch path and stated costs of each step are made inside the calls):")
            print_twin_split_table(t["rows"])
    if admissions:
        print("\nPer admission (vLLM's Scheduler against gpukv's UnbatchedReferenceScheduler; calls timed through "
              "wrappers):")
        print_admission_table(admissions)
        if any(key in r for r in admissions for key, _, _ in ADMISSION_COLUMNS):
            print("\nPer admission, gpukv's device schedulers' honest twins on vLLM's plan, the same requests "
                  "(unbatched: UnbatchedDeviceScheduler, each admission's lookup and allocation attributed; batched: "
                  "DeviceScheduler, each waiting run's one step, the running loop's growth applied as a step of its "
                  "own before it, shared equally by the run's admissions):")
            print_device_admission_table(admissions, per_admission["device_host_us_per_block"], args.costs)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"where": where, "vllm": version, "gpukv": gpukv.__version__, "torch": torch.__version__,
                       "python": sys.version.split()[0], "load": load, "seconds": seconds,
                       "max_requests": args.max_requests, "targets": args.targets, "fill_steps": args.fill_steps,
                       "warmup": args.warmup, "steps": args.steps, "repeats": args.repeats,
                       "long_prefill_token_threshold": args.long_prefill_token_threshold,
                       "hits_equal": True, "device": args.device, "worker": args.worker, "cuda": cuda,
                       "gpu_costs": vars(args.costs) if args.device else None,
                       "tables": tables, "admissions": admissions,
                       "device_host_us_per_block": per_admission["device_host_us_per_block"]}, f, indent=1)


if __name__ == "__main__":
    raise SystemExit(main())
