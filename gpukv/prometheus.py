"""Prometheus metrics of a serving loop (the optional ``metrics`` extra).

Names follow vLLM's where one exists, so a dashboard built for vLLM reads
gpukv's too: ``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits``
(counters, tokens, as the managers' ``PrefixCacheStats.queries`` / ``hits``
count them), ``vllm:kv_cache_usage_perc`` (gauge, 0..1),
``vllm:num_preemptions``, ``vllm:num_requests_running`` /
``vllm:num_requests_waiting``. What vLLM has no name for is gpukv's own:
``gpukv:prefix_cache_preempted_queries`` / ``..._hits`` (re-admissions after
a preemption, counted apart as the stats do), ``gpukv:evictions``,
``gpukv:blocks_in_use`` and ``gpukv:manager_step_seconds`` (a histogram of
the manager's time per step). Counters carry the ``_total`` suffix in the
exposition, as ``prometheus_client`` (and vLLM) write them.

``prometheus-client`` is imported only when metrics are asked for; without
it, ``require()`` raises an ``ImportError`` whose message names the extra.
"""

from __future__ import annotations

from typing import Any

from gpukv.metrics import PrefixCacheStats

EXTRA_HINT = "pip install 'gpukv[metrics]' (prometheus-client)"

# Bucket edges of the manager's time per step, in seconds: 10 us to 1 s.
STEP_SECONDS_BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0)


def require() -> Any:
    """The ``prometheus_client`` module, or an ImportError naming the extra."""
    try:
        import prometheus_client
    except ImportError:
        raise ImportError(f"Prometheus metrics need the 'metrics' extra: {EXTRA_HINT}") from None
    return prometheus_client


class ServingMetrics:
    """The metrics of one serving loop in their own registry (``registry``),
    updated once per step by ``observe_step``; ``serve(port)`` exposes them
    over HTTP at ``/metrics``."""

    def __init__(self, registry: Any = None) -> None:
        pc = require()
        self._pc = pc
        self.registry = registry if registry is not None else pc.CollectorRegistry()
        r = self.registry
        self.queries = pc.Counter("vllm:prefix_cache_queries", "Prefix-cache queries, in tokens (every lookup "
                                  "attempt of a request not preempted before)", registry=r)
        self.hits = pc.Counter("vllm:prefix_cache_hits", "Prefix-cache hits, in tokens", registry=r)
        self.preempted_queries = pc.Counter("gpukv:prefix_cache_preempted_queries", "Prefix-cache queries of "
                                            "re-admissions after a preemption, in tokens", registry=r)
        self.preempted_hits = pc.Counter("gpukv:prefix_cache_preempted_hits", "Prefix-cache hits of re-admissions "
                                         "after a preemption, in tokens", registry=r)
        self.usage = pc.Gauge("vllm:kv_cache_usage_perc", "KV-cache usage: 1 means every block is in use",
                              registry=r)
        self.preemptions = pc.Counter("vllm:num_preemptions", "Requests preempted", registry=r)
        self.running = pc.Gauge("vllm:num_requests_running", "Requests running", registry=r)
        self.waiting = pc.Gauge("vllm:num_requests_waiting", "Requests waiting", registry=r)
        self.evictions = pc.Counter("gpukv:evictions", "Cached blocks evicted to make room", registry=r)
        self.blocks_in_use = pc.Gauge("gpukv:blocks_in_use", "Blocks held by requests (the null block excluded)",
                                      registry=r)
        self.step_seconds = pc.Histogram("gpukv:manager_step_seconds", "The block manager's time per step",
                                         buckets=STEP_SECONDS_BUCKETS, registry=r)
        self._evictions_seen = 0

    def observe_step(self, stats: PrefixCacheStats, *, usage: float, blocks_in_use: int, running: int,
                     waiting: int, preemptions: int, evictions_total: int, step_seconds: float) -> None:
        """One step: its prefix-cache stats (the interval's, as
        ``make_prefix_cache_stats`` hands them out), the pool's state after
        it, the preemptions it made, the manager's running eviction count and
        its time."""
        self.queries.inc(stats.queries)
        self.hits.inc(stats.hits)
        self.preempted_queries.inc(stats.preempted_queries)
        self.preempted_hits.inc(stats.preempted_hits)
        self.usage.set(usage)
        self.blocks_in_use.set(blocks_in_use)
        self.running.set(running)
        self.waiting.set(waiting)
        self.preemptions.inc(preemptions)
        self.evictions.inc(max(0, evictions_total - self._evictions_seen))
        self._evictions_seen = max(self._evictions_seen, evictions_total)
        self.step_seconds.observe(step_seconds)

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Expose the registry at ``http://addr:port/metrics`` from a daemon
        thread; returns the port (``port=0`` picks a free one)."""
        server, _ = self._pc.start_http_server(port, addr=addr, registry=self.registry)
        return server.server_address[1]

    def value(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        """A sample's current value (``vllm:prefix_cache_hits_total``, a
        histogram bucket with ``labels={"le": "0.001"}``, ...)."""
        return self.registry.get_sample_value(name, labels)
