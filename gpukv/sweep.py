"""Hit rate against cache capacity: one trace replayed at several pool sizes,
in parallel processes, beside the ceiling (a pool that never evicts).

Sizes come in blocks, in tokens (rounded down to whole blocks) or in GiB of
KV cache for a model described by its layers, KV heads, head size and dtype
(``gpukv.get_kv_cache_config`` turns the memory into blocks). Every point is
an independent ``Replay`` on the reference manager with the same options, so
points differ only in the pool; the ceiling is the same replay with a pool
large enough to hold every token of every request at once, where nothing is
ever evicted or preempted. The hit rate reported is vLLM's (the managers'
``PrefixCacheStats``: tokens hit over tokens looked up, re-admissions after a
preemption apart); each request's first admission is reported beside it.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace

import torch

from gpukv.replay import Replay, ReplayOptions
from gpukv.traces import load_trace


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
        from gpukv import FullAttentionSpec, KVCacheSpec, get_kv_cache_config

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


def _run_point(job: tuple) -> dict:
    """One replay (a worker process's job): the point's figures."""
    trace_path, fmt, max_requests, opts, num_blocks = job
    trace = load_trace(trace_path, fmt, max_requests=max_requests)
    t0 = time.perf_counter()
    report = Replay(trace, replace(opts, num_blocks=num_blocks, progress=False)).run()
    s = report["summary"]
    return {
        "num_blocks": num_blocks,
        "prefix_cache_hit_rate": s["prefix_cache_hit_rate"],
        "first_admission_hit_rate": s["first_admission_token_hit_rate"],
        "evictions": s["evictions"],
        "preemptions": s["preemptions"],
        "rejected": s["rejected"],
        "steps": s["steps"],
        "wall_s": time.perf_counter() - t0,
    }


def run_sweep(trace_path: str, sizes_blocks: list[int], opts: ReplayOptions, *, fmt: str = "auto",
              max_requests: int | None = None, jobs: int | None = None, capacity_unit: str = "tokens",
              capacities: list[float] | None = None, trace_label: str | None = None,
              capacity_of=None) -> dict:
    """Replay ``trace_path`` at each pool size (blocks) and at the ceiling,
    ``jobs`` processes at a time; the points in the order given, each with
    ``capacity`` in ``capacity_unit`` (``capacities``, or the pool's tokens);
    ``capacity_of(num_blocks, block_size)`` gives the ceiling's in that unit
    when it is not tokens."""
    if opts.backend != "reference":
        raise ValueError("a sweep replays on the reference manager (its processes would share one GPU)")
    trace = load_trace(trace_path, fmt, max_requests=max_requests)
    if trace.kind != "mooncake":
        raise ValueError("a sweep replays a Mooncake trace (a step trace fixes its own pool)")
    top = ceiling_blocks(trace, opts.block_size)
    work = [(trace_path, fmt, max_requests, opts, n) for n in [*sizes_blocks, top]]
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(work)))
    if jobs == 1:
        results = [_run_point(job) for job in work]
    else:
        # Spawned workers: nothing of this process (a CUDA context, threads) is inherited.
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            results = list(pool.map(_run_point, work))
    *points, ceiling = results
    for i, p in enumerate(points):
        p["capacity"] = capacities[i] if capacities is not None else p["num_blocks"] * opts.block_size
    ceiling["capacity"] = capacity_of(top, opts.block_size) if capacity_of is not None else top * opts.block_size
    return {
        "trace": trace_label or str(trace_path),
        "num_requests": trace.num_requests,
        "block_size": opts.block_size,
        "capacity_unit": capacity_unit,
        "points": points,
        "ceiling": ceiling,
        "options": {k: v for k, v in asdict(opts).items() if k not in ("metrics", "hash_key", "progress")},
    }


def default_sizes(trace, block_size: int, count: int = 7) -> list[int]:
    """Up to ``count`` pool sizes below the ceiling, halving from it, none
    smaller than the largest request needs (a pool that must reject a
    request is not comparable with one that serves it): what to try when
    nothing is asked for."""
    top = ceiling_blocks(trace, block_size)
    least = max(-(-(r.input_length + (r.output_length or 0)) // block_size) for r in trace.requests) + 1
    sizes = [top >> k for k in range(1, count + 1)]
    return sorted(n for n in sizes if n >= least) or [least]
