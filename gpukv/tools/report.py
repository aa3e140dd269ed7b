"""The replay's report: what ``Replay.run()`` returns, and its ceiling.

``build_report`` takes a ``ReplayOutcome``, the values a finished replay
read once (``gpukv.tools.replay`` builds it): the configuration it ran with, each
request's record, the manager's final state and the series per step; it adds
the summary (requests, tokens, vLLM's prefix cache hit rate and its ceiling,
the pool's pressure, evictions, manager time). ``no_eviction_hit_rate`` is the
ceiling: the hit rate of the same trace against a cache that never evicts
(``gpukv.tools.replay`` re-exports it, and a sweep computes it once for all its
points). This module does not import ``gpukv.tools.replay``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from gpukv.tools.traces import Trace

if TYPE_CHECKING:
    from gpukv.core.metrics import PrefixCacheStats


@dataclass(frozen=True)
class ReplayOutcome:
    """What a finished replay hands its report: plain values, read from the
    replay and its manager once, in the report's units."""

    config: dict[str, Any]  # the configuration it ran with (the report's "config")
    requests: dict[str, dict[str, Any]]  # each request's record, by id, in arrival order
    trace: Trace  # for the ceiling
    ceiling: bool  # whether to compute the ceiling (Mooncake traces only)
    stats: PrefixCacheStats | None  # the manager's prefix-cache stats, None before any step
    totals: dict[str, int]  # prompt, cached, computed and recomputed tokens; admissions; preemptions
    running_at_end: int  # requests running when the replay stopped
    waiting_at_end: int  # requests waiting when the replay stopped
    steps: int  # steps run
    skipped_steps: int  # idle steps skipped between far-apart arrivals
    peak_demand: int  # the most tokens the running requests needed at their full length
    pool_tokens: int  # tokens the pool holds (the null block aside)
    evictions: int  # the manager's evictions
    final: dict[str, Any]  # the manager's final state: free queue, free blocks
    messages: list[str]
    step_ms: list[float]  # the manager's time per step
    hit_rate: list[float]  # vLLM's prefix cache hit rate so far, after each step
    blocks_in_use: list[int]  # after each step
    wall_s: float  # the replay loop's wall time


def build_report(outcome: ReplayOutcome) -> dict:
    """What run() returns: the config, the summary, each request's record, the final state, the series."""
    return {
        "config": outcome.config,
        "summary": _summary(outcome),
        "requests": outcome.requests,
        "final": outcome.final,
        "messages": outcome.messages,
        "step_ms": [round(x, 4) for x in outcome.step_ms],
        "prefix_cache_hit_rate_per_step": [round(x, 5) for x in outcome.hit_rate],
        "blocks_in_use": outcome.blocks_in_use,
    }


def _summary(out: ReplayOutcome) -> dict:
    """The report's totals: requests, tokens, hit rates and their ceiling,
    the pool's pressure, evictions, manager time."""
    tot = out.totals
    ms = np.array(out.step_ms) if out.step_ms else np.zeros(1)
    records = out.requests.values()
    return {
        "backend": out.config["backend"],
        "requests": len(out.requests),
        "finished": sum(r["status"] == "finished" for r in records),
        "rejected": sum(r["status"] == "rejected" for r in records),
        # Requests the replay left unfinished: a step trace's that never
        # finish, or any when --max-steps stopped it.
        "running_at_end": out.running_at_end,
        "waiting_at_end": out.waiting_at_end,
        "steps": out.steps,
        "skipped_idle_steps": out.skipped_steps,
        # vLLM's prefix cache hit rate (the one the text summary, the plot
        # and the docs call so), its ceiling, and the counts behind it.
        **_lookup_stats(out.stats),
        **_ceiling(out),
        # Other rates, by other names: each request's first admission
        # alone, and every admission (a re-admission after a preemption,
        # which mostly hits its own blocks, counted again).
        "first_admission_hit_rate": _first_admission_hit_rate(records),
        "every_admission_hit_rate": tot["cached_tokens"] / tot["prompt_tokens"] if tot["prompt_tokens"] else 0.0,
        "prompt_tokens": tot["prompt_tokens"],
        "cached_tokens": tot["cached_tokens"],
        "admissions": tot["admissions"],
        # The pool's pressure: what the running requests need at their
        # full length (at most, over the steps) against what the pool
        # holds, and the work preemptions cost.
        "pool_tokens": out.pool_tokens,
        "peak_demand_tokens": out.peak_demand,
        "peak_demand_over_pool": out.peak_demand / out.pool_tokens if out.pool_tokens else 0.0,
        "preemptions": tot["preemptions"],
        "most_preemptions_of_a_request": max((r["preemptions"] for r in records), default=0),
        "computed_tokens": tot["computed_tokens"],
        "recomputed_tokens": tot["recomputed_tokens"],
        "evictions": out.evictions,
        "max_blocks_in_use": max(out.blocks_in_use, default=0),
        "mean_blocks_in_use": float(np.mean(out.blocks_in_use)) if out.blocks_in_use else 0.0,
        "manager_ms_per_step_mean": float(ms.mean()),
        "manager_ms_per_step_p50": float(np.percentile(ms, 50)),
        "manager_ms_per_step_p99": float(np.percentile(ms, 99)),
        # The replay loop's wall time: its steps (this scheduler and the
        # manager's calls, the series recorded), not the manager's setup,
        # loading the trace, the ceiling's pass or the report
        # (`gpukv replay` prints the whole process's time beside it).
        "wall_s": out.wall_s,
    }


