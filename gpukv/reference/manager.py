"""The sequential reference block manager: the executable spec of gpukv.

Plain Python, one request at a time, written to be read. The device pool
(``gpukv.device.pool`` / ``gpukv.device.manager``) must produce exactly what this module
produces: the same block ids, hits, reference counts, free-queue order, table
contents and stats, after every step.

Semantics (``docs/design.md`` says why each rule is what it is):

* Block 0 is the null block: never allocated, never freed, its reference count
  not kept. Sliding-window groups put it where their window no longer reaches.
* The free queue starts as ``1..N-1``. Allocation pops from the front; a popped
  block that still has a hash is evicted then (lazy eviction).
* Freeing gives a request's blocks back tail first. A block whose count drops to
  0 goes to the back if it is cached and to the front if not; the blocks one free
  call sends to the front keep their relative order there. With
  ``uncached_first=False`` every block goes to the back.
* A hit on a free block takes it out of the middle of the queue; every hit adds
  one reference.
* A hash maps to every block cached under it, oldest first; a lookup returns
  the oldest, and a hit is verified: the stored parent digest, tokens and
  extra-key digest must equal the request's.
* A request hits its longest run of leading full cached blocks, never its last
  token.

This module holds the request-level API (``ReferenceManager``) over the pool
(``gpukv.reference.pool.BlockPool``, vLLM's: the blocks and their verbs,
imported here as well), which composes the parts in ``gpukv.reference``, cut
as the device manager's are: admission, running requests, releases, digests
and rows, each given the state they share (``gpukv.reference.state``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from gpukv.core.blocks import ManagerLimits, check_count, common_prefix_length
from gpukv.core.checks import (
    apply_allocate_args,
    check_block_spans,
    check_computed_for,
    check_group,
    check_max_num_batched_tokens,
    check_prefix_hit,
    check_request_ids,
    check_size,
    check_step_outputs,
    check_token_budget,
    normalize_computed,
    normalize_step,
    normalize_windows,
    request_id_type_error,
    resolve_key,
    stale_computed_blocks,
    unknown_request,
)
from gpukv.core.failstop import mutating, reading
from gpukv.core.limits import MAX_MODEL_LEN, MAX_NUM_BLOCKS, MAX_NUM_REQS
from gpukv.core.manager_base import SharedManagerAPI
from gpukv.core.metrics import PrefixCacheStats, StepCounters
from gpukv.core.requests import ComputedBlocks, NewRequest, PrefixHit, RunningUpdate, Step, StepOutputs, StepResult
from gpukv.core.running_batch import RunningBatch, RunningRows
from gpukv.core.windows import policies
from gpukv.errors import (
    InvalidInputError,
    InvalidTypeError,
    NoFreeBlocksError,
)
from gpukv.events.schema import AllBlocksCleared, EventQueue, KVEventBatch
from gpukv.reference.admission import ReferenceAdmission
from gpukv.reference.digests import CachedBlockInfo, Digests, RequestState
from gpukv.reference.pool import NULL_BLOCK, BlockPool
from gpukv.reference.releases import ReferenceReleases
from gpukv.reference.rows import ReferenceRows
from gpukv.reference.running import ReferenceRunning
from gpukv.reference.state import ReferenceState

__all__ = ["NULL_BLOCK", "BlockPool", "CachedBlockInfo", "ComputedBlocks", "NoFreeBlocksError", "ReferenceManager"]

def _host_device(device) -> torch.device:
    """The reference's ``device``: None or the CPU."""
    if device is None:
        return torch.device("cpu")
    try:
        dev = torch.device(device)
    except (TypeError, RuntimeError):
        raise InvalidTypeError(f"must be None, 'cpu' or a torch.device, got {device!r}", argument="device",
                               fix="pass device=None (the reference lives on the host)") from None
    if dev.type != "cpu":
        raise InvalidInputError(f"the reference manager lives on the host, got {dev}", argument="device",
                                fix="pass device=None, or use gpukv.device.manager.DeviceManager on a GPU")
    return dev


