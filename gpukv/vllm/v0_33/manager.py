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
  ``max_cache_hit_length`` (``_lookup``); a sliding window's hit and the
  hybrid fixpoint are gpukv's (``gpukv.core.windows``, the same rules);
* what is cached when: gpukv caches the full blocks of its computed tokens,
  and this adapter makes gpukv's computed tokens vLLM's cached ones:
  ``min(computed + scheduled, num_tokens)`` at ``allocate_slots`` and
  ``cache_blocks``' count in ``update_from_output`` (``_target``);
* whole-prompt admission (window groups' reservation capped), the watermark
  and ``reserved_blocks``: checked here before gpukv is called (``_fits``,
  the counts ``groups.KVGroups.blocks_to_admit``), since gpukv checks only
  the blocks it is about to take;
* window release by processed tokens (``total_computed -
  num_in_flight_tokens``, ``kv_cache_manager.py:555-568``): ``_grow`` hands
  vLLM's count to gpukv's ``allocate_slots(num_processed_tokens=...)``, and
  the gpukv manager releases behind it (``gpukv.core.windows``:
  ``released_until``); ``cache_blocks`` releases nothing, as vLLM's;
* the shared-prefix boundary (``get_computed_blocks``' third value): vLLM's
  first lookup group's lone hit when longer than the hit: gpukv's
  full-attention hit where that group is every full-attention group
  (``ComputedBlocks.full_attention_hit_tokens``), else from the index of
  cached hashes per group that the event stream keeps (``events``);
* the null block: id 0, one for every group, no hash (``views.Block``);
* usage ``1 - free / (num_blocks - 1)``, prefix-cache stats in tokens at
  admission (``record_prefix_cache_stats``): here;
* KV events: gpukv's per-block events, merged into one ``BlockStored`` per
  call and group as vLLM emits them, with vLLM's block hashes (the
  request's own, converted as vLLM converts them) in place of gpukv's
  digests, tagged with the group's kind and window (``events``).

Out of scope (refused at construction by ``gpukv.vllm.v0_33.scheduler``, or
here with an ``UnsupportedConfigError``): KV connectors (external tokens,
delayed caching, ``evict_blocks``, ``pop_blocks_for_free``), the
aux-output connector, Mamba, fine-grained partial hits (hash block size below
the block size) and their copy-on-write, KV-cache zeroing, encoder-decoder
models, EAGLE's block drop, hash lookahead, decode context parallelism,
sparse retention and windows under 2 tokens, prompt-embedding requests.
Multimodal requests are followed (their items keyed as vLLM keys them:
``mm_items``), each admitted on the per-request path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gpukv.core.requests import ComputedBlocks, NewRequest, PrefixHit, RunningUpdate
from gpukv.errors import InvalidInputError
from gpukv.vllm.v0_8.manager import resolve_backend
from gpukv.vllm.v0_33 import features
from gpukv.vllm.v0_33.admission_fit import blocks_fit, watermark_blocks
from gpukv.vllm.v0_33.admissions import AdmittedRun
from gpukv.vllm.v0_33.binding import BINDING
from gpukv.vllm.v0_33.events import EventTranslator
from gpukv.vllm.v0_33.groups import UnsupportedConfigError, check_kv_cache_config
from gpukv.vllm.v0_33.lookups import CacheLookups, flushing
from gpukv.vllm.v0_33.lora_ids import LoraIds
from gpukv.vllm.v0_33.mm_items import mm_items
from gpukv.vllm.v0_33.pending import RELEASES, PendingGrowth, growth
from gpukv.vllm.v0_33.request_admission import RequestAdmission
from gpukv.vllm.v0_33.screening import check_request
from gpukv.vllm.v0_33.views import (
    Block,
    CoordinatorView,
    InertHooks,
    NoBlockPool,
    PrefixCacheStatsRules,
    empty_blocks_class,
    has_blocks,
    id_blocks_class,
)
from gpukv.vllm.v0_33.window_releases import WindowReleases, processed_tokens

__all__ = ["Block", "KVCacheManager", "UnsupportedConfigError", "check_kv_cache_config", "check_request",
           "make_backend"]

#: ``allocate_slots``' defaults as vLLM's running loop leaves them: that call is
#: recognised by identity (any other object, equal or not, takes the full path).
_ZERO = 0
_NO_GROUPS = ()


def make_backend(backend: str, *, num_blocks: int, block_size: int, windows: tuple[int | None, ...],
                 max_model_len: int, enable_caching: bool, enable_kv_cache_events: bool, max_num_reqs: int,
                 max_num_batched_tokens: int | None = None) -> Any:
    """The gpukv manager under the adapter, ``backend`` ("device" or
    "reference", as ``resolve_backend`` gives it), one group per window (None: full attention), with
    vLLM 0.33's free order (``uncached_first``). Under ``gpukv.vllm.Worker``
    the device manager is sized to the model runner's tables and published
    to it (``gpukv.vllm.v0_33.binding``)."""

    max_num_reqs, max_model_len = BINDING.sized(backend, block_size, len(windows), max_num_reqs, max_model_len)
    kwargs = dict(sliding_windows=list(windows), enable_caching=enable_caching, uncached_first=True,
                  max_model_len=max_model_len, max_num_reqs=max_num_reqs,
                  enable_kv_cache_events=enable_kv_cache_events, max_num_batched_tokens=max_num_batched_tokens)
    if backend == "device":
        from gpukv.device.manager import DeviceManager

        return BINDING.publish(DeviceManager(num_blocks, block_size, **kwargs))  # type: ignore[arg-type]
    from gpukv.reference.manager import ReferenceManager

    return ReferenceManager(num_blocks, block_size, **kwargs)  # type: ignore[arg-type]


class KVCacheManager(CacheLookups, RequestAdmission, PrefixCacheStatsRules, InertHooks):
    """vLLM 0.33's ``vllm.v1.core.kv_cache_manager.KVCacheManager``, on gpukv.

    Arguments: vLLM's ``kv_cache_config`` and ``max_model_len``, its
    ``enable_caching``, ``log_stats``, ``enable_kv_cache_events``,
    ``watermark`` (fraction of the pool kept free at admission) and
    ``max_in_flight_tokens`` (sizes window groups' admission caps; None:
    ``max_model_len``, vLLM's default);
    ``backend`` ("auto", "reference", "device") picks the gpukv manager
    underneath (``.manager``), ``max_num_reqs`` its first request rows,
    ``max_num_batched_tokens`` the scheduler's (the device manager sizes its
    admission buffers by it; None: by the prompts alone).

    ``batching`` (set by ``gpukv.vllm.v0_33``'s schedulers for the span of a
    ``schedule()``): running requests' allocations are answered on the host
    and applied as one gpukv step (``gpukv.vllm.v0_33.pending``), when every
    group is full attention (KV events regrouped into vLLM's per-call order:
    ``events``); ``flush()`` applies them
    (every method that reads or changes gpukv's state does so first).
    """

    def __init__(self, kv_cache_config: Any, max_model_len: int, *, enable_caching: bool = True,
                 log_stats: bool = False, enable_kv_cache_events: bool = False, watermark: float = 0.0,
                 max_in_flight_tokens: int | None = None, backend: str = "auto", max_num_reqs: int = 64,
                 max_num_batched_tokens: int | None = None) -> None:
        from vllm.v1.core.kv_cache_manager import (  # type: ignore[attr-defined,unused-ignore]  # (vLLM 0.33 only)
            KVCacheBlocks,
        )
        from vllm.v1.metrics.stats import PrefixCacheStats
        from vllm.v1.request import RequestStatus

        self.groups = check_kv_cache_config(kv_cache_config, max_model_len, max_in_flight_tokens)
        self.block_size = self.groups.block_size
        self.kv_cache_config = kv_cache_config
        self.num_gpu_blocks: int = kv_cache_config.num_blocks
        self.num_kv_cache_groups = len(kv_cache_config.kv_cache_groups)
        self.max_model_len = max_model_len
        self.enable_caching = bool(enable_caching)
        self.log_stats = bool(log_stats)
        self.enable_kv_cache_events = bool(enable_kv_cache_events)
        self.watermark_blocks = watermark_blocks(watermark, self.num_gpu_blocks)
        self._stats_cls = PrefixCacheStats
        self._running_status = RequestStatus.RUNNING  # (a running request, so not finished: the fast path's test)
        self.prefix_cache_stats = PrefixCacheStats() if log_stats else None
        self.blocks_class = KVCacheBlocks
        self._id_blocks_cls = id_blocks_class(KVCacheBlocks)  # (the Block objects built only when read)
        # (the instance every call that takes no new block hands back: its ids answered without vLLM's loop)
        no_blocks = tuple(() for _ in range(self.num_kv_cache_groups))
        self.empty_kv_cache_blocks = empty_blocks_class(KVCacheBlocks)(no_blocks)
        self.coordinator = CoordinatorView(kv_cache_config, self.enable_caching)
        self.block_pool = NoBlockPool()
        self.mamba_shared_prefix_checkpoint = False
        self.retained_hit_group_ids: tuple[int, ...] = ()
        self.backend = resolve_backend(backend)
        # The boundary is one lookup group's lone hit: gpukv's full-attention hit, or else an index of what each
        # group cached (``KVGroups.needs_hit_index``).
        self.event_translator = EventTranslator(kv_cache_config, self.block_size,
                                                publish=self.enable_kv_cache_events,
                                                index=self.enable_caching and self.groups.needs_hit_index)
        self.manager = make_backend(self.backend, num_blocks=self.num_gpu_blocks, block_size=self.block_size,
                                    windows=self.groups.windows, max_model_len=max_model_len,
                                    enable_caching=self.enable_caching,
                                    enable_kv_cache_events=self.event_translator.active, max_num_reqs=max_num_reqs,
                                    max_num_batched_tokens=max_num_batched_tokens)
        # The requests gpukv holds for vLLM, by id (their block hashes name the cached blocks).
        self._requests: dict[str, Any] = {}
        # Their [row, block positions per group, gpukv's computed tokens, its known tokens]: the batched path's
        # host arithmetic and new tokens, cache_blocks' early-out, with no call to the manager.
        self._held: dict[str, list[int]] = {}
        # The last admission's (request id, block ids): vLLM's get_blocks right after it needs no read.
        self._admitted: tuple[str, list[list[int]]] | None = None
        # Each request's last lookup, handed back by allocate_slots: (what vLLM got, gpukv's hit).
        self._looked_up: dict[str, tuple[Any, ComputedBlocks | PrefixHit]] = {}
        self.batching = False
        # The batched path answers on the host only what host arithmetic decides (module docstring); in a window
        # model, what each held request's next running call releases (``window_releases``; None: no window).
        self.windows = (WindowReleases(self.groups.policies, self.block_size, self.enable_caching)
                        if self.groups.has_windows else None)
        self.pending = PendingGrowth(self)  # (the running loop's calls, answered, not yet applied)
        self.admissions = AdmittedRun(self)  # (the waiting loop's run of admissions, answered from one step)
        self.waiting_run: Any = None  # (set by the scheduler: the run of waiting requests to admit as one step)
        self.num_scheduled_tokens = 0  # (the running loop's tokens this schedule(), for the waiting run's budget)
        self.num_scheduled_requests = 0  # (and the requests they are for: each takes vLLM's draft slots)
        # Requests the scheduler refused after a sampled token gpukv cannot hold: finished in this update, never
        # handed to gpukv again (``gpukv.vllm.v0_33.screening``).
        self.refused: dict[str, str] = {}
        # gpukv's int for each LoRA adapter, as vLLM's block hashes tell adapters apart (not vLLM's lora_int_id).
        self.lora_ids = LoraIds()
        # A gpukv worker's model runner reads gpukv's device tables (``binding``): vLLM's SchedulerOutput then
        # carries no block ids, and the batched path reads none back.
        self.ids_on_device = BINDING.reads_block_ids_on_device and self.backend == "device"

    @property
    def reads_vllm_hashes(self) -> bool:
        """Whether the adapter reads vLLM's request block hashes: for KV
        events (vLLM's hashes in ``BlockStored``) and for the shared-prefix
        boundary's index (``KVGroups.needs_hit_index``). Else vLLM's engine
        need not hash (``gpukv.vllm.v0_33.engine_hashing``)."""
        return self.event_translator.active

    # ------------------------------------------------------------ reading
    def flush(self) -> None:
        """Apply the running requests' pending allocations (one gpukv step)."""
        self.pending.flush()

    @property
    @flushing
    def usage(self) -> float:
        """vLLM 0.33's ``1 - free / (num_blocks - 1)``: the null block is not
        part of the usable pool. The device manager answers from its host
        mirror of the last step's free count: no device read, and a wait for
        gpukv's own work only, never the model's."""
        return 1.0 - self.manager.read_num_free_blocks() / (self.num_gpu_blocks - 1)

    @flushing
    def get_blocks(self, request_id: str) -> Any:
        """The request's blocks per group (the shared empty instance if it
        holds none, or when its ids stay on the device: ``ids_on_device``)."""
        request = self._requests.get(request_id)
        if request is None or self.ids_on_device:
            return self.empty_kv_cache_blocks
        admitted, self._admitted = self._admitted, None
        ids = admitted[1] if admitted is not None and admitted[0] == request_id else self.manager.get_block_ids(
            request_id)
        return self.id_blocks(tuple(ids), request, self._num_cached_blocks(request))

    @flushing
    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block ids per group (``([],) * groups`` for an unknown id)."""
        if request_id not in self._requests:
            return tuple([] for _ in range(self.num_kv_cache_groups))
        return tuple(self.manager.get_block_ids(request_id))

    def get_block_ids_for_computed_tokens(self, request_id: str, num_computed_tokens: int) -> tuple[list[int], ...]:
        """The block ids covering the first ``num_computed_tokens`` tokens, per group."""
        n = -(-num_computed_tokens // self.block_size)
        return tuple(ids[:n] for ids in self.get_block_ids(request_id))

    @flushing
    def estimate_cached_tokens(self, request: Any) -> int:
        """The tokens of the request's blocks that carry a hash (vLLM's
        estimate for the prefill stats): its cached blocks, in tokens."""
        if request.request_id not in self._requests:
            return 0
        return self._num_cached_blocks(request) * self.block_size

    def create_kv_cache_blocks(self, blocks: tuple[Sequence[Any], ...]) -> Any:
        """``KVCacheBlocks`` of ``blocks``, or the shared empty instance when
        every group is empty (vLLM's scheduler compares with it)."""
        return self.blocks_class(blocks) if any(blocks) else self.empty_kv_cache_blocks

    def id_blocks(self, ids: tuple[Any, ...], request: Any = None, num_cached: int = 0) -> Any:
        """``KVCacheBlocks`` of block ids per group (lists or int arrays), its
        ``Block`` objects built only if something reads ``blocks`` (the first
        ``num_cached`` of each group carrying ``request``'s block hashes), or
        the shared empty instance when every group is empty."""
        if not any(len(group) for group in ids):
            return self.empty_kv_cache_blocks
        return self._id_blocks_cls(ids, request, num_cached, self.block_size)

    @flushing
    def take_events(self) -> list[Any]:
        """vLLM's KV events since the last call (``BlockStored`` annotated
        with its group's spec kind and window)."""
        return self.event_translator.take()

    def new_step_starts(self) -> None:
        """vLLM's per-step hook (Mamba only)."""
        self.coordinator.new_step_starts()

    # ------------------------------------------------------------ lookups and allocation
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
        self._admitted = None  # (get_blocks' shortcut: only right after the admission)
        if (self.batching and type(num_new_tokens) is int and type(num_lookahead_tokens) is int
                and new_computed_blocks is None and delay_cache_blocks is False and num_new_computed_tokens is _ZERO
                and num_external_computed_tokens is _ZERO and num_encoder_tokens is _ZERO
                and reserved_blocks is _ZERO and skip_zeroing_group_ids is _NO_GROUPS
                and num_new_tokens > 0 and num_lookahead_tokens >= 0):
            # vLLM's running loop's call, answered on the host (``pending.add``), after the checks the full path
            # makes, in its order (a refusal raised here is the one it raises); any other request takes that path.
            known = check_request(request, self.max_model_len)
            held = self._held.get(request.request_id)
            if held is not None and request.status is self._running_status:
                return self._answer_running(request, held, known, num_new_tokens, num_lookahead_tokens)
        if num_external_computed_tokens or delay_cache_blocks or skip_zeroing_group_ids:
            raise UnsupportedConfigError("external (KV-connector) tokens, delayed caching and zeroing are not "
                                         "followed by gpukv's adapter", argument="num_external_computed_tokens",
                                         fix="run without a KV connector, or use vLLM's own scheduler")
        if num_encoder_tokens:
            raise UnsupportedConfigError("encoder tokens (encoder-decoder models) are not followed by gpukv's "
                                         "adapter", argument="num_encoder_tokens", fix="use vLLM's own scheduler")
        _check_counts(num_new_tokens, num_new_computed_tokens, num_lookahead_tokens, reserved_blocks)
        check_request(request, self.max_model_len)
        if request.is_finished():
            raise InvalidInputError(f"request {request.request_id!r} is finished", argument="request",
                                    fix="allocate only for waiting or running requests")
        if request.request_id in self._requests:
            if num_new_computed_tokens or (new_computed_blocks is not None and has_blocks(new_computed_blocks)):
                raise InvalidInputError(f"request {request.request_id!r} is running; computed blocks are for "
                                        "admission only", argument="new_computed_blocks",
                                        fix="pass no computed blocks for a running request")
            if self.batching and not reserved_blocks:
                return self._answer_running(request, self._held[request.request_id], request.num_tokens,
                                            num_new_tokens, num_lookahead_tokens)
            self.flush()
            return self._grow(request, num_new_tokens, num_lookahead_tokens, reserved_blocks)
        self.flush()
        entry = self.admissions.allocate(request, num_new_tokens, num_new_computed_tokens, new_computed_blocks,
                                         num_lookahead_tokens)
        if entry is not None:
            self._record_admission(request, entry.block_ids)
            return entry.new_blocks
        return self._admit(request, num_new_tokens, num_new_computed_tokens, new_computed_blocks,
                           num_lookahead_tokens, full_sequence_must_fit, reserved_blocks, has_scheduled_reqs)

    def _answer_running(self, request: Any, held: list[int], known: int, num_new_tokens: int,
                        num_lookahead_tokens: int) -> Any:
        """A running request's call on the batched path: answered on the host
        (``pending.add``), or, for a window model's call one step cannot make
        as vLLM does (``RELEASES``), made on the per-request path after the
        calls before it are applied (vLLM's own order: its release, its fit,
        its take)."""
        blocks = self.pending.add(request, held, known, num_new_tokens, num_lookahead_tokens)
        if blocks is RELEASES:
            self.flush()
            blocks = self._grow(request, num_new_tokens, num_lookahead_tokens, 0)
        if blocks is not None:
            self.num_scheduled_tokens += num_new_tokens
            self.num_scheduled_requests += 1
        return blocks

    @flushing
    def cache_blocks(self, request: Any, num_computed_tokens: int) -> None:
        """Cache the request's full blocks up to ``num_computed_tokens`` tokens
        (vLLM 0.33's ``update_from_output`` under async scheduling or
        speculative decoding: blocks the verified tokens filled); releases
        nothing, as vLLM's (``num_processed_tokens=0``: no window block is
        released behind 0 tokens)."""
        rid, self._admitted = request.request_id, None
        if not self.enable_caching or rid not in self._requests or rid in self.refused:
            return
        _check_count(num_computed_tokens, "num_computed_tokens", 0)
        target = min(num_computed_tokens, request.num_tokens)
        if target // self.block_size <= self._held[rid][2] // self.block_size:
            return  # no block more is full: nothing to cache (nor to tell gpukv)
        _, _, computed, held = self._held[rid]
        chunk = None if target == request.num_tokens else target - computed
        self._extend(rid, request.all_token_ids[held:], chunk, 0, 0)
        self.note_held(rid)
        self._drain(request)

    @flushing
    def free(self, request: Any) -> None:
        """Give back the request's blocks (tail first, group by group; vLLM
        0.33's free order is gpukv's ``uncached_first``). A request holding
        none (waiting, or preempted already) frees nothing."""
        rid, self._admitted = request.request_id, None
        self._looked_up.pop(rid, None)
        self._held.pop(rid, None)
        if self.windows is not None:
            self.windows.forget(rid)
        self.refused.pop(rid, None)
        if self._requests.pop(rid, None) is not None:
            self.manager.free(rid)

    @flushing
    def reset_prefix_cache(self) -> bool:
        """Forget every cached block when no request holds one (else False)."""
        ok = bool(self.manager.reset_prefix_cache())
        if ok and self.prefix_cache_stats is not None:
            self.prefix_cache_stats.reset = True
        self._drain(None)
        return ok

    # ------------------------------------------------------------ inspection (not vLLM's)
    @flushing
    def num_free_blocks(self) -> int:
        """Free blocks, evictable cached ones included (reads the device)."""
        return self.manager.read_num_free_blocks()

    @flushing
    def request_ids(self) -> list[str]:
        """Ids of the requests holding blocks."""
        return list(self._requests)

    @flushing
    def check_invariants(self) -> None:
        """The manager's invariants, and the adapter holding what it holds."""
        self.manager.check_invariants()
        held = set(self.manager.request_ids())
        m = self.manager
        for rid, record in self._held.items():
            if record != [m.row_of(rid), m.num_blocks_held(rid), m.num_computed_tokens(rid),
                          int(m.row_token_counts([m.row_of(rid)])[0][0])]:
                raise AssertionError(f"request {rid!r}: the adapter's row, block positions, computed and known "
                                     f"tokens {record} are not the manager's")
        if self.windows is not None:
            for rid in self._held:
                self.windows.check(rid, m.num_null_blocks(rid))
        if held != set(self._requests) or held != set(self._held):
            raise AssertionError(f"the adapter's requests {sorted(self._requests)} are not the manager's "
                                 f"{sorted(held)}")

    # ------------------------------------------------------------ internals
    def gpukv_request(self, request: Any, tokens: Any, chunk: int | None = None, lookahead: int = 0) -> NewRequest:
        """gpukv's ``NewRequest`` of vLLM's ``request`` with these ``tokens``."""
        return NewRequest(request.request_id, tokens, lora_id=self.lora_ids.id_of(request),
                          mm_items=mm_items(request, len(tokens)), cache_salt=request.cache_salt,
                          skip_prefix_cache=features.skips_cache(request),
                          num_tokens_to_compute=chunk, num_lookahead_tokens=lookahead)

    def _grow(self, request: Any, num_new_tokens: int, num_lookahead_tokens: int, reserved_blocks: int) -> Any:
        """More blocks for a running request: gpukv appends what vLLM appended
        and computes (so caches) vLLM's cached tokens; the rest of vLLM's
        slots (drafts, placeholders, lookahead) are gpukv lookahead slots.
        Window groups release behind vLLM's processed tokens, the computed
        ones less those in flight (``kv_cache_manager.py:555-568``)."""
        rid = request.request_id
        _, num_held, computed, held = self._held[rid]
        _, need_slot, target = growth(request.num_computed_tokens, request.num_tokens, computed,
                                      num_new_tokens, num_lookahead_tokens, self.max_model_len)
        processed = processed_tokens(request, self.max_model_len)
        to_take = self.num_kv_cache_groups * max(-(-need_slot // self.block_size) - num_held, 0)
        if reserved_blocks and not self._fits(to_take, 0, reserved_blocks):
            return None
        chunk = None if target == request.num_tokens else target - computed
        if chunk == 0:
            raise AssertionError(f"request {rid!r}: vLLM schedules {num_new_tokens} tokens past "
                                 f"{request.num_computed_tokens} computed, none of them past gpukv's {computed}")
        new = self._extend(rid, request.all_token_ids[held:], chunk, need_slot - target, processed)
        self.note_held(rid)  # (a call that does not fit still made its window's release, as vLLM's does)
        if new is None:
            return None
        self._drain(request)
        return self.new_kv_cache_blocks(new)

    def _extend(self, rid: str, tokens: Any, chunk: int | None, lookahead: int,
                processed: int) -> list[list[int]] | None:
        """A running request's tokens appended and its blocks taken in gpukv:
        its new block ids per group (none read with ``ids_on_device``: a step
        that reads no id), or None when they do not fit (nothing changed)."""
        if self.ids_on_device:
            update = RunningUpdate(rid, tokens, chunk, lookahead, processed)
            return [[] for _ in range(self.num_kv_cache_groups)] if self.manager.step(running=[update]).ok else None
        return self.manager.allocate_slots(rid, tokens, num_tokens=chunk, num_lookahead_tokens=lookahead,
                                           num_processed_tokens=processed)

    def _fits(self, num_blocks: int, watermark: int, reserved: int) -> bool:
        """vLLM's fit check (``blocks_fit``) on this adapter's manager."""
        return blocks_fit(self.manager, num_blocks, watermark, reserved)

    def _num_cached_blocks(self, request: Any) -> int:
        """Leading blocks of a held request that are cached: the full blocks
        of gpukv's computed tokens (gpukv caches exactly those)."""
        if not self.enable_caching:
            return 0
        return min(self._held[request.request_id][2], request.num_tokens) // self.block_size

    def new_kv_cache_blocks(self, new: Sequence[Sequence[int]]) -> Any:
        """The ``KVCacheBlocks`` of blocks an allocation just took: ids only,
        all vLLM's scheduler reads of them (``get_blocks`` gives hashes)."""
        if self.ids_on_device:
            return self.empty_kv_cache_blocks
        return self.id_blocks(tuple(new))

    def _drain(self, request: Any | None) -> None:
        if self.event_translator.active:
            self.event_translator.drain(self.manager, request)


def _check_counts(num_new_tokens: Any, num_new_computed_tokens: Any, num_lookahead_tokens: Any,
                  reserved_blocks: Any) -> None:
    """``allocate_slots``' counts: plain ints in range pass in one test (the
    call comes once per running request per step); anything else is named
    by ``_check_count``."""
    if (type(num_new_tokens) is int and type(num_lookahead_tokens) is int and type(reserved_blocks) is int
            and num_new_tokens > 0 and num_lookahead_tokens >= 0 and reserved_blocks >= 0):
        return
    _check_count(num_new_tokens, "num_new_tokens", 1 if not num_new_computed_tokens else 0)
    _check_count(num_lookahead_tokens, "num_lookahead_tokens", 0)
    _check_count(reserved_blocks, "reserved_blocks", 0)


def _check_count(value: Any, argument: str, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidInputError(f"{argument} must be an int >= {minimum}, got {value!r}", argument=argument,
                                fix=f"pass a count of at least {minimum}")


CONNECTOR_ONLY = ("get_computed_blocks_for_connector", "truncate_computed_blocks", "remove_skipped_blocks",
                  "pop_blocks_for_free", "evict_blocks", "record_blocks_for_zeroing")
"""vLLM 0.33 manager methods only its KV-connector, copy-on-write and zeroing
paths call: each refuses, saying so (``_refusing``)."""


def _refusing(name: str) -> Any:
    def refused(_self: KVCacheManager, *_args: Any, **_kwargs: Any) -> Any:
        raise UnsupportedConfigError(f"{name} belongs to KV-connector and copy-on-write paths, which gpukv's vLLM "
                                     "0.33 adapter does not follow", argument=name,
                                     fix="run without a KV connector, or use vLLM's own scheduler")

    refused.__name__ = refused.__qualname__ = name
    refused.__doc__ = f"vLLM's ``{name}``: refused (a KV-connector, copy-on-write or zeroing path)."
    return refused


for _name in CONNECTOR_ONLY:
    setattr(KVCacheManager, _name, _refusing(_name))
