"""Hit rate against cache capacity: one trace replayed at several pool sizes,
in parallel processes, beside the ceiling (a cache that never evicts).

Sizes come in blocks, in tokens (rounded down to whole blocks) or in GiB of
KV cache for a model described by its layers, KV heads, head size and dtype
(``gpukv.get_kv_cache_config`` turns the memory into blocks). A pool is
counted as vLLM counts ``num_gpu_blocks``: its blocks include block 0, the
null block, which holds no tokens; so ``N`` blocks hold ``(N - 1) *
block_size`` tokens (a point's ``capacity`` in tokens), and ``T`` tokens take
``T // block_size`` blocks and the null block. A size in GiB is the memory
of all ``N`` blocks, as vLLM allocates them. Every point is
an independent ``Replay`` on the reference manager with the same options, so
points differ only in the pool. The trace is parsed once and handed to the
workers; the ceiling is one pass over the prompts against a cache that never
evicts (``gpukv.tools.replay.no_eviction_hit_rate``), not a replay: it is what a
replay in a pool holding every token of every request reaches. The hit rate
reported is vLLM's (the managers' ``PrefixCacheStats``: tokens hit over
tokens looked up, re-admissions after a preemption apart); each request's
first admission is reported beside it.

A point whose pool cannot hold one request of ``max_model_len`` tokens (vLLM
refuses to start with such a cache), or that rejected requests, is flagged
(``holds_max_model_len``, ``rejected``) and listed in ``warnings``: it
served fewer requests than the others, so its hit rate is not comparable.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import time
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from gpukv.tools.replay import Replay, ReplayOptions, no_eviction_hit_rate
from gpukv.tools.traces import Trace, load_trace


@dataclass(frozen=True)
class ModelShape:
    """What a GiB of KV cache holds: ``num_layers`` full-attention layers of
    ``num_kv_heads`` heads of ``head_size``, in ``dtype``."""

    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: str = "float16"

    def bytes_per_block(self, block_size: int) -> int:
        """K and V of one block in every layer."""
        itemsize = getattr(torch, self.dtype).itemsize
        return 2 * self.num_layers * self.num_kv_heads * self.head_size * block_size * itemsize

    def gib_of(self, num_blocks: int, block_size: int) -> float:
        """The GiB ``num_blocks`` blocks take."""
        return num_blocks * self.bytes_per_block(block_size) / 2**30

    def blocks_for(self, gib: float, block_size: int) -> int:
        from gpukv.sizing.config import get_kv_cache_config
        from gpukv.sizing.spec import FullAttentionSpec, KVCacheSpec

        dtype = getattr(torch, self.dtype)
        spec: dict[str, KVCacheSpec] = {
            f"layer.{i}": FullAttentionSpec(block_size, self.num_kv_heads, self.head_size, dtype)
            for i in range(self.num_layers)}
        cfg = get_kv_cache_config(spec, available_memory=int(gib * 2**30), max_model_len=block_size)
        return cfg.num_blocks


def ceiling_blocks(trace, block_size: int) -> int:
    """A pool that holds every token of every request at once (and the null
    block): nothing in it is ever evicted or preempted."""
    total = 0
    for r in trace.requests:
        total += -(-(r.input_length + (r.output_length or 0)) // block_size)
    return total + 1


def holds_max_model_len(num_blocks: int, block_size: int, max_model_len: int) -> bool:
    """Whether a pool of ``num_blocks`` (the null block included) holds one
    request of ``max_model_len`` tokens; vLLM refuses to start when it does not."""
    return num_blocks - 1 >= -(-max_model_len // block_size)


# A worker's channel to the parent for progress: (point index, requests done, step).
_PROGRESS: queue.Queue | None = None
PROGRESS_INTERVAL_S = 0.5  # a worker reports at most this often, unless a request finished


def _init_worker(progress) -> None:
    global _PROGRESS
    _PROGRESS = progress


def _reporter(index: int, sink: Callable[[tuple[int, int, int]], None]) -> Callable[[int, int], None]:
    """An ``on_progress`` for point ``index``: sends (index, done, step) when
    a request finished, else at most every ``PROGRESS_INTERVAL_S``."""
    last = {"t": 0.0, "done": -1}

    def report(done: int, step: int) -> None:
        now = time.monotonic()
        if done != last["done"] or now - last["t"] >= PROGRESS_INTERVAL_S:
            last["t"], last["done"] = now, done
            sink((index, done, step))

    return report


class SizeRefused(ValueError):
    """A pool size the manager refuses (too large for its limits or this
    machine's memory). Its one argument is the message, so it crosses from a
    worker process to the parent intact (the managers' own errors take
    keyword arguments, which an exception's pickling drops)."""


def _run_point(job: tuple) -> dict:
    """One replay (a worker process's job, or the parent's with one job): the point's figures."""
    trace, opts, num_blocks, index = job
    on_progress = opts.on_progress
    if on_progress is None and _PROGRESS is not None:
        on_progress = _reporter(index, _PROGRESS.put)
    t0 = time.perf_counter()
    try:
        replay = Replay(trace, replace(opts, num_blocks=num_blocks, progress=False, ceiling=False,
                                       on_progress=on_progress))
    except MemoryError:
        raise SizeRefused(f"{num_blocks:,} blocks: not enough memory for the reference manager") from None
    except (ValueError, TypeError) as e:  # the manager's sizes and memory checks (gpukv.errors)
        raise SizeRefused(f"{num_blocks:,} blocks: {e}") from None
    report = replay.run()
    s = report["summary"]
    return {
        "num_blocks": num_blocks,
        "prefix_cache_hit_rate": s["prefix_cache_hit_rate"],
        "first_admission_hit_rate": s["first_admission_hit_rate"],
        "evictions": s["evictions"],
        "preemptions": s["preemptions"],
        "recomputed_tokens": s["recomputed_tokens"],
        "computed_tokens": s["computed_tokens"],
        "peak_demand_over_pool": s["peak_demand_over_pool"],
        "finished": s["finished"],
        "rejected": s["rejected"],
        "steps": s["steps"],
        "wall_s": time.perf_counter() - t0,
    }


class _Bars:
    """A tqdm bar per size (``gpukv.tools.replay``'s progress: live on a terminal,
    plain lines off one), each made when its replay starts and closed when
    it ends; fed (index, done, step) messages."""

    def __init__(self, enabled: bool, total: int, labels: list[str]) -> None:
        self.enabled, self.total, self.labels = enabled, total, labels
        self.bars: dict = {}
        self.closed: set[int] = set()

    def update(self, message: tuple[int, int, int]) -> None:
        from gpukv.tools.replay import _Progress

        index, done, step = message
        if index in self.closed:
            return  # a worker's last messages can come after its result
        if index not in self.bars:
            self.bars[index] = _Progress(self.enabled, self.total, self.labels[index], position=index)
        self.bars[index].update(done, step)

    def finish(self, index: int, done: int) -> None:
        """Point ``index`` is done: its bar shows ``done`` requests and stays."""
        bar = self.bars.pop(index, None)
        self.closed.add(index)
        if bar is not None:
            bar.update(done, bar.step)
            bar.close(bar.step)

    def close(self, ok: bool = True) -> None:
        for index in list(self.bars):
            bar = self.bars.pop(index)
            bar.close(bar.step, ok)


def run_sweep(trace_path: str | Path | Trace, sizes_blocks: list[int], opts: ReplayOptions, *, fmt: str = "auto",
              max_requests: int | None = None, arrival: str = "back-to-back", step_ms: float = 100.0,
              jobs: int | None = None, capacity_unit: str = "tokens", capacities: list[float] | None = None,
              trace_label: str | None = None, capacity_of=None, progress: bool = False,
              labels: list[str] | None = None, on_point: Callable[[int, dict], None] | None = None) -> dict:
    """Replay a trace (a path, loaded with ``fmt``, ``max_requests``,
    ``arrival`` and ``step_ms``, or a parsed ``Trace``) at each pool size
    (blocks, the null block included), ``jobs`` processes at a time, the
    smallest pools (the slowest: they preempt) first; the points in the order
    given, each with ``capacity`` in ``capacity_unit`` (``capacities``, or the
    tokens the pool holds: its blocks but the null block);
    ``capacity_of(num_blocks, block_size)`` gives the ceiling's in that unit
    when it is not tokens. ``progress``: a bar per size on stderr, named by
    ``labels``; ``on_point(i, point)`` is called as each point finishes. A
    size the manager refuses raises :class:`SizeRefused`."""
    if opts.backend != "reference":
        raise ValueError("a sweep replays on the reference manager (its processes would share one GPU)")
    trace = trace_path if isinstance(trace_path, Trace) else load_trace(
        trace_path, fmt, max_requests=max_requests, arrival=arrival, step_ms=step_ms)
    if trace.kind != "mooncake":
        raise ValueError("a sweep replays a Mooncake trace (a step trace fixes its own pool)")
    opts = replace(opts, metrics=None, progress=False, on_progress=None)
    bs = opts.block_size
    order = sorted(range(len(sizes_blocks)), key=lambda i: sizes_blocks[i])  # small pools take longest
    work = {i: (trace, opts, sizes_blocks[i], i) for i in order}
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(work) or 1))
    bars = _Bars(progress, trace.num_requests, labels or [f"{n:,} blocks" for n in sizes_blocks])
    results: dict[int, dict] = {}
    t0 = time.perf_counter()
    try:
        run = _run_serial if jobs == 1 else _run_parallel
        ceiling_rate = run(work, order, jobs, bars, results, on_point, trace, opts)
    except BaseException:
        bars.close(ok=False)
        raise
    bars.close()
    points = [results[i] for i in range(len(sizes_blocks))]
    for i, p in enumerate(points):
        p["capacity"] = capacities[i] if capacities is not None else pool_tokens(p["num_blocks"], bs)
        p["holds_max_model_len"] = holds_max_model_len(p["num_blocks"], bs, opts.max_model_len)
    return {
        "trace": trace_label or str(trace_path if not isinstance(trace_path, Trace) else "a parsed trace"),
        "num_requests": trace.num_requests,
        "block_size": bs,
        "max_model_len": opts.max_model_len,
        "capacity_unit": capacity_unit,
        "points": points,
        "ceiling": _ceiling_point(trace, opts, ceiling_rate, capacity_of),
        "warnings": point_warnings(points, bs, opts.max_model_len, capacity_unit),
        "wall_s": time.perf_counter() - t0,
        "options": {k: v for k, v in asdict(opts).items()
                    if k not in ("metrics", "hash_key", "progress", "on_progress", "ceiling")},
    }


