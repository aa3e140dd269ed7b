"""What vLLM 0.33's scheduler and engine core read of its block manager
beyond the calls: blocks, the coordinator's single-type managers, the pool
(refused), as the adapter presents them."""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter, sub
from typing import Any

import numpy as np

from gpukv.vllm.v0_33 import features
from gpukv.vllm.v0_33.groups import UnsupportedConfigError


@dataclass(frozen=True, slots=True)
class Block:
    """A block as vLLM 0.33's scheduler and ``KVCacheBlocks`` read it: its id,
    whether it is the null block (id 0, one for every group: it stands in for
    the blocks a sliding window released or a window hit skips, and carries
    no hash), and (cached blocks) vLLM's block hash and the tokens that hash
    covers (``estimate_cached_tokens`` reads those)."""

    block_id: int
    block_hash: Any = None
    block_hash_num_tokens: int | None = None

    @property
    def is_null(self) -> bool:
        return self.block_id == 0


NULL_BLOCK = Block(0)


def blocks_of(request: Any, ids: Any, num_cached: int, block_size: int) -> list[Block]:
    """``Block``\\ s for a request's block ids (from position 0): those
    before ``num_cached`` carry the request's vLLM block hash, but the null
    block. A request vLLM's engine did not hash (``engine_hashing``) has
    none to carry (``request`` is read only when ``num_cached`` is not 0)."""
    hashes = request.block_hashes if num_cached else ()
    num_cached = min(num_cached, len(hashes))
    return [NULL_BLOCK if not b else Block(b, hashes[i], (i + 1) * block_size) if i < num_cached else Block(b)
            for i, b in enumerate(ids)]


def token_ids(request: Any, end: int | None = None) -> Any:
    """The first ``end`` (None: all) of a vLLM request's known tokens, as the
    adapter hands them to gpukv, with no Python int per token: vLLM 0.34
    keeps them in an int32 ``TokenBuffer`` (an ``array('i')``), read here in
    one copy of its buffer; a slice of it would build a list of Python ints
    (7.8 ms for 128k tokens, against 42 us this way, the manager's checks
    included). The copy, not a view: a view exports the buffer, and while
    one lived (a traceback keeping the manager's frame, say) vLLM could not
    append a sampled token to the request (``BufferError``). vLLM 0.33's list
    is sliced, which the manager converts in one C-level pass."""
    buffer = getattr(request, "_all_token_ids", None)
    if isinstance(buffer, array) and buffer.typecode == "i":
        count = len(buffer) if end is None else min(max(end, 0), len(buffer))
        return np.frombuffer(buffer, np.int32, count=count).copy()
    return request.all_token_ids[:end]


def token_slice(request: Any, start: int, stop: int) -> Any:
    """A vLLM request's known tokens ``start`` to ``stop`` (a few: the
    running loop's new ones), iterable as ints: a slice of vLLM 0.34's
    ``TokenBuffer`` taken as the ``array`` it is (its own ``__getitem__``
    and the ``ConstantList`` around it are two Python calls per request and
    a list each step), or of vLLM 0.33's list."""
    buffer = getattr(request, "_all_token_ids", None)
    if isinstance(buffer, array):
        return array.__getitem__(buffer, slice(start, stop))
    if type(buffer) is list:
        return buffer[start:stop]
    return request.all_token_ids[start:stop]


_token_buffer = attrgetter("_all_token_ids")  # (vLLM 0.34's TokenBuffer of a request)


def decode_tokens(requests: Sequence[Any], starts: Sequence[int]) -> np.ndarray:
    """``new_tokens(requests, starts, [s + 1 for s in starts])``: each
    request's one new token (a batch of decodes)."""
    decoded = _decode_tokens(requests, starts)
    return _sliced_tokens(requests, starts, [s + 1 for s in starts]) if decoded is None else decoded