# ---------------------------------------------------------------------------
# The request-level manager


class ReferenceManager(SharedManagerAPI):
    """Request-level calls over one shared ``BlockPool``, composed of the
    parts in ``gpukv.reference`` (admission, running, releases,
    digests, rows), as the device manager is of ``gpukv.device``'s.

    ``sliding_windows`` has one entry per KV-cache group: None for full
    attention, else the window in tokens. All groups share the pool and the
    block size; a request holds one block list per group. A sliding-window
    group keeps only the blocks its window still reaches and the null block
    before them.

    ``max_model_len`` (None: no limit) refuses requests longer than it, as
    the device manager does; every argument of every call is checked by
    ``gpukv.core.checks.normalize_step`` before anything changes.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        sliding_windows: Sequence[int | None] = (None,),
        enable_caching: bool = True,
        uncached_first: bool = True,
        hash_key: bytes | str | None = None,
        max_model_len: int | None = None,
        max_num_reqs: int = 64,
        device: torch.device | str | None = None,
        enable_kv_cache_events: bool = False,
        max_num_batched_tokens: int | None = None,
    ) -> None:
        """Arguments as the device manager's (``gpukv.device.manager``); ``device``
        is where ``block_table_for`` puts its tensor: None or the CPU (this
        manager's state is host memory). ``enable_kv_cache_events``: keep
        ``gpukv.events.schema`` batches for ``take_events``.
        ``max_num_batched_tokens`` is checked as the device manager's; it
        sizes that manager's device buffers, and this one has none."""
        check_max_num_batched_tokens(max_num_batched_tokens)
        self.device = _host_device(device)
        self.block_size = check_size(block_size, "block_size", 1)
        max_num_reqs = check_size(max_num_reqs, "max_num_reqs", 1, MAX_NUM_REQS)
        windows = list(normalize_windows(sliding_windows))
        num_blocks = check_size(num_blocks, "num_blocks", 2, MAX_NUM_BLOCKS)
        if max_model_len is not None:
            max_model_len = check_size(max_model_len, "max_model_len", 1, MAX_MODEL_LEN)
        self.max_model_len = max_model_len
        self.sliding_windows = windows
        self.num_groups = len(windows)
        self.enable_caching = bool(enable_caching)
        self._key = resolve_key(hash_key)
        self.pool = BlockPool(num_blocks, uncached_first=uncached_first, enable_caching=enable_caching)
        self._limits = ManagerLimits(self.block_size, num_blocks, tuple(windows), max_model_len, self.enable_caching)
        self._shared = ReferenceState(
            self.block_size, self.num_groups, self.enable_caching,
            policies(windows, self.block_size),  # one per group (``gpukv.core.windows``)
            self.pool, Digests(self._key, self.block_size, self.num_groups, memo_limit=2 * num_blocks + 1024),
            ReferenceRows(max_num_reqs),  # handed out as the device manager does
        )
        # The state's own objects, under the names ``gpukv.core.manager_base`` reads (never rebound).
        self._requests, self._rows = self._shared.requests, self._shared.rows
        self._init_events(enable_kv_cache_events)
        # The device manager's per-step accounting, for the same API: always zero
        # here (no launches, uploads or device reads).
        self.counters = StepCounters()
        self._running = ReferenceRunning(self._shared)
        self._admission = ReferenceAdmission(self._shared, self._running)
        self._releases = ReferenceReleases(self._shared)

    @property
    def stats(self) -> PrefixCacheStats:
        """The lookups counted since ``make_prefix_cache_stats`` last handed them out."""
        return self._shared.stats

    def _init_events(self, enabled: bool) -> None:
        """KV-cache events of the call under way (None: not kept), and the batches made."""
        self._shared.event_log = [] if enabled else None
        self._event_queue = EventQueue()
        if enabled:
            self.pool.on_evict = self._shared.log_eviction

    def __repr__(self) -> str:  # never show the key
        return (f"ReferenceManager(num_blocks={self.pool.num_blocks}, block_size={self.block_size}, "
                f"groups={self.sliding_windows})")

    # ------------------------------------------------------------ public API
    @reading
    def free_queue(self) -> list[int]:
        """Free block ids, front (reused first) to back."""
        return self.pool.free_queue()

    @reading
    def read_num_free_blocks(self) -> int:
        """Free blocks now (the device manager's name; nothing to wait for here)."""
        return self.pool.num_free_blocks

    @reading
    def free_blocks_lower_bound(self) -> int:
        """Free blocks there are at least (the device manager's host-only
        bound): here, exactly the free blocks."""
        return self.pool.num_free_blocks

    @reading
    def read_num_evictions(self) -> int:
        """Cached blocks evicted so far (the device manager's name)."""
        return self.pool.num_evictions

    @reading
    def block_table_for(self, request_ids: Sequence[str]) -> torch.Tensor:
        """int32[G, len(request_ids), M] block tables of these requests, as
        the device manager gives them (M = blocks per request at
        ``max_model_len``, or the most any of them holds without a limit;
        positions past a request's blocks hold 0)."""
        states = [self._requests[r] for r in check_request_ids(request_ids, "request_ids", self._requests)]
        if self.max_model_len is not None:
            width = -(-self.max_model_len // self.block_size)
        else:
            width = max([len(st.blocks[0]) for st in states], default=0)
        table = torch.zeros((self.num_groups, len(states), width), dtype=torch.int32)
        for i, st in enumerate(states):
            for g, blocks in enumerate(st.blocks):
                table[g, i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        return table.to(self.device)

    @reading
    def get_num_common_prefix_blocks(self, request_id: str, num_running_requests: int) -> list[int]:
        """Per group, how many leading blocks of this request every one of the
        ``num_running_requests`` running requests holds (vLLM's, for cascade
        attention): blocks whose count equals that number, up to the first
        that does not. A sliding-window group gives 0 (cascade attention
        needs full attention)."""
        st = self._state(request_id)
        count = check_count(num_running_requests, "num_running_requests")
        ref = self.pool.ref_cnt
        return [0 if w is not None else common_prefix_length([ref[b] for b in st.blocks[g]], count)
                for g, w in enumerate(self.sliding_windows)]

    @reading
    def request_ids(self) -> list[str]:
        """The running requests' ids, in admission order."""
        return list(self._requests)

    @reading
    def get_block_ids(self, request_id: str) -> list[list[int]]:
        """The request's block ids per group, position by position."""
        return [list(b) for b in self._state(request_id).blocks]

    @reading
    def num_blocks_held(self, request_id: str) -> int:
        """The block positions the request holds, per group (the null block
        counts where a window dropped one)."""
        return len(self._state(request_id).blocks[0])

    @reading
    def read_block_ids(self, spans: Sequence[tuple[str, int, int]], group: int = 0) -> list[list[int]]:
        """Group ``group``'s block ids of each ``(request_id, start, end)``
        span's request at positions ``[start, end)`` (a serving loop's new
        blocks of a step, for many requests at once)."""
        group = check_group(group, self.num_groups)
        spans = check_block_spans(spans, "spans", self.num_blocks_held)
        return [self._requests[rid].blocks[group][start:end] for rid, start, end in spans]

    @reading
    def request_counts(self, request_id: str) -> tuple[int, int, int, int]:
        """A running request's row, block positions held per group, computed
        and known tokens, in one call (``row_of``, ``num_blocks_held``,
        ``num_computed_tokens`` and its ``row_token_counts``)."""
        st = self._state(request_id)
        return st.row, len(st.blocks[0]), st.num_computed_tokens, len(st.tokens)

    @reading
    def num_null_blocks(self, request_id: str) -> tuple[int, ...]:
        """Per group, the leading block positions the request holds as the
        null block (a hit's blocks before its window, and the blocks its
        window released; 0 in a full-attention group)."""
        return tuple(_leading_nulls(blocks) for blocks in self._state(request_id).blocks)

    @reading
    def num_computed_tokens(self, request_id: str) -> int:
        """Tokens of the request computed so far, its hit included."""
        return self._state(request_id).num_computed_tokens

    @reading
    def block_hashes(self, request_id: str) -> list[bytes]:
        """Digests of the request's full blocks (to carry over a preemption,
        as vLLM's ``Request.block_hashes`` does)."""
        return list(self._state(request_id).block_hashes)

    @mutating
    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """Hand out the stats gathered since the last call and start afresh."""
        self._begin_changes()
        stats, self._shared.stats = self._shared.stats, PrefixCacheStats()
        return stats

    @mutating
    def reset_prefix_cache(self) -> bool:
        """Forget every cached block, when no request holds a block (else
        False, nothing changed)."""
        self._begin_changes()
        ok = self.pool.reset_prefix_cache()
        if ok and self._shared.event_log is not None:
            self._shared.event_log.append(AllBlocksCleared())
        if ok:  # every block was free, so no request holds a cached block
            self._shared.stats.reset = True
        return ok

    @mutating
    def get_computed_blocks(self, request: NewRequest) -> ComputedBlocks:
        """Look a new request up (counts in the stats); changes nothing else."""
        (request,) = self._normalize((), (), [request], single=True, defer_admissible=True).new
        self._begin_changes()  # the lookup remembers digests and counts in the stats
        return self._admission.lookup(request)

    @mutating
    def read_prefix_hit(self, request: NewRequest) -> PrefixHit:
        """``get_computed_blocks`` by its size (counts in the stats): the hit
        in tokens and how many of its blocks no request holds."""
        (request,) = self._normalize((), (), [request], single=True, defer_admissible=True).new
        self._begin_changes()  # the lookup remembers digests and counts in the stats
        hit = self._admission.lookup(request)
        return PrefixHit(hit.num_tokens, self._num_unheld(sorted({b for g in hit.block_ids for b in g if b})),
                         hit.full_attention_hit_tokens)

    def _admit_sized(self, request: NewRequest, hit: Any, num_tokens: int | None,
                     num_lookahead_tokens: int | None) -> bool:
        """``admit``: the hit's blocks are those a lookup capped at its length
        finds now (changing nothing), then admitted as ``allocate_slots``
        admits them."""
        (request,) = self._normalize((), (), [request], single=True, defer_admissible=True).new
        hit_tokens = check_prefix_hit(hit, request, self._limits)
        computed = None
        if hit_tokens:
            computed = self._admission.peek(replace(request, token_ids=request.token_ids[: hit_tokens + 1]))
            if computed.num_tokens != hit_tokens:
                raise stale_computed_blocks()
        return self._allocate_new(request, computed, num_tokens, num_lookahead_tokens) is not None

    def _allocate_running(self, update: RunningUpdate) -> list[list[int]] | None:
        state = self._state(update.request_id)
        num_before = [len(b) for b in state.blocks]
        self._begin_changes()
        self._releases.skipped(state, update.num_processed_tokens)
        states, work = self._running.work([update])
        if self._running.run_all(states, *work) is not None:
            return None
        self._running.cache_running(states)
        return [state.blocks[g][num_before[g]:] for g in range(self.num_groups)]

    @mutating
    def free(self, request_id: str) -> None:
        """Give back a request's blocks (tail first, group by group) and forget it."""
        (request_id,) = self._normalize([request_id], (), (), single=True).finished
        self._begin_changes()
        self._releases.request(request_id)

    @mutating
    def step(
        self,
        finished: Sequence[str] = (),
        running: Sequence[RunningUpdate] | RunningBatch = (),
        new: Sequence[NewRequest] = (),
        *,
        token_budget: int | None = None,
        block_ids: bool = False,
        prefix_of: str | None = None,
    ) -> StepResult:
        """One scheduling step, phase by phase (see ``docs/design.md``):

        1. free the finished requests, in order;
        2. sliding-window groups of every running update's request release the
           blocks behind their window (as vLLM does, before any fit check);
           then each running update gets its blocks, in order; the first that
           does not fit is reported and it and the rest get nothing (nor is any
           new request looked at);
        3. hash and look up the new requests, against the cache and against
           blocks earlier new requests of this step will cache;
        4. admit the longest prefix of new requests whose needs fit (a request
           needs its new blocks plus the free cached blocks it is the first in
           the step to hit), each computing its hit plus ``min(tokens - hit,
           num_tokens_to_compute, budget left)`` tokens (vLLM's waiting loop:
           ``token_budget`` tokens for this step's new requests, None for no
           budget; admission stops where the budget is spent, before that
           request is looked up);
        5. touch the hits of every admitted request, then allocate for each in
           order, then cache the blocks that will be full.

        ``running``: ``RunningUpdate``s, or a ``RunningBatch`` (the same work
        as arrays, addressed by row: ``gpukv.core.running_batch``). What a serving loop
        reads after the step comes back with it, in the step's one device
        read on the device manager: ``block_ids=True`` gives each running
        update's new blocks and each admitted request's blocks
        (``StepResult.running_block_ids``, ``admitted_block_ids``);
        ``prefix_of`` (a request held before the step and not finished in
        it) its blocks' reference counts after the step, for
        ``StepResult.num_common_prefix_blocks`` (vLLM's cascade-attention
        prefix).

        Every argument is checked before anything changes (``gpukv.core.checks``:
        containers may be lists, tuples or iterators, materialised once; a str
        is not a list of ids); a refused call raises a ``gpukv.errors`` class
        and changes nothing.
        """
        step, batch = self._normalize_step(finished, running, new)
        token_budget = check_token_budget(token_budget)
        outputs = check_step_outputs(block_ids, prefix_of, self._requests, step.finished, step.new)
        self._begin_changes()
        return self._step(step.finished, step.running if batch is None else batch, step.new, token_budget, outputs)

    def _step(self, finished, running, new, token_budget: int | None, outputs: StepOutputs) -> StepResult:
        """A step on normalised arguments (``step``), its phases in order:
        releases, the running requests, the admission; nothing here refuses
        input."""
        for rid in finished:
            self._releases.request(rid)
        grown, work = self._running.work(running)
        if any(w is not None for w in self.sliding_windows):  # full attention releases nothing
            if isinstance(running, RunningRows):
                processed = [None] * len(grown) if running.processed is None else running.processed.tolist()
            else:
                processed = [u.num_processed_tokens for u in running]
            for st, p in zip(grown, processed, strict=True):
                self._releases.skipped(st, p)
        held_before = [len(st.blocks[0]) for st in grown] if outputs.block_ids else []
        filled: list[RequestState] = []
        failed_at = self._running.run_all(grown, *work, filled)
        self._running.cache_running(filled)
        if failed_at is not None:
            result = StepResult(running_failed_at=failed_at)
        else:
            result = self._admission.admit_new(new, token_budget)
        if outputs.block_ids:
            fit = len(grown) if failed_at is None else failed_at
            result.running_block_ids = [[st.blocks[g][h:] for st, h in zip(grown[:fit], held_before, strict=False)]
                                        for g in range(self.num_groups)]
            admitted = [self._requests[self._rows.ids[r]] for r in result.rows]
            result.admitted_block_ids = [[list(st.blocks[g]) for st in admitted] for g in range(self.num_groups)]
        if outputs.prefix_of is not None and outputs.prefix_of in self._requests:
            st = self._requests[outputs.prefix_of]
            ref = self.pool.ref_cnt
            result.prefix_ref_counts = [None if w is not None else [ref[b] for b in st.blocks[g]]
                                        for g, w in enumerate(self.sliding_windows)]
        return result

    def _allocate_new(self, request: NewRequest, computed: ComputedBlocks | None, num_tokens: int | None,
                      num_lookahead_tokens: int | None) -> list[list[int]] | None:
        """``allocate_slots`` for a new request: admitted with the hit its
        ``computed`` blocks give (checked against its own digests), if its
        new blocks and first touches fit."""
        (request,) = self._normalize((), (), [request], single=True, defer_admissible=True).new
        computed = normalize_computed(computed, self._limits)
        check_computed_for(request, computed, self._limits)
        hit_tokens = computed.num_tokens if computed is not None else 0
        request = apply_allocate_args(request, hit_tokens, num_tokens, num_lookahead_tokens, self._limits)
        state = self._shared.digests.new_state(request)
        hits = computed.block_ids if computed is not None else [[] for _ in range(self.num_groups)]
        num_hit = hit_tokens // self.block_size
        self._admission.check_computed(state, hits, num_hit)
        self._begin_changes()  # (before it, only the digest memo was read: ``Digests.new_state``)
        return self._admission.admit_with_hit(state, hits, num_hit)

    @mutating
    def decode(self, rows: Sequence[int], new_token_ids, *, num_new_tokens=None, num_tokens_to_compute=None,
               num_lookahead_tokens=0) -> StepResult:
        """The running requests at ``rows`` (``StepResult.rows``) each append
        their new tokens and get their blocks: ``step(running=RunningBatch(
        rows, new_token_ids, ...))``, the same as ``step(running=
        [RunningUpdate(id_of_row, tokens, chunk, lookahead)...])`` in row order
        (``running_failed_at`` indexes ``rows``). The arguments are
        ``gpukv.RunningBatch``'s (``gpukv.core.running_batch``). The device manager's
        batched decode entry, on the host."""
        run = self._normalize_running(RunningBatch(rows, new_token_ids, num_new_tokens, num_tokens_to_compute,
                                                   num_lookahead_tokens))
        self._begin_changes()
        return self._step((), run, (), None, StepOutputs())

    @mutating
    def take_events(self) -> list[KVEventBatch]:
        """The KV-cache event batches made since the last call (``gpukv.events.schema``;
        one per call that changed the cache), oldest first; empty unless built
        with ``enable_kv_cache_events``."""
        self._begin_changes()
        return self._event_queue.take()

    def _after_call(self) -> None:
        if self._shared.event_log:
            self._event_queue.add(self._shared.event_log)
            self._shared.event_log = []

    @reading
    def row_of(self, request_id: str) -> int:
        """The row a running request holds (``gpukv.device.rows``)."""
        return self._state(request_id).row

    @reading
    def check_invariants(self) -> None:
        """Pool invariants, plus: each block's count equals the number of
        request block lists that hold it."""
        self._shared.check_invariants()

    # ------------------------------------------------------------- checking
    def _state(self, request_id: str) -> RequestState:
        if type(request_id) is not str:
            raise request_id_type_error(request_id, "request_id")
        try:
            return self._requests[request_id]
        except KeyError:
            raise unknown_request(request_id) from None

    def _num_unheld(self, block_ids: list[int]) -> int:
        return sum(1 for b in block_ids if self.pool.ref_cnt[b] == 0)

    def _row_of(self, request_id: str) -> int:
        return self._requests[request_id].row

    def _normalize(self, finished, running, new, *, single: bool = False, defer_admissible: bool = False) -> Step:
        """Every argument checked and normalised (``gpukv.core.checks``), before anything changes."""
        return normalize_step(finished, running, new, known=self._requests, limits=self._limits,
                              num_tokens=lambda rid: len(self._requests[rid].tokens),
                              num_computed=lambda rid: self._requests[rid].num_computed_tokens, single=single,
                              defer_admissible=defer_admissible, keep_device_tokens=False)


def _leading_nulls(blocks: Sequence[int]) -> int:
    """How many of ``blocks`` lead with the null block."""
    n = 0
    while n < len(blocks) and blocks[n] == NULL_BLOCK:
        n += 1
    return n
