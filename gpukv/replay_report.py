"""The replay's report: what ``Replay.run()`` returns, and its ceiling.

``build_report`` reads a finished replay's state once: the configuration it
ran with, the summary (requests, tokens, vLLM's prefix cache hit rate and
its ceiling, the pool's pressure, evictions, manager time), each request's
record, the manager's final state and the series per step.
``no_eviction_hit_rate`` is the ceiling: the hit rate of the same trace
against a cache that never evicts (``gpukv.replay`` re-exports it, and a
sweep computes it once for all its points).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from gpukv import _runtime
from gpukv.traces import Trace

if TYPE_CHECKING:
    from gpukv.metrics import PrefixCacheStats
    from gpukv.replay import Replay, _Live


def build_report(replay: Replay, num_steps: int, wall_s: float) -> dict:
    """What run() returns: the config, the summary, each request's record, the final state, the series."""
    summary = _summary(replay, num_steps, wall_s)
    requests = {rid: _request_record(lv) for rid, lv in replay.live.items()}
    return {
        "config": _config_record(replay),
        "summary": summary,
        "requests": requests,
        "final": {"free_queue": replay.manager.free_queue(), "num_free_blocks": replay.manager.read_num_free_blocks()},
        "messages": replay.messages,
        "step_ms": [round(x, 4) for x in replay.step_ms],
        "prefix_cache_hit_rate_per_step": [round(x, 5) for x in replay.hit_rate],
        "blocks_in_use": replay.blocks_in_use,
    }


def _summary(replay: Replay, num_steps: int, wall_s: float) -> dict:
    """The report's totals: requests, tokens, hit rates and their ceiling,
    the pool's pressure, evictions, manager time."""
    tot = replay.totals
    ms = np.array(replay.step_ms) if replay.step_ms else np.zeros(1)
    pool_tokens = (replay.manager.num_blocks - 1) * replay.opts.block_size
    return {
        "backend": replay.opts.backend,
        "requests": len(replay.live),
        "finished": sum(lv.status == "finished" for lv in replay.live.values()),
        "rejected": sum(lv.status == "rejected" for lv in replay.live.values()),
        # Requests the replay left unfinished: a step trace's that never
        # finish, or any when --max-steps stopped it.
        "running_at_end": len(replay.running),
        "waiting_at_end": len(replay.waiting),
        "steps": num_steps,
        "skipped_idle_steps": replay.skipped_steps,
        # vLLM's prefix cache hit rate (the one the text summary, the plot
        # and the docs call so), its ceiling, and the counts behind it.
        **_lookup_stats(replay.stats),
        **_ceiling(replay),
        # Other rates, by other names: each request's first admission
        # alone, and every admission (a re-admission after a preemption,
        # which mostly hits its own blocks, counted again).
        "first_admission_hit_rate": _first_admission_hit_rate(replay.live),
        "every_admission_hit_rate": tot["cached_tokens"] / tot["prompt_tokens"] if tot["prompt_tokens"] else 0.0,
        "prompt_tokens": tot["prompt_tokens"],
        "cached_tokens": tot["cached_tokens"],
        "admissions": tot["admissions"],
        # The pool's pressure: what the running requests need at their
        # full length (at most, over the steps) against what the pool
        # holds, and the work preemptions cost.
        "pool_tokens": pool_tokens,
        "peak_demand_tokens": replay.peak_demand,
        "peak_demand_over_pool": replay.peak_demand / pool_tokens if pool_tokens else 0.0,
        "preemptions": tot["preemptions"],
        "most_preemptions_of_a_request": max((lv.preemptions for lv in replay.live.values()), default=0),
        "computed_tokens": tot["computed_tokens"],
        "recomputed_tokens": tot["recomputed_tokens"],
        "evictions": replay.manager.read_num_evictions(),
        "max_blocks_in_use": max(replay.blocks_in_use, default=0),
        "mean_blocks_in_use": float(np.mean(replay.blocks_in_use)) if replay.blocks_in_use else 0.0,
        "manager_ms_per_step_mean": float(ms.mean()),
        "manager_ms_per_step_p50": float(np.percentile(ms, 50)),
        "manager_ms_per_step_p99": float(np.percentile(ms, 99)),
        # The replay loop's wall time: its steps (this scheduler and the
        # manager's calls, the series recorded), not the manager's setup,
        # loading the trace, the ceiling's pass or the report
        # (`gpukv replay` prints the whole process's time beside it).
        "wall_s": wall_s,
    }


def _ceiling(replay: Replay) -> dict:
    """The ceiling and how many requests it covers: every request of the
    trace but those longer than max_model_len, whether or not the replay
    served them (a replay that rejected others covers fewer)."""
    if not replay.opts.ceiling or replay.trace.kind != "mooncake":
        return {"prefix_cache_hit_rate_ceiling": None, "prefix_cache_hit_rate_ceiling_requests": None}
    hits, queries, requests = no_eviction_counts(replay.trace, replay.opts.block_size, replay.opts.max_model_len)
    return {"prefix_cache_hit_rate_ceiling": hits / queries if queries else 0.0,
            "prefix_cache_hit_rate_ceiling_requests": requests}


def _first_admission_hit_rate(live: dict[str, _Live]) -> float:
    """Cached over prompt tokens of each request's first admission alone."""
    admitted = [(lv.spec.input_length, lv.num_cached_tokens) for lv in live.values()
                if lv.num_cached_tokens is not None]
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


def _request_record(lv: _Live) -> dict:
    """One request's line of the report."""
    return {
        "admitted_step": lv.admitted_step,
        "num_prompt_tokens": lv.spec.input_length,
        "num_cached_tokens": lv.num_cached_tokens,
        "prefill_done_step": lv.prefill_done_step,
        "block_ids": lv.block_ids,
        "preemptions": lv.preemptions,
        "status": lv.status,
        "finished_step": lv.finished_step,
        **({"reason": lv.reason} if lv.reason else {}),
    }


def _config_record(replay: Replay) -> dict:
    """The configuration the replay ran with."""
    return {
        "block_size": replay.opts.block_size, "num_blocks": replay.opts.num_blocks,
        "max_model_len": replay.opts.max_model_len, "max_num_seqs": replay.opts.max_num_seqs,
        "admission": replay.opts.admission, "uncached_first": replay.opts.uncached_first,
        # As applied: a step trace runs unbudgeted (None, 0).
        "max_num_batched_tokens": replay.max_num_batched_tokens,
        "long_prefill_token_threshold": replay.long_prefill_token_threshold,
        "prompt_only": replay.opts.prompt_only, "trace_kind": replay.trace.kind,
        "backend": replay.opts.backend,
        # The device manager's kernels ran under Triton's interpreter (no
        # CUDA): its times per step are the interpreter's, not the GPU's.
        "interpreted": replay.opts.backend == "device" and _runtime.INTERPRETED,
        "sliding_windows": list(getattr(replay.manager, "sliding_windows", [None])),
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