def _decode_tokens(requests: Sequence[Any], starts: Sequence[int]) -> np.ndarray | None:
    """Each request's token at ``starts[i]`` read from vLLM 0.34's
    ``TokenBuffer`` (an ``array``) or vLLM 0.33's list in one pass in C
    (``map``), no Python call per request; None when the buffers are not all
    of the first one's kind (or one is shorter than said)."""
    first = getattr(requests[0], "_all_token_ids", None) if len(requests) else None
    get = array.__getitem__ if isinstance(first, array) else list.__getitem__
    try:
        return np.fromiter(map(get, map(_token_buffer, requests), starts), np.int64, len(starts))
    except (AttributeError, TypeError, IndexError, OverflowError):
        return None


def new_tokens(requests: Sequence[Any], starts: Sequence[int], stops: Sequence[int]) -> np.ndarray:
    """Each request's known tokens ``starts[i]`` to ``stops[i]`` (the
    running loop's new ones: a few each), flat, as an int64 array: from
    vLLM 0.34's ``TokenBuffer`` (an int32 ``array``) each slice copied into
    one array, no Python int per token; else ``token_slice``'s. A batch of
    decodes (one token each) is read in one pass in C (``map``), no Python
    call per request."""
    n = len(starts)
    if n and list(map(sub, stops, starts)).count(1) == n == len(requests) == len(stops):
        decoded = _decode_tokens(requests, starts)
        if decoded is not None:
            return decoded
    return _sliced_tokens(requests, starts, stops)


def _sliced_tokens(requests: Sequence[Any], starts: Sequence[int], stops: Sequence[int]) -> np.ndarray:
    """``new_tokens``, one slice per request."""
    out = array("i")
    get = array.__getitem__
    try:
        for r, a, b in zip(requests, starts, stops, strict=True):
            if b > a:
                out.extend(get(r._all_token_ids, slice(a, b)))  # (TypeError: not an int32 array)
    except (AttributeError, TypeError):
        flat: list[int] = []
        for r, a, b in zip(requests, starts, stops, strict=True):
            if b > a:
                flat.extend(token_slice(r, a, b))
        return np.array(flat, dtype=np.int64)
    return np.frombuffer(out, dtype=np.int32).astype(np.int64) if out else np.zeros(0, dtype=np.int64)


class IdBlocks:
    """What a subclass of vLLM's ``KVCacheBlocks`` made by ``id_blocks_class``
    holds: block ids per group (lists or int arrays, from the manager), and
    ``Block`` objects built from them only when something reads ``blocks``.
    vLLM's scheduler reads only ``get_block_ids()`` of what the manager hands
    it (for the ``SchedulerOutput``), which copies the ids, one list per
    group, with no Python call per block; its connectors and copy-on-write
    paths (refused by the adapter) read ``blocks``. ``request``,
    ``num_cached``, ``block_size``: as ``blocks_of``."""

    def __init__(self, ids: tuple[Any, ...], request: Any = None, num_cached: int = 0, block_size: int = 0) -> None:
        # (not the dataclass's __init__: ``blocks`` is built on first read)
        self._ids = ids
        self._request, self._num_cached, self._block_size = request, num_cached, block_size
        self._built: tuple[list[Block], ...] | None = None

    @property
    def blocks(self) -> tuple[list[Block], ...]:
        if self._built is None:
            self._built = tuple(blocks_of(self._request, ids, self._num_cached, self._block_size)
                                for ids in self._ids)
        return self._built

    @blocks.setter
    def blocks(self, value: tuple[Any, ...]) -> None:
        self._built = tuple(value)
        self._ids = tuple([block.block_id for block in group] for group in self._built)

    def get_block_ids(self, allow_none: bool = False, *, group_ids: Any = None) -> tuple[list[int], ...] | None:
        """vLLM's ``KVCacheBlocks.get_block_ids``: fresh lists of the ids per
        group (those of ``group_ids``; all: None), or None with
        ``allow_none`` when every one is empty."""
        groups = self._ids if group_ids is None else tuple(self._ids[g] for g in group_ids)
        if allow_none and not any(len(ids) for ids in groups):
            return None
        return tuple(ids.tolist() if isinstance(ids, np.ndarray) else list(ids) for ids in groups)

    def num_blocks(self) -> int:
        """Blocks in every group together (``blocks`` not built)."""
        return sum(len(ids) for ids in self._ids)


