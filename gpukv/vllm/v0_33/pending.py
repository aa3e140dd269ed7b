"""The running requests' allocations of one vLLM 0.33 ``schedule()``, as one
gpukv step (the batched path under 0.33).

vLLM's running loop asks for each running request's blocks in turn and
needs only a yes or a no before its next call: the block ids are read later,
when the ``SchedulerOutput`` is built. With full-attention groups only, the
answer is host arithmetic: a request holds ``ceil(slots / block_size)``
blocks per group, a call that needs more takes them from the free blocks,
and it fits when they are there (``kv_cache_manager.py:570-588``, no
watermark or reserve for a running request). So, inside ``schedule()``, the
adapter answers each such call on the host and keeps its work here
(``PendingGrowth.add``); the work is applied as one
``step(running=RunningBatch)`` (``flush``) before anything reads or changes
gpukv's state (a lookup, an admission, a free, block ids, events, usage) and
when ``schedule()`` returns. gpukv's step runs the rows in order, each
taking its blocks from the free queue's front as the calls one by one would,
so the blocks, their order and what is cached are those of vLLM's calls; the
step's ``running_failed_at`` must then be None, or the host's count was wrong
(an ``AssertionError``, never a silent difference).

The free blocks come from the manager's ``free_blocks_lower_bound()`` (no
device read); only when a request needs more than that bound is the device
read (``read_num_free_blocks``). A step costs one gpukv call and, when some
request got a new block, the one read of its block ids, whatever the number
of running requests.

With KV events on, the step's events are regrouped into vLLM's per-call
order after it (``gpukv.vllm.v0_33.events``: ``drain_step``).

Window groups (``gpukv.vllm.v0_33.window_releases``): vLLM's call first
releases the blocks its window no longer reaches, then takes its new blocks;
gpukv's step releases every row's blocks first, then takes each row's. The
two agree on calls that release nothing or only cached blocks (to the free
queue's tail) while every take fits in the blocks free before the step, and
only those are answered here, each with its processed tokens riding with
its row (``RunningRows.processed``), so the step releases behind them what
vLLM's call does. A call that may free an uncached block, or that fits only
if the step's releases count, is ``RELEASES``: the adapter applies the calls
before it and makes that one on the per-request path, in vLLM's order.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from gpukv.core.requests import NewRequest, StepResult
from gpukv.core.running_batch import PrecheckedRunningBatch, prechecked_batch
from gpukv.errors import GpukvInputError
from gpukv.vllm.v0_33.events import StepCall
from gpukv.vllm.v0_33.views import Block, decode_tokens, new_tokens
from gpukv.vllm.v0_33.window_releases import processed_tokens

_LAZY_CLASSES: dict[type, type] = {}
#: ``PendingGrowth.add``'s answer for a window model's call the step cannot make as vLLM does (module docstring).
RELEASES = object()
#: The ints ``PendingGrowth`` keeps per call, flat, in this order (``_batch`` reads them as one array). Each
#: of the batch's per-row counts is the difference of two neighbours (new tokens ``known - before``, chunk
#: ``target - computed``, lookahead ``slots - target``): one subtraction of the array from itself, shifted.
_FIELDS = ("row", "before", "known", "computed", "target", "slots")
_BEFORE, _KNOWN, _COMPUTED, _TARGET = (_FIELDS.index(f) for f in ("before", "known", "computed", "target"))


@functools.lru_cache(maxsize=64)
def _packer(count: int) -> struct.Struct:
    """The ``struct`` of ``count`` native int64s (one per batch size seen)."""
    return struct.Struct(f"={count}q")


def growth(num_computed_tokens: int, num_tokens: int, computed: int, num_new_tokens: int,
           num_lookahead_tokens: int, max_model_len: int) -> tuple[int, int, int]:
    """A running request's ``allocate_slots(request, num_new_tokens,
    num_lookahead_tokens=...)`` in gpukv's terms, from the request's
    ``num_computed_tokens`` and ``num_tokens`` (vLLM's) and gpukv's
    ``computed``: ``(total, slots, target)``, vLLM's computed tokens before
    the call, the slots it needs after it, and the tokens gpukv computes (so
    caches): vLLM's computed after the call, capped at its known tokens,
    never below gpukv's ``computed``. The rule's home: the per-request path
    calls it (``KVCacheManager._grow``); ``PendingGrowth.add``, run once per
    running request per step, computes it inline, held equal to it by
    ``tests/test_vllm033/test_batched.py``."""
    total = num_computed_tokens if num_computed_tokens < max_model_len else max_model_len
    slots = total + num_new_tokens + num_lookahead_tokens
    target = total + num_new_tokens
    target = target if target < num_tokens else num_tokens
    return (total, slots if slots < max_model_len else max_model_len,
            target if target > computed else computed)


def pending_blocks_class(blocks_cls: type) -> type:
    """A subclass of vLLM's ``KVCacheBlocks`` whose ``blocks`` are filled by
    the flush of the growth they belong to (reading them flushes it)."""
    cls = _LAZY_CLASSES.get(blocks_cls)
    if cls is None:
        class PendingKVCacheBlocks(blocks_cls):  # type: ignore[misc,valid-type]
            """New blocks of a running request whose allocation is pending."""

            def __init__(self, pending: PendingGrowth) -> None:  # (not the dataclass's: blocks come later)
                self._pending = pending
                self.filled: tuple | None = None

            @property
            def blocks(self) -> tuple:  # type: ignore[override]
                if self.filled is None:
                    self._pending.flush()
                if self.filled is None:
                    raise AssertionError("a pending allocation's blocks were not filled by its flush")
                return self.filled

        cls = _LAZY_CLASSES[blocks_cls] = PendingKVCacheBlocks
    return cls


class PendingGrowth:
    """Running requests' allocations answered on the host, applied as one
    gpukv step: ``add`` a request's call (None when it does not fit, nothing
    kept then), ``flush`` them all. ``adapter``: the
    ``gpukv.vllm.v0_33.KVCacheManager`` (its ``manager``, ``block_size``,
    ``num_kv_cache_groups``, ``empty_kv_cache_blocks``, ``windows``)."""

    def __init__(self, adapter: Any) -> None:
        self._adapter = adapter
        self._lazy_cls = pending_blocks_class(adapter.blocks_class)
        self._block_size = adapter.block_size  # (read once: ``add`` runs once per running request per step)
        self._max_model_len = adapter.max_model_len
        self._no_blocks = adapter.empty_kv_cache_blocks
        self._windows = adapter.windows  # (window models: what a running call releases; else None)
        self._num_applied = 0  # calls answered on the host and cleared since construction (``num_calls``)
        self.num_steps = 0  # gpukv steps they were applied in
        self.num_reads = 0  # free counts read from the device (a call past the host's bound)
        self._clear()

    @property
    def num_calls(self) -> int:
        """Calls answered on the host since construction (counted as they are
        cleared: one addition a step, not one per call)."""
        return self._num_applied + len(self.calls)

    def _clear(self) -> None:
        self._num_applied += len(getattr(self, "calls", ()))
        # The calls in order, with no tuple per call (one append and one extend): their vLLM requests; their
        # ints, flat (``_FIELDS``: its row, vLLM's known tokens at the call, gpukv's known and computed tokens
        # before it, its computed tokens after it (``growth``'s target), the slots it needs after it); and, for
        # the few calls that take blocks, (call index, blocks taken from the free queue in all groups, the
        # blocks handed back or None).
        self.calls: list[Any] = []  # (non-empty while calls are pending)
        self.counts: list[int] = []
        self.processed: list[int] = []  # (window models only: each call's processed tokens)
        self.releasing = False  # (window models: whether a pending call releases blocks)
        self.growing: list[tuple[int, int, Any]] = []
        self.taken = 0  # blocks the calls so far take, per the host
        self.spare: int | None = None  # free blocks known to be left for the next call

    def __len__(self) -> int:
        return len(self.calls)

    def add(self, request: Any, held: list[int], known: int, num_new_tokens: int, num_lookahead_tokens: int) -> Any:
        """vLLM's ``allocate_slots(request, num_new_tokens,
        num_lookahead_tokens=...)`` for a running request with ``known``
        tokens (its ``num_tokens``) at row ``held[0]`` holding ``held[1]``
        blocks per group with ``held[2]`` tokens computed and ``held[3]``
        known in gpukv (the adapter's record, which this updates): its new
        blocks (the empty instance when none are new, else blocks filled at
        the flush), None when they do not fit, or ``RELEASES`` (a window
        model's call for the per-request path: nothing kept)."""
        row, num_held, computed, before = held
        window = None  # (a window model's call: its processed tokens and release, ``_window_release``)
        if self._windows is not None:
            window = self._window_release(request, num_held, computed)
            if window is RELEASES:
                return RELEASES
        # ``growth``'s rule, inline (this runs once per running request per step; ``test_batched`` holds the two
        # equal): the slots after the call capped at max_model_len, the target at the known tokens and never
        # below gpukv's computed ones. (vLLM's computed tokens need no cap of their own here: past
        # max_model_len, both caps hold whatever they are.)
        most = self._max_model_len
        target = request.num_computed_tokens + num_new_tokens
        slots = target + num_lookahead_tokens
        if slots > most:
            slots = most
        if target > known:
            target = known
        if target < computed:
            target = computed
        new_per_group = -(-slots // self._block_size) - num_held
        if new_per_group > 0:  # (about one call in block_size)
            return self._add_growing(request, held, known, target, slots, new_per_group, window)
        self.calls.append(request)
        self.counts.extend((row, before, known, computed, target, slots))
        if window is not None:
            self._keep_window(request.request_id, window)
        held[2] = target
        held[3] = known  # (the step appends vLLM's tokens past gpukv's)
        return self._no_blocks

    def _add_growing(self, request: Any, held: list[int], known: int, target: int, slots: int,
                     new_per_group: int, window: Any) -> Any:
        """``add`` for a call that takes ``new_per_group`` blocks per group
        (``window``: ``_window_release``'s answer, None without windows)."""
        a = self._adapter
        row, num_held, computed, before = held
        popped = new_per_group * a.num_kv_cache_groups
        if not self._take(popped):
            # (past the blocks free before the step, a release of this call or one before it may make room, and
            # its take may reach a released block: vLLM's order decides, on the per-request path)
            return RELEASES if self.releasing or (window is not None and window[1] is not None) else None
        held[1] = num_held + new_per_group  # (gpukv's step holds max(held, ceil(slots / block_size)) positions)
        blocks = None if a.ids_on_device else self._lazy_cls(self)
        self.growing.append((len(self.calls), popped, blocks))
        self.calls.append(request)
        self.counts.extend((row, before, known, computed, target, slots))
        if window is not None:
            self._keep_window(request.request_id, window)
        held[2] = target
        held[3] = known
        return a.empty_kv_cache_blocks if blocks is None else blocks

    def _window_release(self, request: Any, num_held: int, computed: int) -> Any:
        """A window model's call: ``(processed tokens, None)`` when its
        release frees nothing, ``(processed, null-block stops)`` when it frees
        only cached blocks, ``RELEASES`` when it may free an uncached one."""
        windows = self._windows
        assert windows is not None
        rid = request.request_id
        processed = processed_tokens(request, self._max_model_len)
        if processed < windows.release_at[rid]:
            return processed, None
        stops = windows.stops_after(rid, processed, num_held)
        if stops is None or windows.all_cached(stops, computed):
            return processed, stops
        return RELEASES

    def _keep_window(self, request_id: str, window: tuple[int, list[int] | None]) -> None:
        """A kept call's processed tokens, and its release noted."""
        windows = self._windows
        assert windows is not None
        processed, stops = window
        self.processed.append(processed)
        if stops is not None:
            self.releasing = True
            windows.note(request_id, stops)

    def _take(self, num_blocks: int) -> bool:
        """Whether ``num_blocks`` more fit after what the calls so far take
        (the manager's lower bound first; a device read only past it)."""
        m = self._adapter.manager
        if self.spare is None:
            self.spare = m.free_blocks_lower_bound() - self.taken
        if num_blocks > self.spare:
            self.num_reads += 1
            self.spare = m.read_num_free_blocks() - self.taken
            if num_blocks > self.spare:
                return False
        self.spare -= num_blocks
        self.taken += num_blocks
        return True

    def flush(self, new: Sequence[NewRequest] = (), token_budget: int | None = None,
              admitting: Sequence[Any] = (), boundaries: list[int] | None = None) -> StepResult | None:
        """Apply the pending calls as one gpukv step, in call order, and fill
        the blocks handed back; ``new`` (a run of admissions,
        ``gpukv.vllm.v0_33.admissions``; ``admitting``: their vLLM requests)
        are admitted in the same step, after them, as vLLM's waiting loop
        comes after its running loop, within ``token_budget`` tokens (None:
        each whole). Returns the step's result (None when there was nothing
        to do). ``boundaries``: filled with each admitted request's
        shared-prefix boundary, as vLLM's lookup would give it in turn (with
        an event index: ``KVCacheManager.run_boundary``; else left empty, the
        step's full-attention hits giving them)."""
        if not self.calls and not new:
            # (a count kept by a call that did not fit holds no longer: what flushes now may change the pool)
            self.spare = None
            return None
        ids = not self._adapter.ids_on_device  # (with a gpukv worker, block ids stay on the device)
        try:
            wants_ids = ids and (bool(new) or any(blocks is not None for _, _, blocks in self.growing))
            running = self._batch() if self.calls else ()
            result = self._adapter.manager.step(running=running, new=new, token_budget=token_budget,
                                                block_ids=wants_ids)
            self.num_steps += bool(self.calls)
            if result.running_failed_at is not None:
                raise AssertionError(f"gpukv refused running request {result.running_failed_at} of a batch the "
                                     "host counted as fitting: the host's block arithmetic is wrong")
            if wants_ids:
                for i, _, blocks in self.growing:
                    if blocks is not None:
                        blocks.filled = tuple([Block(b) for b in group[i]] for group in result.running_block_ids)
            if self._adapter.event_translator.active:
                self._drain(result, admitting, boundaries)
            return result
        except GpukvInputError:
            self._reread()
            raise
        finally:
            self._clear()

    def _drain(self, result: StepResult, admitting: Sequence[Any], boundaries: list[int] | None) -> None:
        """The step's KV events, as vLLM's calls would have made them one by
        one: the running loop's, then the run's admissions' (each admission's
        shared-prefix boundary into ``boundaries`` just before its events)."""
        a = self._adapter
        caching, bs, groups = a.enable_caching, a.block_size, a.num_kv_cache_groups
        popped = [0] * len(self.calls)
        for i, taken, _ in self.growing:
            popped[i] = taken
        targets, computed = self.counts[_TARGET::len(_FIELDS)], self.counts[_COMPUTED::len(_FIELDS)]
        calls = [StepCall(r, popped[i], groups * (targets[i] // bs - computed[i] // bs) if caching else 0)
                 for i, r in enumerate(self.calls)]
        for i in range(result.num_admitted):
            request, hit = admitting[i], result.num_computed_tokens[i] // bs
            full = (result.num_computed_tokens[i] + result.num_new_tokens[i]) // bs
            calls.append(StepCall(request, groups * (a.manager.num_blocks_held(request.request_id) - hit),
                                  groups * (full - hit) if caching else 0))
        before = None
        if boundaries is not None and a.event_translator.index:
            first = len(self.calls)

            def before(i: int) -> None:
                if i >= first:
                    j = i - first  # (the index answers: the step's full-attention hits are not needed)
                    boundaries.append(a.run_boundary(admitting[j], result.num_computed_tokens[j], None))

        a.event_translator.drain_step(a.manager, calls, before)

    def _reread(self) -> None:
        """gpukv refused the step and changed nothing: the adapter's records,
        which ``add`` moved ahead, read back from the manager (host only)."""
        for request in self.calls:
            self._adapter.note_held(request.request_id)

    def _batch(self) -> PrecheckedRunningBatch:
        """The pending calls as a ``RunningBatch``: each appends the tokens
        vLLM knows past gpukv's, computes (so caches) up to its ``growth``
        target, and reserves the rest of its slots as lookahead. Built from
        the adapter's records (rows held, gpukv's known and computed tokens),
        so gpukv takes it as checked (``PrecheckedRunningBatch``)."""
        n, width = len(self.calls), len(_FIELDS)
        # (one array of every call's ints, one contiguous row per field, and their neighbours' differences; the
        # ints packed by ``struct`` in one C call, half of ``np.fromiter``'s time on a list)
        fields = np.frombuffer(_packer(width * n).pack(*self.counts), np.int64).reshape(n, width).T.copy()
        rows, before = fields[0], fields[1]
        _, counts, _, chunks, lookahead = fields[1:] - fields[:-1]
        # (every row adds one token, a decode: read in one pass, no ragged layout; counts are >= 0, so one
        # largest and one smallest element say it, cheaper than a comparison and its count)
        starts = self.counts[_BEFORE::width]  # (the list's own ints: no array read back)
        if counts.item(counts.argmax()) == 1 == counts.item(counts.argmin()):
            tokens, ragged = decode_tokens(self.calls, starts), None
        else:
            tokens, ragged = new_tokens(self.calls, starts, self.counts[_KNOWN::width]), counts
        # (no lookahead, the common case, handed as the int 0: the plan then adds a constant, not an array)
        processed = None if self._windows is None else np.array(self.processed, dtype=np.int64)
        return prechecked_batch(rows, tokens, ragged, before, chunks, lookahead if np.count_nonzero(lookahead) else 0,
                                processed)