def pool_tokens(num_blocks: int, block_size: int) -> int:
    """The tokens a pool of ``num_blocks`` holds: every block but the null block."""
    return (num_blocks - 1) * block_size


def _ceiling_point(trace: Trace, opts: ReplayOptions, rate: float | None, capacity_of) -> dict:
    """The ceiling as a point: a pool that holds every token of every request
    (and the null block), so nothing is evicted or preempted."""
    bs = opts.block_size
    top = ceiling_blocks(trace, bs)
    too_long = sum(r.input_length > opts.max_model_len for r in trace.requests)
    return {
        "num_blocks": top,
        "capacity": capacity_of(top, bs) if capacity_of is not None else pool_tokens(top, bs),
        "prefix_cache_hit_rate": rate,
        "first_admission_hit_rate": rate,
        "evictions": 0, "preemptions": 0, "recomputed_tokens": 0, "finished": trace.num_requests - too_long,
        "rejected": too_long,
        "holds_max_model_len": True,
    }


def _run_serial(work: dict, order: list[int], jobs: int, bars: _Bars, results: dict, on_point, trace,
                opts: ReplayOptions) -> float | None:
    """The points one after another in this process, then the ceiling's
    pass; ``_run_parallel``'s arguments (``jobs``, 1, unused). Returns the ceiling."""
    del jobs  # one at a time
    for i in order:
        trace, point_opts, num_blocks, index = work[i]
        results[i] = _run_point((trace, replace(point_opts, on_progress=_reporter(i, bars.update)), num_blocks, index))
        bars.finish(i, results[i]["finished"] + results[i]["rejected"])
        if on_point is not None:
            on_point(i, results[i])
    return no_eviction_hit_rate(trace, opts.block_size, opts.max_model_len)


