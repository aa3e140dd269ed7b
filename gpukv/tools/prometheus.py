"""Prometheus metrics of a serving loop (the optional ``metrics`` extra).

Names and labels follow vLLM 0.33.0's (``vllm/v1/metrics/loggers.py``; tested
with that release only, not with later ones such as 0.34.0), so a dashboard
built for vLLM reads gpukv's too: every series carries vLLM's
labels ``model_name`` (vLLM's served model name; ``gpukv replay
--served-model-name``) and ``engine`` (the engine index, ``"0"``), and the
names are ``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits``
(counters, in tokens, as the managers' ``PrefixCacheStats.queries`` /
``hits`` count them), ``vllm:kv_cache_usage_perc`` (gauge, 0..1),
``vllm:num_preemptions``, ``vllm:num_requests_running`` /
``vllm:num_requests_waiting``. What vLLM has no name for is gpukv's own,
with the same labels: ``gpukv:prefix_cache_preempted_queries`` /
``..._hits`` (re-admissions after a preemption, counted apart as the stats
do), ``gpukv:evictions``, ``gpukv:blocks_in_use`` and
``gpukv:manager_step_seconds`` (a histogram of the manager's time per step).
Counters carry the ``_total`` suffix in the exposition, as
``prometheus_client`` (and vLLM) write them.

vLLM 0.8.5, whose semantics gpukv follows, named three of these otherwise
and counted the prefix cache in blocks: ``vllm085=True`` (``gpukv replay
--metrics-vllm085``) adds its ``vllm:gpu_prefix_cache_queries`` /
``vllm:gpu_prefix_cache_hits`` (counters, in blocks, re-admissions
included: ``PrefixCacheStats.vllm085_query_blocks`` / ``..._hit_blocks``) and
``vllm:gpu_cache_usage_perc``. Its other names here are the same as vLLM
0.33.0's (``vllm:num_preemptions_total`` is what both expose).

``prometheus-client`` is imported only when metrics are asked for; without
it, ``require_prometheus_client()`` raises an ``ImportError`` whose message names the extra.
"""

from __future__ import annotations

import errno
from typing import Any

from gpukv.core.metrics import PrefixCacheStats
from gpukv.errors import AddressError, AddressInUseError, InvalidInputError, InvalidTypeError

EXTRA_HINT = "pip install prometheus-client (or pip install -e '.[metrics]' in a gpukv clone)"

# Bucket edges of the manager's time per step, in seconds: 10 us to 1 s.
STEP_SECONDS_BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0)


def require_prometheus_client() -> Any:
    """The ``prometheus_client`` module, or an ImportError naming the extra."""
    try:
        import prometheus_client
    except ImportError:
        raise ImportError(f"Prometheus metrics need the 'metrics' extra: {EXTRA_HINT}") from None
    return prometheus_client


#: What vLLM labels every metric with.
LABELS = ("model_name", "engine")

_PORT_FIX = "pass a TCP port from 1 to 65535, or 0 for any free one"
_ADDR_FIX = "pass an IP address or host name of this machine (127.0.0.1; 0.0.0.0 for every interface)"


def _check_port(port: Any) -> None:
    if isinstance(port, bool) or not isinstance(port, int):
        raise InvalidTypeError(f"must be an int, got {type(port).__name__} {port!r}", argument="port", fix=_PORT_FIX)
    if not 0 <= port <= 65535:
        raise InvalidInputError(f"must be from 0 to 65535, got {port}", argument="port", fix=_PORT_FIX)


def _check_addr(addr: Any) -> None:
    if not isinstance(addr, str):
        raise InvalidTypeError(f"must be a str, got {type(addr).__name__} {addr!r}", argument="addr", fix=_ADDR_FIX)
    if not addr or not addr.isprintable() or any(c.isspace() for c in addr) or len(addr) > 253:
        raise InvalidInputError(f"{addr!r} is not an address", argument="addr", fix=_ADDR_FIX)
    try:
        addr.encode("idna" if not addr.isascii() else "ascii")
    except UnicodeError:
        raise InvalidInputError(f"{addr!r} is not an address", argument="addr", fix=_ADDR_FIX) from None