_ID_BLOCKS_CLASSES: dict[type, type] = {}


def id_blocks_class(blocks_cls: type) -> type:
    """vLLM's ``KVCacheBlocks`` class ``blocks_cls`` with ``IdBlocks``' ids
    and ``blocks`` built on first read (one subclass per vLLM class)."""
    cls = _ID_BLOCKS_CLASSES.get(blocks_cls)
    if cls is None:
        cls = _ID_BLOCKS_CLASSES[blocks_cls] = type("IdKVCacheBlocks", (IdBlocks, blocks_cls), {
            "__doc__": "vLLM's ``KVCacheBlocks`` holding block ids, its ``Block`` objects built on first read.",
            "__module__": __name__})
    return cls


class NoBlocks:
    """What the subclass of vLLM's ``KVCacheBlocks`` made by
    ``empty_blocks_class`` answers: no block in any group. The adapter
    hands its one instance back for every call that takes no new block (the
    running loop's, about ``block_size - 1`` calls in ``block_size``), and
    vLLM's scheduler asks each for its ids (``get_block_ids(allow_none=True)``
    in ``_make_cached_request_data``): answered here without the generator
    vLLM's method runs over the groups."""

    def get_block_ids(self, allow_none: bool = False, *, group_ids: Any = None) -> tuple[list[int], ...] | None:
        """vLLM's ``KVCacheBlocks.get_block_ids`` of no block: None with
        ``allow_none``, else a fresh empty list per group (those of
        ``group_ids``; all: None)."""
        if allow_none:
            return None
        return tuple([] for _ in (self.blocks if group_ids is None else group_ids))  # type: ignore[attr-defined]

    def __eq__(self, other: object) -> bool:
        """Equal to vLLM's ``KVCacheBlocks`` of the same (empty) groups, as
        the instance vLLM's manager keeps is (a dataclass compares only its
        own class: vLLM's instance defers to this)."""
        if not isinstance(other, self._vllm_class):  # type: ignore[attr-defined]
            return NotImplemented
        return tuple(other.blocks) == tuple(self.blocks)  # type: ignore[attr-defined]

    __hash__ = None  # type: ignore[assignment]  # (as vLLM's: a mutable dataclass)


_EMPTY_BLOCKS_CLASSES: dict[type, type] = {}


def empty_blocks_class(blocks_cls: type) -> type:
    """vLLM's ``KVCacheBlocks`` class ``blocks_cls`` with ``NoBlocks``'
    ``get_block_ids`` (one subclass per vLLM class; build it with empty
    groups only)."""
    cls = _EMPTY_BLOCKS_CLASSES.get(blocks_cls)
    if cls is None:
        cls = _EMPTY_BLOCKS_CLASSES[blocks_cls] = type("EmptyKVCacheBlocks", (NoBlocks, blocks_cls), {
            "__doc__": "vLLM's ``KVCacheBlocks`` of no block in any group.", "__module__": __name__,
            "_vllm_class": blocks_cls})
    return cls


def has_blocks(blocks: Any) -> bool:
    """Whether a ``KVCacheBlocks`` (or None) holds a block in some group,
    without building an ``IdBlocks``' ``Block`` objects."""
    if blocks is None:
        return False
    if isinstance(blocks, IdBlocks):
        return blocks.num_blocks() > 0
    return any(blocks.blocks)


@dataclass(frozen=True, slots=True)
class SingleTypeView:
    """What the engine core and the scheduler read of one of vLLM's
    single-type managers: its group, spec and block size."""

    kv_cache_group_id: int
    kv_cache_spec: Any
    block_size: int

    def new_step_starts(self) -> None:
        """Mamba's hook in vLLM; nothing to do for attention groups."""