def _run_parallel(work: dict, order: list[int], jobs: int, bars: _Bars, results: dict, on_point, trace,
                  opts: ReplayOptions) -> float | None:
    """The points in ``jobs`` spawned processes (nothing of this process, a
    CUDA context or threads, is inherited), their progress fed to ``bars``;
    the ceiling's pass runs here meanwhile. Returns the ceiling."""
    ctx = multiprocessing.get_context("spawn")
    channel = ctx.Queue()
    with ProcessPoolExecutor(jobs, mp_context=ctx, initializer=_init_worker, initargs=(channel,)) as pool:
        futures: dict[Future, int] = {pool.submit(_run_point, work[i]): i for i in order}
        ceiling_rate = no_eviction_hit_rate(trace, opts.block_size, opts.max_model_len)
        pending = set(futures)
        while pending:
            try:
                bars.update(channel.get(timeout=0.2))
                continue
            except queue.Empty:
                pass
            for future in [f for f in pending if f.done()]:
                pending.discard(future)
                i = futures[future]
                results[i] = future.result()  # a worker's exception is raised here
                bars.finish(i, results[i]["finished"] + results[i]["rejected"])
                if on_point is not None:
                    on_point(i, results[i])
        while True:  # what the workers sent last
            try:
                bars.update(channel.get_nowait())
            except queue.Empty:
                break
    return ceiling_rate