def _listen_error(port: int, addr: str, err: OSError) -> AddressError:
    """The HTTP server's OSError as gpukv's (an OSError too), with a hint."""
    where = f"{addr}:{port}"
    if err.errno == errno.EADDRINUSE:
        return AddressInUseError(f"{where} is in use ({err.strerror or err})", argument="port",
                                 fix="pass another port, or 0 for any free one (serve returns it)")
    if err.errno in (errno.EACCES, errno.EPERM):
        return AddressError(f"not allowed to listen on {where} ({err.strerror or err})", argument="port",
                            fix="pass a port from 1024 up, or 0 for any free one")
    return AddressError(f"cannot listen on {where} ({err.strerror or err})", argument="addr", fix=_ADDR_FIX)


class ServingMetrics:
    """The metrics of one serving loop in their own registry (``registry``),
    updated once per step by ``observe_step``; ``serve(port)`` exposes them
    over HTTP at ``/metrics``. ``model_name`` and ``engine`` are the values
    of vLLM's labels; ``vllm085`` adds vLLM 0.8.5's names where they differ
    (module docstring)."""

    def __init__(self, registry: Any = None, *, model_name: str = "gpukv", engine: int | str = 0,
                 vllm085: bool = False) -> None:
        pc = require_prometheus_client()
        self._pc = pc
        self.registry = registry if registry is not None else pc.CollectorRegistry()
        self.labels = {"model_name": str(model_name), "engine": str(engine)}
        r = self.registry

        def make(kind: Any, name: str, doc: str, **kw: Any) -> Any:
            return kind(name, doc, labelnames=LABELS, registry=r, **kw).labels(**self.labels)

        counter, gauge = pc.Counter, pc.Gauge
        self.queries = make(counter, "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of "
                            "queried tokens (every lookup attempt of a request not preempted before)")
        self.hits = make(counter, "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens")
        self.preempted_queries = make(counter, "gpukv:prefix_cache_preempted_queries", "Prefix-cache queries of "
                                      "re-admissions after a preemption, in tokens")
        self.preempted_hits = make(counter, "gpukv:prefix_cache_preempted_hits", "Prefix-cache hits of "
                                   "re-admissions after a preemption, in tokens")
        self.usage = make(gauge, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.preemptions = make(counter, "vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.running = make(gauge, "vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = make(gauge, "vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.evictions = make(counter, "gpukv:evictions", "Cached blocks evicted to make room")
        self.blocks_in_use = make(gauge, "gpukv:blocks_in_use", "Blocks held by requests (the null block excluded)")
        self.step_seconds = make(pc.Histogram, "gpukv:manager_step_seconds", "The block manager's time per step",
                                 buckets=STEP_SECONDS_BUCKETS)
        self.vllm085 = vllm085
        if vllm085:
            self.block_queries = make(counter, "vllm:gpu_prefix_cache_queries", "GPU prefix cache queries, in "
                                      "terms of number of queried blocks (vLLM 0.8.5's name and unit)")
            self.block_hits = make(counter, "vllm:gpu_prefix_cache_hits", "GPU prefix cache hits, in terms of "
                                   "number of cached blocks (vLLM 0.8.5's name and unit)")
            self.gpu_usage = make(gauge, "vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent "
                                  "usage (vLLM 0.8.5's name)")
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
        if self.vllm085:
            self.block_queries.inc(stats.vllm085_query_blocks)
            self.block_hits.inc(stats.vllm085_hit_blocks)
            self.gpu_usage.set(usage)

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Expose the registry at ``http://addr:port/metrics`` from a daemon
        thread; returns the port (``port=0`` picks a free one). A port not
        an int from 0 to 65535, or an ``addr`` that is not an address, raises
        ``InvalidTypeError`` / ``InvalidInputError``; a port in use
        ``AddressInUseError``, one that cannot be listened on (a host not of
        this machine, a port not allowed) ``AddressError``: both OSErrors."""
        _check_port(port)
        _check_addr(addr)
        try:
            server, _ = self._pc.start_http_server(port, addr=addr, registry=self.registry)
        except OSError as err:  # socket.gaierror included: a name that does not resolve
            raise _listen_error(port, addr, err) from None
        return server.server_address[1]

    def value(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        """A sample's current value (``vllm:prefix_cache_hits_total``, a
        histogram bucket with ``labels={"le": "0.001"}``, ...); this loop's
        ``model_name`` and ``engine`` labels are added to ``labels``."""
        return self.registry.get_sample_value(name, {**self.labels, **(labels or {})})
