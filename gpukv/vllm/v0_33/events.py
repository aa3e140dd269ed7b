"""gpukv's KV events as vLLM 0.33 publishes them, and what the adapter reads of them.

gpukv emits one ``BlockStored`` per block, under its own digests; vLLM emits
one per ``cache_full_blocks`` call and group, under the request's block
hashes (``maybe_convert_block_hash``: 64-bit ints by default), each tagged
with its group's spec kind and window (``kv_cache_manager.py:705-730``). The
adapter drains gpukv's events after each call, so the blocks one call stored
for one group are one run; their positions in the request give vLLM's hashes.
A digest's vLLM hash is remembered while a block is cached under it, for its
``BlockRemoved``.

A batched step (``gpukv.vllm.v0_33.pending``: the running loop's calls and a
run of admissions as one gpukv step) logs its phases' order: every removal
(the running rows' pops, then the admissions'), every store. vLLM's order is
per call: the call's removals, then its stores (``drain_step`` regroups
them). The stores are the calls' own, in call order, so a count per call
cuts them. A removal carries a digest and a group, not the pop that evicted
it, but the free order says which pops evict: with uncached blocks freed to
the front and cached ones to the tail (vLLM 0.33's order, gpukv's
``uncached_first``), the free queue is its uncached blocks, then its cached
ones, and a step's pops, all from the front, evict exactly its last ``E``
(``E`` removals; a hit touched between the pops takes a cached block from
the middle and changes neither part). A removal's group is the one its block
was cached in, which any group's pop may evict (a hybrid model's released
window blocks wait at the tail beside full-attention ones), so it says
nothing of the pop; ``tests/test_vllm033/test_streams.py`` compares the
events with vLLM's, step by step.

The same stream keeps, when asked (``index=True``), which of vLLM's block
hashes each group has cached: what the shared-prefix boundary needs where
vLLM's first lookup group is not every full-attention group (the hit of one
window group alone, which gpukv's lookup does not report; its full-attention
hit it does).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpukv.core.protocol import BlockManager


@dataclass(frozen=True)
class StepCall:
    """One vLLM ``allocate_slots`` call applied in a batched gpukv step: its
    request, the blocks it popped from the free queue (all groups, group by
    group) and the blocks it cached (all groups)."""

    request: Any
    num_popped: int
    num_stored: int


class EventTranslator:
    """Drains a gpukv manager's events call by call: vLLM's events (when
    ``publish``) and the cached index (when ``index``)."""

    def __init__(self, kv_cache_config: Any, block_size: int, *, publish: bool, index: bool) -> None:
        from vllm.v1.kv_cache_interface import (  # type: ignore[attr-defined,unused-ignore]  # (vLLM 0.33 only)
            get_kv_cache_spec_kind,
            get_kv_cache_spec_sliding_window,
        )

        self.block_size = block_size
        self.publish, self.index = publish, index
        self.metadata = [(get_kv_cache_spec_kind(g.kv_cache_spec).value,
                          get_kv_cache_spec_sliding_window(g.kv_cache_spec)) for g in kv_cache_config.kv_cache_groups]
        self.events: list[Any] = []
        # gpukv digest -> [vLLM's external hash, vLLM's block hash, blocks cached under it]
        self._known: dict[bytes, list[Any]] = {}
        # (vLLM block hash, group) -> blocks cached under it (``index`` only)
        self._cached: Counter[tuple[Any, int]] = Counter()

    @property
    def active(self) -> bool:
        """Whether anything reads gpukv's events (else gpukv logs none)."""
        return self.publish or self.index

    def is_cached(self, block_hash: Any, group: int) -> bool:
        """Whether ``group`` has a block cached under vLLM's ``block_hash`` (``index`` only)."""
        return self._cached[(block_hash, group)] > 0

    def drain(self, manager: BlockManager, request: Any | None) -> None:
        """Translate what ``manager`` logged since the last drain (one call)."""
        self._translate(manager, [e for batch in manager.take_events() for e in batch.events], request)

    def drain_step(self, manager: BlockManager, calls: Sequence[StepCall],
                   before: Callable[[int], None] | None = None) -> None:
        """Translate what one batched step logged as vLLM's ``calls`` would
        have, one after another (module docstring): each call's removals,
        then its stores; ``before(i)`` runs just before call ``i``'s, when
        the index stands as vLLM's cache did at that call's lookup."""
        from gpukv.events import schema as gk

        removed: list[Any] = []
        stored: list[Any] = []
        for batch in manager.take_events():
            for event in batch.events:
                if isinstance(event, gk.BlockRemoved):
                    removed += [gk.BlockRemoved([d], event.group) for d in event.block_hashes]
                elif isinstance(event, gk.BlockStored):
                    stored += _one_per_block(event)
                else:
                    raise AssertionError("a batched step cleared the prefix cache")
        first_evicting = sum(c.num_popped for c in calls) - len(removed)
        if first_evicting < 0 or sum(c.num_stored for c in calls) != len(stored):
            raise AssertionError(f"a batched step logged {len(removed)} removals and {len(stored)} stores, more "
                                 "than its calls popped or other than they cached")
        popped = cached = 0
        for i, call in enumerate(calls):
            if before is not None:
                before(i)
            own = removed[max(popped, first_evicting) - first_evicting:
                          max(popped + call.num_popped, first_evicting) - first_evicting]
            self._translate(manager, own + stored[cached:cached + call.num_stored], call.request)
            popped += call.num_popped
            cached += call.num_stored

    def _translate(self, manager: BlockManager, events: list[Any], request: Any | None) -> None:
        """vLLM's events of one call's gpukv ``events``, in order: gpukv's
        stores merged per chain and group."""
        from gpukv.events import schema as gk

        run: list[Any] = []
        positions: dict[bytes, int] | None = None
        for event in events:
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
        from vllm.v1.core.kv_cache_utils import (  # type: ignore[attr-defined,unused-ignore]  # (vLLM 0.33 only)
            maybe_convert_block_hash,
        )

        assert positions is not None and request is not None
        first = positions[run[0].block_hashes[0]]
        last = positions[run[-1].block_hashes[-1]]
        group = run[0].group
        raw = request.block_hashes[first:last + 1]
        digests = [d for event in run for d in event.block_hashes]
        for digest, block_hash in zip(digests, raw, strict=True):
            entry = self._known.setdefault(digest, [maybe_convert_block_hash(block_hash), block_hash, 0])
            entry[2] += 1
            if self.index:
                self._cached[(block_hash, group)] += 1
        if self.publish:
            self.events.append(self._block_stored(request, first, last, group))

    def _block_stored(self, request: Any, first: int, last: int, group: int) -> Any:
        from vllm.distributed.kv_events import BlockStored
        from vllm.v1.core.kv_cache_utils import (  # type: ignore[attr-defined,unused-ignore]  # (vLLM 0.33 only)
            generate_block_hash_extra_keys,
            maybe_convert_block_hash,
            to_event_extra_keys,
        )

        bs = self.block_size
        extra, mm_index = [], 0
        for i in range(first, last + 1):
            keys, mm_index = generate_block_hash_extra_keys(request, i * bs, (i + 1) * bs, mm_index)
            extra.append(keys)
        lora = request.lora_request
        kind, window = self.metadata[group]
        return BlockStored(
            block_hashes=[maybe_convert_block_hash(request.block_hashes[i]) for i in range(first, last + 1)],
            parent_block_hash=maybe_convert_block_hash(request.block_hashes[first - 1]) if first else None,
            token_ids=request.all_token_ids[first * bs:(last + 1) * bs], block_size=bs,
            lora_id=lora.adapter_id if lora else None, medium="GPU", lora_name=lora.name if lora else None,
            extra_keys=to_event_extra_keys(extra), group_idx=group, session_id=request.session_id,
            kv_cache_spec_kind=kind, kv_cache_spec_sliding_window=window)

    def _removed(self, event: Any) -> None:
        from vllm.distributed.kv_events import BlockRemoved

        for digest in event.block_hashes:
            entry = self._known[digest]
            entry[2] -= 1
            if not entry[2]:
                del self._known[digest]
            if self.index:
                key = (entry[1], event.group)
                self._cached[key] -= 1
                if not self._cached[key]:
                    del self._cached[key]
            if self.publish:
                self.events.append(BlockRemoved(block_hashes=[entry[0]], medium="GPU", group_idx=event.group))

    def _cleared(self) -> None:
        from vllm.distributed.kv_events import AllBlocksCleared

        self._known.clear()
        self._cached.clear()
        if self.publish:
            self.events.append(AllBlocksCleared())

    def take(self) -> list[Any]:
        events, self.events = self.events, []
        return events


def _one_per_block(event: Any) -> list[Any]:
    """A gpukv ``BlockStored`` of several blocks as one event per block, each
    parented on the one before (a step's merged runs may span calls)."""
    from gpukv.events import schema as gk

    bs, parent, out = event.block_size, event.parent_block_hash, []
    for i, digest in enumerate(event.block_hashes):
        out.append(gk.BlockStored([digest], parent, event.token_ids[i * bs:(i + 1) * bs], bs, event.lora_id,
                                  event.group))
        parent = digest
    return out