class CoordinatorView:
    """Stands in for vLLM's ``KVCacheCoordinator``: the engine core reads
    ``single_type_managers[i].block_size`` / ``.kv_cache_spec`` after the
    scheduler is built (``vllm/v1/engine/core.py``); ``vllm_kind`` names the
    coordinator vLLM would have chosen (``get_kv_cache_coordinator``)."""

    enable_partial_hash_hits = False

    def __init__(self, kv_cache_config: Any, enable_caching: bool) -> None:
        groups = kv_cache_config.kv_cache_groups
        self.single_type_managers = [
            SingleTypeView(i, group.kv_cache_spec, group.kv_cache_spec.block_size) for i, group in enumerate(groups)]
        self.vllm_kind = ("KVCacheCoordinatorNoPrefixCache" if not enable_caching else
                          "UnitaryKVCacheCoordinator" if len(groups) == 1 else "HybridKVCacheCoordinator")

    def new_step_starts(self) -> None:
        for manager in self.single_type_managers:
            manager.new_step_starts()


class NoBlockPool:
    """``kv_cache_manager.block_pool``: vLLM's scheduler reaches the pool
    directly only on paths the adapter refuses (copy-on-write partial hits,
    deferred frees of a KV-connector consumer); say so if one is reached."""

    def __getattr__(self, name: str) -> Any:
        raise UnsupportedConfigError(
            f"vLLM's scheduler read block_pool.{name}, which only KV-connector and copy-on-write paths do",
            argument="kv_cache_manager.block_pool",
            fix="run without a KV connector and with hash_block_size == block_size, or use vLLM's own scheduler")


class PrefixCacheStatsRules:
    """vLLM 0.33's prefix-cache stats rules: counted in tokens at admission
    (a re-admission after preemption as ``preempted_*``), never for a request
    that skips the cache. Needs ``log_stats``, ``enable_caching``,
    ``prefix_cache_stats`` and ``_stats_cls`` (the manager's)."""

    log_stats: bool
    enable_caching: bool
    prefix_cache_stats: Any
    _stats_cls: Any

    def make_prefix_cache_stats(self) -> Any:
        """The ``PrefixCacheStats`` since the last call (then a fresh one), or
        None without ``log_stats``."""
        if not self.log_stats:
            return None
        stats, self.prefix_cache_stats = self.prefix_cache_stats, self._stats_cls()
        return stats

    def prefix_cache_lookup_enabled(self, request: Any) -> bool:
        """Whether ``request`` is looked up: caching on and the request does
        not skip the cache (prompt logprobs, pooling)."""
        return self.enable_caching and not features.skips_cache(request)

    def record_prefix_cache_stats(self, request: Any, num_hits: int) -> None:
        """An admission in the stats, in tokens (a re-admission after
        preemption as ``preempted_*``); requests that skip the cache not at all."""
        if self.prefix_cache_stats is None or not self.prefix_cache_lookup_enabled(request):
            return
        stats: Any = self.prefix_cache_stats  # (vLLM 0.33's; mypy may see 0.8.5's, without ``record``)
        stats.record(num_tokens=request.num_tokens, num_hits=num_hits, preempted=request.num_preemptions > 0)


class InertHooks:
    """vLLM 0.33 manager hooks with nothing to report for the configurations
    the adapter follows (zeroing, copy-on-write, Mamba and cascade attention
    are refused or gone); ``num_kv_cache_groups`` comes from the manager."""

    num_kv_cache_groups: int

    def take_new_block_ids(self) -> list[int]:
        """Blocks to zero: none (zeroing configurations are refused)."""
        return []

    def take_kv_cache_block_copies(self) -> tuple[list[Any], list[Any]]:
        """Copy-on-write copies: none (partial hits are refused)."""
        return [], []

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        """Mamba boundary states: none (Mamba is refused)."""
        return {}

    def finalize_partial_tail_offloads(self, request: Any) -> list[tuple[int, int, int]]:
        """Mamba partial tails: none (Mamba is refused)."""
        del request  # (vLLM's signature)
        return []

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        """Deprecated in vLLM 0.33 (cascade attention is gone): 0 per group."""
        del running_request_id  # (vLLM's signature)
        return [0] * self.num_kv_cache_groups
