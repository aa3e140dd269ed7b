"""vLLM 0.33's ``KVCacheManager`` interface on a gpukv manager.

vLLM 0.33's scheduler drives its block manager one request at a time with
``Request`` objects whose ``num_computed_tokens`` (and, under async
scheduling, ``num_in_flight_tokens``) the scheduler advances itself. gpukv's
managers count computed tokens themselves and take sampled tokens as they are
appended; this module translates one into the other call by call, so every
decision the scheduler sees (hits, block ids, refusals and so preemptions,
usage, prefix-cache stats, KV events) is vLLM 0.33's own
(``tests/test_vllm033`` holds it to that, step by step).

Where a 0.33 rule lives (one home each):

* free order (uncached blocks to the front, cached ones to the tail): the
  gpukv manager's ``uncached_first=True``;
* lookup of every full block of the request's known tokens (a resumed
  request included): gpukv's own lookup, on the tokens up to
  ``max_cache_hit_length`` (``_lookup``);
* what is cached when: gpukv caches the full blocks of its computed tokens,
  and this adapter makes gpukv's computed tokens vLLM's cached ones:
  ``min(computed + scheduled, num_tokens)`` at ``allocate_slots`` and
  ``cache_blocks``' count in ``update_from_output`` (``_target``);
* whole-prompt admission, the watermark and ``reserved_blocks``: checked here
  before gpukv is called (``_fits``), since gpukv checks only the blocks it
  is about to take;
* usage ``1 - free / (num_blocks - 1)``, prefix-cache stats in tokens at
  admission (``record_prefix_cache_stats``): here;
* KV events: gpukv's per-block events, merged into one ``BlockStored`` per
  call and group as vLLM emits them, with vLLM's block hashes (the
  request's own, converted as vLLM converts them) in place of gpukv's
  digests (``_EventTranslator``).

Out of scope (refused at construction by ``gpukv.vllm.v0_33.scheduler``, or
here with an ``UnsupportedConfigError``): KV connectors (external tokens,
delayed caching, ``evict_blocks``, ``pop_blocks_for_free``), the
aux-output connector, Mamba, fine-grained partial hits (hash block size below
the block size) and their copy-on-write, KV-cache zeroing, encoder-decoder
models, EAGLE's block drop, hash lookahead, decode context parallelism,
sliding-window and hybrid groups (``docs/design.md`` says why), multimodal
and prompt-embedding requests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gpukv.errors import InvalidInputError, InvalidTypeError
from gpukv.request import ComputedBlocks, NewRequest
from gpukv.vllm.manager import resolve_backend


class UnsupportedConfigError(InvalidInputError):
    """A vLLM 0.33 configuration or call the gpukv adapter does not follow
    (``gpukv.vllm.v0_33``'s module docstring lists them): the message says
    what and what to do instead."""


@dataclass(frozen=True, slots=True)
class Block:
    """A block as vLLM 0.33's scheduler and ``KVCacheBlocks`` read it: its id,
    whether it is the null block, and (cached blocks) vLLM's block hash and
    the tokens that hash covers (``estimate_cached_tokens`` reads those)."""

    block_id: int
    block_hash: Any = None
    block_hash_num_tokens: int | None = None

    @property
    def is_null(self) -> bool:
        return self.block_id == 0


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
    coordinator vLLM would have chosen."""

    enable_partial_hash_hits = False

    def __init__(self, kv_cache_config: Any, enable_caching: bool) -> None:
        self.single_type_managers = [
            SingleTypeView(i, group.kv_cache_spec, group.kv_cache_spec.block_size)
            for i, group in enumerate(kv_cache_config.kv_cache_groups)]
        self.vllm_kind = "UnitaryKVCacheCoordinator" if enable_caching else "KVCacheCoordinatorNoPrefixCache"

    def new_step_starts(self) -> None:
        for manager in self.single_type_managers:
            manager.new_step_starts()


class _NoBlockPool:
    """``kv_cache_manager.block_pool``: vLLM's scheduler reaches the pool
    directly only on paths the adapter refuses (copy-on-write partial hits,
    deferred frees of a KV-connector consumer); say so if one is reached."""

    def __getattr__(self, name: str) -> Any:
        raise UnsupportedConfigError(
            f"vLLM's scheduler read block_pool.{name}, which only KV-connector and copy-on-write paths do",
            argument="kv_cache_manager.block_pool",
            fix="run without a KV connector and with hash_block_size == block_size, or use vLLM's own scheduler")


def _refuse(what: str, fix: str) -> UnsupportedConfigError:
    return UnsupportedConfigError(f"gpukv's vLLM 0.33 adapter does not support {what}", argument="vllm_config",
                                  fix=fix)


def check_kv_cache_config(kv_cache_config: Any) -> int:
    """The block size of a KV-cache config the adapter follows: one or more
    full-attention groups of one block size. Anything else is refused."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    groups = getattr(kv_cache_config, "kv_cache_groups", None)
    if not groups:
        raise InvalidInputError("the KV-cache config has no groups", argument="kv_cache_config",
                                fix="pass the KVCacheConfig the engine built")
    if getattr(kv_cache_config, "has_mamba_layers", False):
        raise _refuse("Mamba layers", "use vLLM's own scheduler for Mamba models")
    if getattr(kv_cache_config, "needs_kv_cache_zeroing", False):
        raise _refuse("KV-cache zeroing", "use vLLM's own scheduler for models that need zeroed blocks")
    sizes = set()
    for group in groups:
        spec = group.kv_cache_spec
        if isinstance(spec, SlidingWindowSpec):
            raise _refuse("sliding-window groups (alone or hybrid)",
                          "use vLLM's own scheduler: 0.33's window release by processed tokens, admission cap and "
                          "hybrid hit rule are not followed yet")
        if type(spec) is not FullAttentionSpec:
            raise _refuse(f"KV-cache spec {type(spec).__name__}", "only full attention (FullAttentionSpec) runs on "
                                                                 "gpukv; use vLLM's own scheduler")
        sizes.add(spec.block_size)
    if len(sizes) != 1:
        raise _refuse(f"groups of different block sizes {sorted(sizes)}", "give every group one block size")
    return sizes.pop()


def make_backend(backend: str, *, num_blocks: int, block_size: int, num_groups: int, max_model_len: int,
                 enable_caching: bool, enable_kv_cache_events: bool, max_num_reqs: int) -> Any:
    """The gpukv manager under the adapter (device on CUDA or when asked,
    else the reference), with vLLM 0.33's free order (``uncached_first``)."""
    kwargs = dict(sliding_windows=[None] * num_groups, enable_caching=enable_caching, uncached_first=True,
                  max_model_len=max_model_len, max_num_reqs=max_num_reqs,
                  enable_kv_cache_events=enable_kv_cache_events)
    if resolve_backend(backend) == "device":
        from gpukv.manager import DeviceManager

        return DeviceManager(num_blocks, block_size, **kwargs)  # type: ignore[arg-type]
    from gpukv.reference import ReferenceManager

    return ReferenceManager(num_blocks, block_size, **kwargs)  # type: ignore[arg-type]


class _EventTranslator:
    """gpukv's KV events as vLLM 0.33 publishes them.

    gpukv emits one ``BlockStored`` per block, under its own digests; vLLM
    emits one per ``cache_full_blocks`` call and group, under the request's
    block hashes (``maybe_convert_block_hash``: 64-bit ints by default). The
    adapter drains gpukv's events after each call, so the blocks one call
    stored for one group are one run; their positions in the request give
    vLLM's hashes. A digest's vLLM hash is remembered while a block is cached
    under it, for its ``BlockRemoved``."""

    def __init__(self, kv_cache_config: Any, block_size: int) -> None:
        from vllm.v1.kv_cache_interface import (  # type: ignore[attr-defined,unused-ignore]  # (vLLM 0.33 only)
            get_kv_cache_spec_kind,
            get_kv_cache_spec_sliding_window,
        )

        self.block_size = block_size
        self.metadata = [(get_kv_cache_spec_kind(g.kv_cache_spec).value,
                          get_kv_cache_spec_sliding_window(g.kv_cache_spec)) for g in kv_cache_config.kv_cache_groups]
        self.events: list[Any] = []
        # gpukv digest -> [vLLM's external hash, blocks cached under it]
        self._known: dict[bytes, list[Any]] = {}

    def drain(self, manager: Any, request: Any | None) -> None:
        """Translate what ``manager`` logged since the last drain (one call)."""
        from gpukv import events as gk

        run: list[Any] = []
        positions: dict[bytes, int] | None = None
        for batch in manager.take_events():
            for event in batch.events:
                if isinstance(event, gk.BlockStored):
                    if run and (run[-1].group != event.group or run[-1].block_hashes[-1] != event.parent_block_hash):
                        self._stored(run, request, positions)
                        run = []
                    if positions is None:
                        assert request is not None, "blocks were stored by a call without a request"
                        positions = {d: i for i, d in enumerate(manager.block_hashes(request.request_id))}
                    run.append(event)
                    continue
                if run:
                    self._stored(run, request, positions)
                    run = []
                if isinstance(event, gk.BlockRemoved):
                    self._removed(event)
                else:
                    self._cleared()
        if run:
            self._stored(run, request, positions)

    def _stored(self, run: list[Any], request: Any, positions: dict[bytes, int] | None) -> None:
        from vllm.distributed.kv_events import BlockStored
        from vllm.v1.core.kv_cache_utils import (  # type: ignore[attr-defined,unused-ignore]  # (vLLM 0.33 only)
            generate_block_hash_extra_keys,
            maybe_convert_block_hash,
            to_event_extra_keys,
        )

        assert positions is not None and request is not None
        first = positions[run[0].block_hashes[0]]
        last = positions[run[-1].block_hashes[-1]]
        hashes = [maybe_convert_block_hash(request.block_hashes[i]) for i in range(first, last + 1)]
        digests = [d for event in run for d in event.block_hashes]
        for digest, external in zip(digests, hashes, strict=True):
            entry = self._known.setdefault(digest, [external, 0])
            entry[1] += 1
        bs = self.block_size
        extra, mm_index = [], 0
        for i in range(first, last + 1):
            keys, mm_index = generate_block_hash_extra_keys(request, i * bs, (i + 1) * bs, mm_index)
            extra.append(keys)
        lora = request.lora_request
        group = run[0].group
        kind, window = self.metadata[group]
        self.events.append(BlockStored(
            block_hashes=hashes,
            parent_block_hash=maybe_convert_block_hash(request.block_hashes[first - 1]) if first else None,
            token_ids=request.all_token_ids[first * bs:(last + 1) * bs], block_size=bs,
            lora_id=lora.adapter_id if lora else None, medium="GPU", lora_name=lora.name if lora else None,
            extra_keys=to_event_extra_keys(extra), group_idx=group, session_id=request.session_id,
            kv_cache_spec_kind=kind, kv_cache_spec_sliding_window=window))

    def _removed(self, event: Any) -> None:
        from vllm.distributed.kv_events import BlockRemoved

        for digest in event.block_hashes:
            entry = self._known[digest]
            entry[1] -= 1
            if not entry[1]:
                del self._known[digest]
            self.events.append(BlockRemoved(block_hashes=[entry[0]], medium="GPU", group_idx=event.group))

    def _cleared(self) -> None:
        from vllm.distributed.kv_events import AllBlocksCleared

        self._known.clear()
        self.events.append(AllBlocksCleared())

    def take(self) -> list[Any]:
        events, self.events = self.events, []
        return events


class KVCacheManager:
    """vLLM 0.33's ``vllm.v1.core.kv_cache_manager.KVCacheManager``, on gpukv.

    Arguments: vLLM's ``kv_cache_config`` and ``max_model_len``, its
    ``enable_caching``, ``log_stats``, ``enable_kv_cache_events`` and
    ``watermark`` (fraction of the pool kept free at admission);
    ``backend`` ("auto", "reference", "device") picks the gpukv manager
    underneath (``.manager``), ``max_num_reqs`` its first request rows.
    """

    def __init__(self, kv_cache_config: Any, max_model_len: int, *, enable_caching: bool = True,
                 log_stats: bool = False, enable_kv_cache_events: bool = False, watermark: float = 0.0,
                 backend: str = "auto", max_num_reqs: int = 64) -> None:
        from vllm.v1.core.kv_cache_manager import (  # type: ignore[attr-defined,unused-ignore]  # (vLLM 0.33 only)
            KVCacheBlocks,
        )
        from vllm.v1.metrics.stats import PrefixCacheStats

        self.block_size = check_kv_cache_config(kv_cache_config)
        if isinstance(watermark, bool) or not isinstance(watermark, (int, float)) or watermark < 0:
            raise InvalidInputError(f"watermark must be a number >= 0, got {watermark!r}", argument="watermark",
                                    fix="pass the scheduler config's watermark (0.0 by default)")
        self.kv_cache_config = kv_cache_config
        self.num_gpu_blocks: int = kv_cache_config.num_blocks
        self.num_kv_cache_groups = len(kv_cache_config.kv_cache_groups)
        self.max_model_len = max_model_len
        self.enable_caching = bool(enable_caching)
        self.log_stats = bool(log_stats)
        self.enable_kv_cache_events = bool(enable_kv_cache_events)
        self.watermark_blocks = int(watermark * self.num_gpu_blocks)
        self._stats_cls = PrefixCacheStats
        self.prefix_cache_stats = PrefixCacheStats() if log_stats else None
        self._blocks_cls = KVCacheBlocks
        self.empty_kv_cache_blocks = KVCacheBlocks(tuple(() for _ in range(self.num_kv_cache_groups)))
        self.coordinator = CoordinatorView(kv_cache_config, self.enable_caching)
        self.block_pool = _NoBlockPool()
        self.mamba_shared_prefix_checkpoint = False
        self.retained_hit_group_ids: tuple[int, ...] = ()
        self.backend = resolve_backend(backend)
        self.manager = make_backend(self.backend, num_blocks=self.num_gpu_blocks, block_size=self.block_size,
                                    num_groups=self.num_kv_cache_groups, max_model_len=max_model_len,
                                    enable_caching=self.enable_caching,
                                    enable_kv_cache_events=self.enable_kv_cache_events, max_num_reqs=max_num_reqs)
        self._events = _EventTranslator(kv_cache_config, self.block_size)
        # The requests gpukv holds for vLLM, by id (their block hashes name the cached blocks).
        self._requests: dict[str, Any] = {}
        # Each request's last lookup, handed back by allocate_slots: (what vLLM got, gpukv's hit).
        self._looked_up: dict[str, tuple[Any, ComputedBlocks]] = {}

    # ------------------------------------------------------------ reading
    @property
    def usage(self) -> float:
        """vLLM 0.33's ``1 - free / (num_blocks - 1)``: the null block is not
        part of the usable pool (reads the device)."""
        return 1.0 - self.manager.read_num_free_blocks() / (self.num_gpu_blocks - 1)

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
        return self.enable_caching and not request.skip_reading_prefix_cache

    def record_prefix_cache_stats(self, request: Any, num_hits: int) -> None:
        """An admission in the stats, in tokens (a re-admission after
        preemption as ``preempted_*``); requests that skip the cache not at all."""
        if self.prefix_cache_stats is None or not self.prefix_cache_lookup_enabled(request):
            return
        stats: Any = self.prefix_cache_stats  # (vLLM 0.33's; mypy may see 0.8.5's, without ``record``)
        stats.record(num_tokens=request.num_tokens, num_hits=num_hits, preempted=request.num_preemptions > 0)

    def get_blocks(self, request_id: str) -> Any:
        """The request's blocks per group (the shared empty instance if it holds none)."""
        request = self._requests.get(request_id)
        if request is None:
            return self.empty_kv_cache_blocks
        ids = self.manager.get_block_ids(request_id)
        cached = self._num_cached_blocks(request)
        return self.create_kv_cache_blocks(tuple(self._blocks(request, group, 0, cached) for group in ids))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block ids per group (``([],) * groups`` for an unknown id)."""
        if request_id not in self._requests:
            return tuple([] for _ in range(self.num_kv_cache_groups))
        return tuple(self.manager.get_block_ids(request_id))

    def get_block_ids_for_computed_tokens(self, request_id: str, num_computed_tokens: int) -> tuple[list[int], ...]:
        """The block ids covering the first ``num_computed_tokens`` tokens, per group."""
        n = -(-num_computed_tokens // self.block_size)
        return tuple(ids[:n] for ids in self.get_block_ids(request_id))

    def estimate_cached_tokens(self, request: Any) -> int:
        """The tokens of the request's blocks that carry a hash (vLLM's
        estimate for the prefill stats): its cached blocks, in tokens."""
        if request.request_id not in self._requests:
            return 0
        return self._num_cached_blocks(request) * self.block_size

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        """Deprecated in vLLM 0.33 (cascade attention is gone): 0 per group."""
        del running_request_id  # (vLLM's signature)
        return [0] * self.num_kv_cache_groups

    def create_kv_cache_blocks(self, blocks: tuple[Sequence[Any], ...]) -> Any:
        """``KVCacheBlocks`` of ``blocks``, or the shared empty instance when
        every group is empty (vLLM's scheduler compares with it)."""
        return self._blocks_cls(blocks) if any(blocks) else self.empty_kv_cache_blocks

    def take_events(self) -> list[Any]:
        """vLLM's KV events since the last call (``BlockStored`` annotated
        with its group's spec kind and window)."""
        return self._events.take()

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

    def new_step_starts(self) -> None:
        """vLLM's per-step hook (Mamba only)."""
        self.coordinator.new_step_starts()

    # ------------------------------------------------------------ lookups and allocation
    def get_computed_blocks(self, request: Any, max_cache_hit_length: int | None = None) -> tuple[Any, int, int]:
        """The request's cache hit: ``(KVCacheBlocks, hit tokens, 0)`` (the
        shared-prefix boundary is 0 without sparse-retention groups). The hit
        covers at most ``max_cache_hit_length`` tokens (None: all but the last
        token), whole blocks of its known tokens."""
        if not self.prefix_cache_lookup_enabled(request):
            return self.empty_kv_cache_blocks, 0, 0
        self._check_request(request)
        limit = request.num_tokens - 1 if max_cache_hit_length is None else max_cache_hit_length
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise InvalidInputError(f"max_cache_hit_length must be None or an int >= 0, got {limit!r}",
                                    argument="max_cache_hit_length", fix="pass None for num_tokens - 1")
        computed = self._lookup(request, min(limit, request.num_tokens - 1) // self.block_size)
        if not computed.num_tokens:
            self._looked_up.pop(request.request_id, None)
            return self.empty_kv_cache_blocks, 0, 0
        blocks = self.create_kv_cache_blocks(tuple(self._blocks(request, ids, 0, len(ids))
                                                   for ids in computed.block_ids))
        self._looked_up[request.request_id] = (blocks, computed)
        return blocks, computed.num_tokens, 0

    def allocate_slots(self, request: Any, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: Any = None, num_lookahead_tokens: int = 0,
                       num_external_computed_tokens: int = 0, delay_cache_blocks: bool = False,
                       num_encoder_tokens: int = 0, full_sequence_must_fit: bool = False, reserved_blocks: int = 0,
                       has_scheduled_reqs: bool = True, skip_zeroing_group_ids: tuple[int, ...] = ()) -> Any:
        """Blocks for ``num_new_tokens`` more tokens (past the hit of a request
        not yet admitted) and ``num_lookahead_tokens`` slots: the new blocks
        (``KVCacheBlocks``, the empty instance when none are new), or None
        when they do not fit, nothing changed then. Caches the full blocks of
        ``min(computed + num_new_tokens, num_tokens)`` tokens, as vLLM does."""
        if num_external_computed_tokens or delay_cache_blocks or skip_zeroing_group_ids:
            raise UnsupportedConfigError("external (KV-connector) tokens, delayed caching and zeroing are not "
                                         "followed by gpukv's adapter", argument="num_external_computed_tokens",
                                         fix="run without a KV connector, or use vLLM's own scheduler")
        if num_encoder_tokens:
            raise UnsupportedConfigError("encoder tokens (encoder-decoder models) are not followed by gpukv's "
                                         "adapter", argument="num_encoder_tokens", fix="use vLLM's own scheduler")
        _check_count(num_new_tokens, "num_new_tokens", 1 if not num_new_computed_tokens else 0)
        _check_count(num_lookahead_tokens, "num_lookahead_tokens", 0)
        _check_count(reserved_blocks, "reserved_blocks", 0)
        self._check_request(request)
        if request.is_finished():
            raise InvalidInputError(f"request {request.request_id!r} is finished", argument="request",
                                    fix="allocate only for waiting or running requests")
        if request.request_id in self._requests:
            if num_new_computed_tokens or _has_blocks(new_computed_blocks):
                raise InvalidInputError(f"request {request.request_id!r} is running; computed blocks are for "
                                        "admission only", argument="new_computed_blocks",
                                        fix="pass no computed blocks for a running request")
            return self._grow(request, num_new_tokens, num_lookahead_tokens, reserved_blocks)
        return self._admit(request, num_new_tokens, num_new_computed_tokens, new_computed_blocks,
                           num_lookahead_tokens, full_sequence_must_fit, reserved_blocks, has_scheduled_reqs)

    def cache_blocks(self, request: Any, num_computed_tokens: int) -> None:
        """Cache the request's full blocks up to ``num_computed_tokens`` tokens
        (vLLM 0.33's ``update_from_output`` under async scheduling or
        speculative decoding: blocks the verified tokens filled)."""
        rid = request.request_id
        if not self.enable_caching or rid not in self._requests:
            return
        _check_count(num_computed_tokens, "num_computed_tokens", 0)
        (held,), (computed,) = (a.tolist() for a in self.manager.row_token_counts([self.manager.row_of(rid)]))
        target = min(num_computed_tokens, request.num_tokens)
        if target // self.block_size <= computed // self.block_size:
            return  # no block more is full: nothing to cache (nor to tell gpukv)
        chunk = None if target == request.num_tokens else target - computed
        self.manager.allocate_slots(rid, request.all_token_ids[held:], num_tokens=chunk, num_lookahead_tokens=0)
        self._drain(request)

    def free(self, request: Any) -> None:
        """Give back the request's blocks (tail first, group by group; vLLM
        0.33's free order is gpukv's ``uncached_first``). A request holding
        none (waiting, or preempted already) frees nothing."""
        rid = request.request_id
        self._looked_up.pop(rid, None)
        if self._requests.pop(rid, None) is not None:
            self.manager.free(rid)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block when no request holds one (else False)."""
        ok = bool(self.manager.reset_prefix_cache())
        if ok and self.prefix_cache_stats is not None:
            self.prefix_cache_stats.reset = True
        self._drain(None)
        return ok

    # ------------------------------------------------------------ KV-connector paths: refused
    # vLLM's KV-connector, copy-on-write and zeroing hooks: refused, saying so.
    def get_computed_blocks_for_connector(self, *_args: Any, **_kwargs: Any) -> Any:
        raise _connector_only("get_computed_blocks_for_connector")

    def truncate_computed_blocks(self, *_args: Any, **_kwargs: Any) -> Any:
        raise _connector_only("truncate_computed_blocks")

    def remove_skipped_blocks(self, *_args: Any, **_kwargs: Any) -> Any:
        raise _connector_only("remove_skipped_blocks")

    def pop_blocks_for_free(self, *_args: Any, **_kwargs: Any) -> Any:
        raise _connector_only("pop_blocks_for_free")

    def evict_blocks(self, *_args: Any, **_kwargs: Any) -> Any:
        raise _connector_only("evict_blocks")

    def record_blocks_for_zeroing(self, *_args: Any, **_kwargs: Any) -> Any:
        raise _connector_only("record_blocks_for_zeroing")

    # ------------------------------------------------------------ inspection (not vLLM's)
    def num_free_blocks(self) -> int:
        """Free blocks, evictable cached ones included (reads the device)."""
        return self.manager.read_num_free_blocks()

    def request_ids(self) -> list[str]:
        """Ids of the requests holding blocks."""
        return list(self._requests)

    def check_invariants(self) -> None:
        """The manager's invariants, and the adapter holding what it holds."""
        self.manager.check_invariants()
        held = set(self.manager.request_ids())
        if held != set(self._requests):
            raise AssertionError(f"the adapter's requests {sorted(self._requests)} are not the manager's "
                                 f"{sorted(held)}")

    # ------------------------------------------------------------ internals
    def _check_request(self, request: Any) -> None:
        """A request the adapter can follow: some tokens, within
        ``max_model_len``, no multimodal inputs or prompt embeddings (whose
        extra keys gpukv does not derive as vLLM 0.33 does)."""
        rid = getattr(request, "request_id", None)
        if not isinstance(rid, str):
            raise InvalidTypeError(f"expected a vLLM Request, got {type(request).__name__}", argument="request",
                                   fix="pass a vllm.v1.request.Request")
        if not request.num_tokens:
            raise InvalidInputError(f"request {rid!r} has no tokens", argument="request",
                                    fix="give the request a prompt of at least one token")
        if request.num_tokens > self.max_model_len:
            raise InvalidInputError(f"request {rid!r} has {request.num_tokens} tokens, more than max_model_len="
                                    f"{self.max_model_len}", argument="request",
                                    fix="finish or truncate requests at max_model_len")
        if request.mm_features or request.prompt_embeds is not None:
            raise UnsupportedConfigError(f"request {rid!r} has multimodal inputs or prompt embeddings, which "
                                         "gpukv's vLLM 0.33 adapter does not hash as vLLM does", argument="request",
                                         fix="send text prompts, or use vLLM's own scheduler")

    def _new_request(self, request: Any, tokens: Any, chunk: int | None = None, lookahead: int = 0) -> NewRequest:
        lora = request.lora_request
        return NewRequest(request.request_id, tokens, lora_id=lora.adapter_id if lora else None,
                          cache_salt=request.cache_salt, skip_prefix_cache=request.skip_reading_prefix_cache,
                          num_tokens_to_compute=chunk, num_lookahead_tokens=lookahead)

    def _lookup(self, request: Any, max_hit_blocks: int) -> ComputedBlocks:
        """gpukv's lookup on the tokens a hit of ``max_hit_blocks`` blocks can
        cover (gpukv never hits a request's last token)."""
        if max_hit_blocks <= 0:
            return ComputedBlocks([[] for _ in range(self.num_kv_cache_groups)], 0)
        end = max_hit_blocks * self.block_size + 1
        return self.manager.get_computed_blocks(self._new_request(request, request.all_token_ids[:end]))

    def _computed_for(self, request: Any, num_new_computed_tokens: int, blocks: Any) -> ComputedBlocks | None:
        """gpukv's hit for the computed blocks vLLM hands back: those of the
        request's last lookup, or none."""
        if not _has_blocks(blocks):
            if num_new_computed_tokens:
                raise InvalidInputError(f"num_new_computed_tokens={num_new_computed_tokens} without computed blocks",
                                        argument="new_computed_blocks", fix="pass what get_computed_blocks returned")
            return None
        looked_up = self._looked_up.get(request.request_id)
        if looked_up is None or (blocks is not looked_up[0] and blocks.get_block_ids() != looked_up[0].get_block_ids()):
            raise InvalidInputError(f"new_computed_blocks are not the hit of request {request.request_id!r}'s last "
                                    "lookup", argument="new_computed_blocks",
                                    fix="call get_computed_blocks(request) and pass its blocks unchanged")
        computed = looked_up[1]
        if num_new_computed_tokens != computed.num_tokens:
            raise InvalidInputError(f"num_new_computed_tokens={num_new_computed_tokens} is not the hit's "
                                    f"{computed.num_tokens} tokens", argument="num_new_computed_tokens",
                                    fix="pass the token count get_computed_blocks returned")
        return computed

    def _admit(self, request: Any, num_new_tokens: int, num_new_computed_tokens: int, blocks: Any,
               num_lookahead_tokens: int, full_sequence_must_fit: bool, reserved_blocks: int,
               has_scheduled_reqs: bool) -> Any:
        """Admit a request gpukv does not hold, with its last lookup's hit."""
        from vllm.v1.request import RequestStatus

        if request.num_computed_tokens:
            raise UnsupportedConfigError(f"request {request.request_id!r} comes with {request.num_computed_tokens} "
                                         "computed tokens but holds no blocks (a KV-connector path)",
                                         argument="request", fix="run without a KV connector")
        computed = self._computed_for(request, num_new_computed_tokens, blocks)
        hit = computed.num_tokens if computed is not None else 0
        hit_ids = computed.block_ids if computed is not None else [[]] * self.num_kv_cache_groups
        watermark = self.watermark_blocks if has_scheduled_reqs and request.status in (
            RequestStatus.WAITING, RequestStatus.PREEMPTED) else 0
        touched = self._num_evictable(hit_ids) if hit else 0
        need_slot = min(hit + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        target = min(hit + num_new_tokens, request.num_tokens)
        hit_blocks = hit // self.block_size
        if full_sequence_must_fit:
            full = self._blocks_for(min(request.num_tokens, self.max_model_len))
            if not self._fits(max(full - hit_blocks, 0) + touched, watermark, 0):
                return None
        if (watermark or reserved_blocks) and not self._fits(
                max(self._blocks_for(need_slot) - hit_blocks, 0) + touched, watermark, reserved_blocks):
            return None
        new = self.manager.allocate_slots(self._new_request(request, request.all_token_ids[:]), computed=computed,
                                          num_tokens=target - hit, num_lookahead_tokens=need_slot - target)
        self._looked_up.pop(request.request_id, None)
        if new is None:
            return None
        self._requests[request.request_id] = request
        self._drain(request)
        return self._new_blocks(new)

    def _grow(self, request: Any, num_new_tokens: int, num_lookahead_tokens: int, reserved_blocks: int) -> Any:
        """More blocks for a running request: gpukv appends what vLLM appended
        and computes (so caches) vLLM's cached tokens; the rest of vLLM's
        slots (drafts, placeholders, lookahead) are gpukv lookahead slots."""
        rid = request.request_id
        (held,), (computed,) = (a.tolist() for a in self.manager.row_token_counts([self.manager.row_of(rid)]))
        total = min(request.num_computed_tokens, self.max_model_len)
        need_slot = min(total + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        target = max(min(total + num_new_tokens, request.num_tokens), computed)
        if reserved_blocks and not self._fits(self._blocks_to_grow(rid, need_slot), 0, reserved_blocks):
            return None
        chunk = None if target == request.num_tokens else target - computed
        if chunk == 0:
            raise AssertionError(f"request {rid!r}: vLLM schedules {num_new_tokens} tokens past "
                                 f"{request.num_computed_tokens} computed, none of them past gpukv's {computed}")
        new = self.manager.allocate_slots(rid, request.all_token_ids[held:], num_tokens=chunk,
                                          num_lookahead_tokens=need_slot - target)
        if new is None:
            return None
        self._drain(request)
        return self._new_blocks(new)

    def _fits(self, num_blocks: int, watermark: int, reserved: int) -> bool:
        """vLLM's fit check: the blocks to take plus the watermark within the
        free blocks less ``reserved`` (reads the device)."""
        return num_blocks + watermark <= self.manager.read_num_free_blocks() - reserved

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size) * self.num_kv_cache_groups

    def _blocks_to_grow(self, request_id: str, num_tokens: int) -> int:
        per_group = -(-num_tokens // self.block_size)
        return sum(max(per_group - len(ids), 0) for ids in self.manager.get_block_ids(request_id))

    def _num_evictable(self, hit_ids: Sequence[Sequence[int]]) -> int:
        """Hit blocks no request holds: a hit takes them out of the free
        queue, so they count as blocks to take (vLLM's fit check)."""
        ids = sorted({b for group in hit_ids for b in group if b})
        if not ids:
            return 0
        pool = self.manager.pool
        if self.backend == "device":
            return int((pool.ref_cnt[ids] == 0).sum().item())
        return sum(1 for b in ids if pool.ref_cnt[b] == 0)

    def _num_cached_blocks(self, request: Any) -> int:
        """Leading blocks of a held request that are cached: the full blocks
        of gpukv's computed tokens (gpukv caches exactly those)."""
        if not self.enable_caching:
            return 0
        return min(self.manager.num_computed_tokens(request.request_id), request.num_tokens) // self.block_size

    def _blocks(self, request: Any, ids: Sequence[int], start: int, num_cached: int) -> list[Block]:
        """``Block``\\ s for ``ids`` at positions from ``start``: those before
        ``num_cached`` carry the request's vLLM block hash."""
        bs = self.block_size
        hashes = request.block_hashes
        return [Block(b, hashes[i], (i + 1) * bs) if i < num_cached else Block(b)
                for i, b in enumerate(ids, start)]

    def _new_blocks(self, new: list[list[int]]) -> Any:
        """The ``KVCacheBlocks`` of blocks an allocation just took: ids only,
        all vLLM's scheduler reads of them (``get_blocks`` gives hashes)."""
        if not any(new):
            return self.empty_kv_cache_blocks
        return self._blocks_cls(tuple([Block(b) for b in group] for group in new))

    def _drain(self, request: Any | None) -> None:
        if self.enable_kv_cache_events:
            self._events.drain(self.manager, request)


def _has_blocks(blocks: Any) -> bool:
    return blocks is not None and any(blocks.blocks)


def _check_count(value: Any, argument: str, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidInputError(f"{argument} must be an int >= {minimum}, got {value!r}", argument=argument,
                                fix=f"pass a count of at least {minimum}")


def _connector_only(name: str) -> UnsupportedConfigError:
    return UnsupportedConfigError(f"{name} belongs to KV-connector and copy-on-write paths, which gpukv's vLLM 0.33 "
                                  "adapter does not follow", argument=name,
                                  fix="run without a KV connector, or use vLLM's own scheduler")
