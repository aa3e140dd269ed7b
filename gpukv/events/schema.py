"""KV-cache events: what a KV-aware router needs to mirror a manager's prefix
cache, following vLLM's KV-event schema (``vllm/distributed/kv_events.py``).

* ``BlockStored``: blocks were cached. ``block_hashes`` are their digests in
  chain order (a run of consecutive blocks of one request), ``parent_block_hash``
  the digest before the first (None at the start of a chain), ``token_ids`` the
  blocks' tokens one block after another, ``block_size``, ``lora_id`` (None
  without LoRA), and gpukv's ``group`` (the KV-cache group; vLLM 0.8.5 has one).
* ``BlockRemoved``: cached blocks were evicted (``block_hashes``, ``group``).
* ``AllBlocksCleared``: the prefix cache was reset.

Digests are gpukv's 16-byte keyed BLAKE3 digests (vLLM's are ints); a block
of a group is stored once per block that holds it, so an index keyed by
``(digest, group)`` counts blocks, as the manager's table does
(``tests/events/test_events.py`` replays the events into such an index and checks it
against the table after every step).

Events come in ``KVEventBatch``es with a sequence number that grows by one per
batch, parents before children within a batch (the order the manager caches
in). The reference makes one batch per call that changed the cache; the device
manager collects its events on the device and makes a batch at each read of
its step status (``docs/design.md``), so several decode steps can share one.
``dropped`` counts events lost to a full device buffer since the last batch:
never silent, the manager also warns.

On the wire. ``gpukv.events.wire`` publishes these batches as vLLM 0.33.0
does (msgpack over a ZMQ PUB socket with a replay socket) and turns what a
subscriber receives back into them (``from_wire``). There a digest may be an
int (vLLM's default form: the digest's last 8 bytes, big-endian), hence
``BlockHash``; the managers' own events always carry 16-byte digests.

A router's index of these events is ``gpukv.events.router.RouterIndex``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

#: A block's digest: gpukv's 16 bytes, or an int as vLLM's wire form has it
#: (``gpukv.events.wire``: the digest's last 8 bytes, big-endian).
BlockHash = bytes | int


@dataclass(frozen=True)
class BlockStored:
    """Blocks were cached (see the module docstring for the fields)."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    group: int = 0


@dataclass(frozen=True)
class BlockRemoved:
    """Cached blocks were evicted."""

    block_hashes: list[BlockHash]
    group: int = 0


@dataclass(frozen=True)
class AllBlocksCleared:
    """The prefix cache was reset: every cached block is forgotten."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class KVEventBatch:
    """One batch: its sequence number, events, wall time, and how many
    events were dropped before it (a full device buffer)."""

    seq: int
    events: list[KVCacheEvent]
    ts: float = field(default_factory=time.time)
    dropped: int = 0


def merge_runs(events: list[KVCacheEvent]) -> list[KVCacheEvent]:
    """Adjacent ``BlockStored`` events that continue one chain (the second's
    parent is the first's last digest, same group, LoRA and block size)
    become one, as vLLM emits a request's newly cached blocks together."""
    out: list[KVCacheEvent] = []
    for e in events:
        last = out[-1] if out else None
        if (isinstance(e, BlockStored) and isinstance(last, BlockStored) and e.parent_block_hash is not None
                and e.parent_block_hash == last.block_hashes[-1] and (e.group, e.lora_id, e.block_size)
                == (last.group, last.lora_id, last.block_size)):
            out[-1] = BlockStored(last.block_hashes + e.block_hashes, last.parent_block_hash,
                                  last.token_ids + e.token_ids, e.block_size, e.lora_id, e.group)
        else:
            out.append(e)
    return out


class EventQueue:
    """The batches a manager made and its caller has not taken yet."""

    def __init__(self) -> None:
        self._batches: list[KVEventBatch] = []
        self._seq = 0

    def add(self, events: list[KVCacheEvent], dropped: int = 0) -> None:
        """One batch of ``events`` (merged into runs), if there is anything to say."""
        if not events and not dropped:
            return
        self._batches.append(KVEventBatch(self._seq, merge_runs(events), dropped=dropped))
        self._seq += 1

    def take(self) -> list[KVEventBatch]:
        batches, self._batches = self._batches, []
        return batches


def int_block_hash(digest: bytes) -> int:
    """A digest in vLLM's int form: its last 8 bytes as a big-endian int
    (vLLM's ``maybe_convert_block_hash``, the default of its KV events)."""
    return int.from_bytes(digest, "big") & (2**64 - 1)
