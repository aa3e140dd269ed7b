"""Prefix-cache statistics, the hit-rate window over recent requests, and
what a manager's last step cost (``StepCounters``, a manager's ``counters``).

Counting follows current vLLM v1 (the units of its Prometheus counters
``vllm:prefix_cache_queries`` and ``vllm:prefix_cache_hits``): every lookup
attempt counts (a request refused this step and retried later counts again);
``queries`` and ``hits`` are tokens (a request's tokens, and those its hit
covers); a re-admission after a preemption (``NewRequest.num_preemptions >
0``) counts in the ``preempted_*`` fields instead. Block counts are kept under
their own names, ``query_blocks`` (``ceil(tokens / block_size)`` asked) and
``hit_blocks``. A request that opts out of the cache (``skip_prefix_cache``)
counts as a request with nothing queried.

vLLM 0.8.5 (the version whose semantics gpukv follows) counted in blocks
instead, under other Prometheus names (``vllm:gpu_prefix_cache_queries`` /
``..._hits``, ``gpukv.tools.prometheus``): a request's full blocks less the last
when the prompt ends on a block boundary (``(tokens - 1) // block_size``, the
blocks a hit can cover), re-admissions after a preemption included
(``vllm/v1/core/kv_cache_manager.py``, ``get_computed_blocks``). The stats
keep those too, ``vllm085_query_blocks`` and ``vllm085_hit_blocks``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass
class PrefixCacheStats:
    """Counts since the last time the owner handed them out.

    Invariant: ``hits <= queries`` and ``hit_blocks <= query_blocks`` (and
    so for the preempted ones). ``reset`` is True when the prefix cache was
    reset in this interval.
    """

    requests: int = 0
    queries: int = 0  # tokens asked
    hits: int = 0  # tokens hit
    query_blocks: int = 0
    hit_blocks: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0  # tokens
    preempted_hits: int = 0  # tokens
    # vLLM 0.8.5's units: blocks a hit can cover, every lookup (re-admissions too)
    vllm085_query_blocks: int = 0
    vllm085_hit_blocks: int = 0
    reset: bool = False

    def record(self, *, num_tokens: int, num_hit_tokens: int, num_blocks: int, num_hit_blocks: int,
               preempted: bool = False) -> None:
        """Count one lookup attempt (``preempted``: a re-admission after a
        preemption, counted apart as vLLM does). Keyword-only: the units
        changed once, and positions would swap them silently. ``num_blocks``
        is ``ceil(num_tokens / block_size)``, so vLLM 0.8.5's count,
        ``(num_tokens - 1) // block_size``, is one less."""
        if num_tokens > 0:
            self.vllm085_query_blocks += num_blocks - 1
        self.vllm085_hit_blocks += num_hit_blocks
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hit_tokens
            return
        self.requests += 1
        self.queries += num_tokens
        self.hits += num_hit_tokens
        self.query_blocks += num_blocks
        self.hit_blocks += num_hit_blocks

    def merge(self, other: PrefixCacheStats) -> None:
        """Add another interval's counts to these."""
        for name in ("requests", "queries", "hits", "query_blocks", "hit_blocks", "preempted_requests",
                     "preempted_queries", "preempted_hits", "vllm085_query_blocks", "vllm085_hit_blocks"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.reset = self.reset or other.reset

    @property
    def query_tokens(self) -> int:
        """``queries`` (the older name, from when ``queries`` counted blocks)."""
        return self.queries

    @property
    def hit_tokens(self) -> int:
        """``hits`` (the older name, from when ``hits`` counted blocks)."""
        return self.hits

    @property
    def hit_rate(self) -> float:
        """Tokens hit over tokens asked (vLLM's prefix-cache hit rate)."""
        return self.hits / self.queries if self.queries else 0.0

    @property
    def block_hit_rate(self) -> float:
        """Blocks hit over blocks asked."""
        return self.hit_blocks / self.query_blocks if self.query_blocks else 0.0


@dataclass
class StepCounters:
    """What the last step cost (a manager's ``counters``), counted where it
    happens: Triton kernel launches (``gpukv.kernels.capture`` counts every
    launch), host-to-device uploads (``gpukv.device.staging.Staging``),
    device-to-host reads (the device manager's ``read_*`` paths), and torch
    kernels (only while ``count_torch_ops`` is True: a dispatch hook that
    costs host time itself, so benchmarks switch it on in a separate counting
    pass). ``steps`` counts the device manager's steps since construction,
    ``reads`` its device reads since construction.
    The reference manager has one too, always zero: it launches, uploads and
    reads nothing."""

    launches: int = 0
    h2d: int = 0
    d2h: int = 0
    torch_ops: int = 0
    steps: int = 0
    #: Device-to-host reads since construction (``d2h`` is the last step's).
    reads: int = 0
    count_torch_ops: bool = False

    @property
    def syncs(self) -> int:
        """Device-to-host reads (the older name)."""
        return self.d2h

    def as_dict(self) -> dict[str, int]:
        """The four counts by name (``launches``, ``h2d``, ``d2h``, ``torch_ops``)."""
        return {"launches": self.launches, "h2d": self.h2d, "d2h": self.d2h, "torch_ops": self.torch_ops}


class PrefixCachingMetrics:
    """Token hit rate over (about) the last ``max_recent_requests`` requests.

    ``observe`` takes one interval's stats; intervals are dropped oldest first
    while the requests they hold exceed the window, so the window covers at
    least the last ``max_recent_requests`` requests whenever that many were
    seen. A stats object with ``reset`` set empties the window first: hits
    before a reset say nothing about the cache after it.
    """

    def __init__(self, max_recent_requests: int = 1000) -> None:
        if not isinstance(max_recent_requests, int) or max_recent_requests <= 0:
            raise ValueError(
                f"max_recent_requests must be a positive int, got {max_recent_requests!r}"
            )
        self.max_recent_requests = max_recent_requests
        self._intervals: deque[tuple[int, int, int]] = deque()
        self.aggregated_requests = 0
        self.aggregated_queries = 0
        self.aggregated_hits = 0

    def observe(self, stats: PrefixCacheStats) -> None:
        if stats.reset:
            self.reset()
        # An interval with no requests carries no information; skipping it keeps
        # the window from filling with empty steps.
        if stats.requests == 0:
            return
        self._intervals.append((stats.requests, stats.queries, stats.hits))
        self.aggregated_requests += stats.requests
        self.aggregated_queries += stats.queries
        self.aggregated_hits += stats.hits
        while (
            len(self._intervals) > 1
            and self.aggregated_requests - self._intervals[0][0] >= self.max_recent_requests
        ):
            requests, queries, hits = self._intervals.popleft()
            self.aggregated_requests -= requests
            self.aggregated_queries -= queries
            self.aggregated_hits -= hits

    def reset(self) -> None:
        self._intervals.clear()
        self.aggregated_requests = 0
        self.aggregated_queries = 0
        self.aggregated_hits = 0

    @property
    def hit_rate(self) -> float:
        if self.aggregated_queries == 0:
            return 0.0
        return self.aggregated_hits / self.aggregated_queries