def _ceiling(out: ReplayOutcome) -> dict:
    """The ceiling and how many requests it covers: every request of the
    trace but those longer than max_model_len, whether or not the replay
    served them (a replay that rejected others covers fewer)."""
    if not out.ceiling or out.trace.kind != "mooncake":
        return {"prefix_cache_hit_rate_ceiling": None, "prefix_cache_hit_rate_ceiling_requests": None}
    hits, queries, requests = no_eviction_counts(out.trace, out.config["block_size"], out.config["max_model_len"])
    return {"prefix_cache_hit_rate_ceiling": hits / queries if queries else 0.0,
            "prefix_cache_hit_rate_ceiling_requests": requests}


def _first_admission_hit_rate(records) -> float:
    """Cached over prompt tokens of each request's first admission alone."""
    admitted = [(r["num_prompt_tokens"], r["num_cached_tokens"]) for r in records
                if r["num_cached_tokens"] is not None]
    prompt = sum(n for n, _ in admitted)
    return sum(cached for _, cached in admitted) / prompt if prompt else 0.0


def _lookup_stats(stats: PrefixCacheStats | None) -> dict:
    """The manager's stats, as vLLM counts them: every lookup attempt of a
    request not preempted before, in tokens; re-admissions apart."""
    return {
        "prefix_cache_hit_rate": stats.hit_rate if stats else 0.0,
        "queries": stats.queries if stats else 0,
        "hits": stats.hits if stats else 0,
        "lookup_requests": stats.requests if stats else 0,
        "query_blocks": stats.query_blocks if stats else 0,
        "hit_blocks": stats.hit_blocks if stats else 0,
        "block_hit_rate": stats.block_hit_rate if stats else 0.0,
        "preempted_lookup_requests": stats.preempted_requests if stats else 0,
        "preempted_queries": stats.preempted_queries if stats else 0,
        "preempted_hits": stats.preempted_hits if stats else 0,
    }


def no_eviction_hit_rate(trace: Trace, block_size: int, max_model_len: int | None = None) -> float | None:
    """The prefix cache hit rate ``trace`` reaches in a cache that never
    evicts: each request looked up once, in arrival order, against the full
    prompt blocks of every request before it, and counted as vLLM counts
    (hit tokens over prompt tokens; a hit of at most ``(n - 1) // block_size``
    blocks, as the managers allow). One pass over the prompts, no replay.

    It is exactly what the replay reaches in a pool that holds everything (no
    eviction, no preemption, no retried lookup) when no chunk cap lets a
    request start while an earlier one sharing its blocks is partway through
    (``docs/chunked_prefill.md``); with a cap it is an upper bound. Mooncake
    traces only (None for a step trace, whose requests may also hit blocks
    of decoded tokens or carry extra keys); requests longer than
    ``max_model_len`` are left out, as the replay rejects them."""
    if trace.kind != "mooncake":
        return None
    hits, queries, _ = no_eviction_counts(trace, block_size, max_model_len)
    return hits / queries if queries else 0.0


def no_eviction_counts(trace: Trace, block_size: int, max_model_len: int | None = None) -> tuple[int, int, int]:
    """``no_eviction_hit_rate``'s counts, of a Mooncake trace: the tokens hit,
    the tokens looked up and the requests looked up (those within ``max_model_len``)."""
    ids: dict[tuple[int, bytes], int] = {}  # (parent block's id, tokens) -> block id: exact, no digests
    hits = queries = requests = 0
    block = np.dtype((np.void, 4 * block_size))
    for r in trace.requests:
        if max_model_len is not None and r.input_length > max_model_len:
            continue
        tokens = r.prompt_tokens()
        n = len(tokens)
        full = n // block_size
        rows = np.ascontiguousarray(tokens[: full * block_size], dtype="<u4").view(block).tolist()
        parent, i = -1, 0
        while i < len(rows) and (parent, rows[i]) in ids:  # the blocks cached already
            parent = ids[(parent, rows[i])]
            i += 1
        new = rows[i:]  # new blocks, and so are their chains: ids in sequence, each the next one's parent
        if new:
            start = len(ids)
            parents = [parent, *range(start, start + len(new) - 1)]
            ids.update(zip(zip(parents, new, strict=True), range(start, start + len(new)), strict=True))
        queries += n
        requests += 1
        hits += min(i, (n - 1) // block_size) * block_size
    return hits, queries, requests