def point_warnings(points: list[dict], block_size: int, max_model_len: int, unit: str) -> list[str]:
    """What makes a point not comparable with the others, one line each."""
    out = []
    for p in points:
        size = capacity_text(p["capacity"], unit)
        size += f" ({p['num_blocks']:,} blocks)"
        if not p.get("holds_max_model_len", True):
            out.append(f"{size} cannot hold one request of max_model_len {max_model_len:,} tokens "
                       f"({-(-max_model_len // block_size):,} blocks and the null block); vLLM would refuse to start")
        if p.get("rejected"):
            out.append(f"{size} rejected {p['rejected']:,} requests: its hit rate is over fewer requests, "
                       "not comparable with the others")
    return out


def capacity_text(capacity: float, unit: str) -> str:
    """A size in its unit, as the table, the warnings and the notes write it."""
    return f"{capacity:,.4g} {unit}" if unit == "GiB" else f"{capacity:,} {unit}"


def default_sizes(trace, block_size: int, count: int = 4, max_model_len: int | None = None) -> list[int]:
    """Up to ``count`` pool sizes below the ceiling, halving from it, none
    smaller than the largest request needs (a pool that must reject a
    request is not comparable with one that serves it) or, given
    ``max_model_len``, than one such request needs: what to try when nothing
    is asked for."""
    top = ceiling_blocks(trace, block_size)
    least = max(-(-(r.input_length + (r.output_length or 0)) // block_size) for r in trace.requests) + 1
    if max_model_len is not None:
        least = max(least, -(-max_model_len // block_size) + 1)
    sizes = [top >> k for k in range(1, count + 1)]
    return sorted(n for n in sizes if n >= least) or [least]
