"""Prefix-cache statistics and the hit-rate window over recent requests.

Counting follows vLLM v1: every lookup attempt counts (a request refused this
step and retried later counts again). ``queries`` and ``hits`` are in blocks, the
``*_tokens`` fields in tokens. A request that opts out of the cache
(``skip_prefix_cache``) counts as a request with no queries.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass
class PrefixCacheStats:
    """Counts since the last time the owner handed them out.

    Invariant: ``hits <= queries`` and ``hit_tokens <= query_tokens``.
    ``reset`` is True when the prefix cache was reset in this interval.
    """

    requests: int = 0
    queries: int = 0
    hits: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    reset: bool = False

    def record(self, num_blocks: int, num_hit_blocks: int, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one lookup attempt."""
        self.requests += 1
        self.queries += num_blocks
        self.hits += num_hit_blocks
        self.query_tokens += num_tokens
        self.hit_tokens += num_hit_tokens

    def merge(self, other: "PrefixCacheStats") -> None:
        self.requests += other.requests
        self.queries += other.queries
        self.hits += other.hits
        self.query_tokens += other.query_tokens
        self.hit_tokens += other.hit_tokens
        self.reset = self.reset or other.reset

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class PrefixCachingMetrics:
    """Block hit rate over (about) the last ``max_recent_requests`` requests.

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
