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
order after it (``gpukv.vllm.v0_33.events``: ``drain_step``). Window groups
(vLLM releases their blocks between the calls) keep the per-request path
(``KVCacheManager.batching``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from gpukv.core.requests import NewRequest, StepResult
from gpukv.core.running_batch import PrecheckedRunningBatch, prechecked_batch
from gpukv.errors import GpukvInputError
from gpukv.vllm.v0_33.events import StepCall
from gpukv.vllm.v0_33.views import Block, new_tokens

_LAZY_CLASSES: dict[type, type] = {}


def growth(num_computed_tokens: int, num_tokens: int, computed: int, num_new_tokens: int,
           num_lookahead_tokens: int, max_model_len: int) -> tuple[int, int, int]:
    """A running request's ``allocate_slots(request, num_new_tokens,
    num_lookahead_tokens=...)`` in gpukv's terms, from the request's
    ``num_computed_tokens`` and ``num_tokens`` (vLLM's) and gpukv's
    ``computed``: ``(total, slots, target)``, vLLM's computed tokens before
    the call, the slots it needs after it, and the tokens gpukv computes (so
    caches): vLLM's computed after the call, capped at its known tokens,
    never below gpukv's ``computed``. The one home of the rule for both
    paths (``KVCacheManager._grow``, ``add``)."""
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
    ``num_kv_cache_groups``, ``empty_kv_cache_blocks``)."""

    def __init__(self, adapter: Any) -> None:
        self._adapter = adapter
        self._lazy_cls = pending_blocks_class(adapter.blocks_class)
        self.num_calls = 0  # calls answered on the host, since construction
        self.num_steps = 0  # gpukv steps they were applied in
        self.num_reads = 0  # free counts read from the device (a call past the host's bound)
        self._clear()

    def _clear(self) -> None:
        # One tuple per call (one append, no Python per field): its row, vLLM request, vLLM's known tokens at
        # the call, gpukv's known and computed tokens before it, its computed tokens after it (``growth``'s
        # target), the slots it needs after it, the blocks it takes from the free queue (all groups) and the
        # blocks handed back (None when no block is new).
        self.calls: list[tuple[int, Any, int, int, int, int, int, int, Any]] = []
        self.taken = 0  # blocks the calls so far take, per the host
        self.spare: int | None = None  # free blocks known to be left for the next call

    def __len__(self) -> int:
        return len(self.calls)

    def add(self, request: Any, held: list[int], num_new_tokens: int, num_lookahead_tokens: int,
            max_model_len: int) -> Any:
        """vLLM's ``allocate_slots(request, num_new_tokens,
        num_lookahead_tokens=...)`` for a running request at row ``held[0]``
        holding ``held[1]`` blocks per group with ``held[2]`` tokens
        computed and ``held[3]`` known in gpukv (the adapter's record, which
        this updates): its new blocks (the empty instance when none are new,
        else blocks filled at the flush), or None when they do not fit."""
        a = self._adapter
        row, num_held, computed, before = held
        known = request.num_tokens
        _, slots, target = growth(request.num_computed_tokens, known, computed, num_new_tokens, num_lookahead_tokens,
                                  max_model_len)
        new_per_group = -(-slots // a.block_size) - num_held
        blocks = None
        popped = 0
        if new_per_group > 0:
            popped = new_per_group * a.num_kv_cache_groups
            if not self._take(popped):
                return None
            held[1] = num_held + new_per_group  # (gpukv's step holds max(held, ceil(slots / block_size)) positions)
            if not a.ids_on_device:
                blocks = self._lazy_cls(self)
        self.calls.append((row, request, known, before, computed, target, slots, popped, blocks))
        held[2] = target
        held[3] = known  # (the step appends vLLM's tokens past gpukv's)
        self.num_calls += 1
        return a.empty_kv_cache_blocks if blocks is None else blocks

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
              admitting: Sequence[Any] = ()) -> StepResult | None:
        """Apply the pending calls as one gpukv step, in call order, and fill
        the blocks handed back; ``new`` (a run of admissions,
        ``gpukv.vllm.v0_33.admissions``; ``admitting``: their vLLM requests)
        are admitted in the same step, after them, as vLLM's waiting loop
        comes after its running loop, within ``token_budget`` tokens (None:
        each whole). Returns the step's result (None when there was nothing
        to do)."""
        if not self.calls and not new:
            return None
        ids = not self._adapter.ids_on_device  # (with a gpukv worker, block ids stay on the device)
        try:
            wants_ids = ids and (bool(new) or any(call[8] is not None for call in self.calls))
            running = self._batch() if self.calls else ()
            result = self._adapter.manager.step(running=running, new=new, token_budget=token_budget,
                                                block_ids=wants_ids)
            self.num_steps += bool(self.calls)
            if result.running_failed_at is not None:
                raise AssertionError(f"gpukv refused running request {result.running_failed_at} of a batch the "
                                     "host counted as fitting: the host's block arithmetic is wrong")
            if wants_ids:
                for i, blocks in enumerate([call[8] for call in self.calls]):
                    if blocks is not None:
                        blocks.filled = tuple([Block(b) for b in group[i]] for group in result.running_block_ids)
            if self._adapter.event_translator.active:
                self._drain(result, admitting)
            return result
        except GpukvInputError:
            self._reread()
            raise
        finally:
            self._clear()

    def _drain(self, result: StepResult, admitting: Sequence[Any]) -> None:
        """The step's KV events, as vLLM's calls would have made them one by
        one: the running loop's, then the run's admissions'."""
        a = self._adapter
        caching, bs, groups = a.enable_caching, a.block_size, a.num_kv_cache_groups
        calls = [StepCall(r, popped, groups * (t // bs - c // bs) if caching else 0)
                 for _, r, _, _, c, t, _, popped, _ in self.calls]
        for i in range(result.num_admitted):
            request, hit = admitting[i], result.num_computed_tokens[i] // bs
            full = (result.num_computed_tokens[i] + result.num_new_tokens[i]) // bs
            calls.append(StepCall(request, groups * (a.manager.num_blocks_held(request.request_id) - hit),
                                  groups * (full - hit) if caching else 0))
        a.event_translator.drain_step(a.manager, calls, groups)

    def _reread(self) -> None:
        """gpukv refused the step and changed nothing: the adapter's records,
        which ``add`` moved ahead, read back from the manager (host only)."""
        for call in self.calls:
            self._adapter.note_held(call[1].request_id)

    def _batch(self) -> PrecheckedRunningBatch:
        """The pending calls as a ``RunningBatch``: each appends the tokens
        vLLM knows past gpukv's, computes (so caches) up to its ``growth``
        target, and reserves the rest of its slots as lookahead. Built from
        the adapter's records (rows held, gpukv's known and computed tokens),
        so gpukv takes it as checked (``PrecheckedRunningBatch``)."""
        rows, requests, known, before, computed, targets, slots, _, _ = zip(*self.calls, strict=True)
        tokens = new_tokens(requests, before, known)
        n = len(rows)
        before_np = np.fromiter(before, np.int64, n)
        counts = np.fromiter(known, np.int64, n) - before_np
        targets_np = np.fromiter(targets, np.int64, n)
        return prechecked_batch(np.fromiter(rows, np.int64, n), tokens, counts, before_np,
                                targets_np - np.fromiter(computed, np.int64, n),
                                np.fromiter(slots, np.int64, n) - targets_np)
