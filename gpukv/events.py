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

On the wire. ``gpukv.kv_events`` publishes these batches as vLLM 0.33.0
does (msgpack over a ZMQ PUB socket with a replay socket) and turns what a
subscriber receives back into them (``from_wire``). There a digest may be an
int (vLLM's default form: the digest's last 8 bytes, big-endian), hence
``BlockHash``; the managers' own events always carry 16-byte digests.

``RouterIndex`` is what a KV-aware router keeps from the events of many
workers, and ``match`` answers its question: how long a prefix of these
tokens each worker holds. It hashes the tokens as the managers do, so it
needs their hash key and block size (``RouterIndex.for_manager(m)``, or both
given); the key is a secret of the deployment and never on the wire.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

#: A block's digest: gpukv's 16 bytes, or an int as vLLM's wire form has it
#: (``gpukv.kv_events``: the digest's last 8 bytes, big-endian).
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


@dataclass
class _Worker:
    blocks: dict[tuple[BlockHash, int], int] = field(default_factory=dict)
    next_seq: int = 0


class RouterIndex:
    """What a KV-aware router keeps from the events: for each worker, how
    many cached blocks each ``(digest, group)`` has (a reference
    implementation, for tests, examples and routers written in Python).

    ``apply(batch, worker)`` takes a worker's batches in order (a gap or a
    batch with dropped events raises: replay, or rebuild the worker's index);
    ``match(token_ids, ...)`` says how many leading blocks of a request each
    worker has cached. Matching hashes the tokens as the managers do, so it
    needs the managers' ``hash_key`` and ``block_size``
    (``RouterIndex.for_manager(m)`` takes both from a manager); every worker
    of one index must share them, as the workers a router balances share a
    model. ``int_block_hashes=True`` for events whose digests arrive in
    vLLM's int form (``gpukv.kv_events``' default). ``blocks`` and
    ``next_seq`` are worker 0's (the only one when ``apply`` is given none).
    """

    def __init__(self, hash_key: bytes | str | None = None, block_size: int | None = None, *,
                 int_block_hashes: bool = False) -> None:
        from gpukv.hashing import resolve_hash_key

        # An explicit key only: resolving None would pick a random key (or the
        # environment's), and a match under the wrong key silently finds nothing.
        self.hash_key = None if hash_key is None else resolve_hash_key(hash_key)
        if block_size is not None and (not isinstance(block_size, int) or isinstance(block_size, bool)
                                       or block_size < 1):
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.block_size = block_size
        self.int_block_hashes = bool(int_block_hashes)
        self._workers: dict[Hashable, _Worker] = {}

    @classmethod
    def for_manager(cls, manager: Any, *, int_block_hashes: bool = False) -> RouterIndex:
        """An index that matches as ``manager`` hashes (its key and block size)."""
        return cls(manager.hash_key, manager.block_size, int_block_hashes=int_block_hashes)

    @property
    def workers(self) -> list[Hashable]:
        """The workers seen, in the order their first batch came."""
        return list(self._workers)

    def blocks_of(self, worker: Hashable = 0) -> dict[tuple[BlockHash, int], int]:
        """Cached blocks per ``(digest, group)`` of ``worker`` (empty if unseen)."""
        w = self._workers.get(worker)
        return w.blocks if w is not None else {}

    @property
    def blocks(self) -> dict[tuple[BlockHash, int], int]:
        return self.blocks_of(0)

    @property
    def next_seq(self) -> int:
        w = self._workers.get(0)
        return w.next_seq if w is not None else 0

    def next_seq_of(self, worker: Hashable = 0) -> int:
        """The sequence number ``worker``'s next batch must have."""
        w = self._workers.get(worker)
        return w.next_seq if w is not None else 0

    def remove_worker(self, worker: Hashable) -> None:
        """Forget ``worker`` (it left, or its index is to be rebuilt from sequence 0)."""
        self._workers.pop(worker, None)

    def apply(self, batch: KVEventBatch, worker: Hashable = 0) -> None:
        """Apply ``worker``'s next batch."""
        w = self._workers.setdefault(worker, _Worker())
        if batch.seq != w.next_seq:
            raise ValueError(f"worker {worker!r}: batch {batch.seq} out of order (expected {w.next_seq})")
        if batch.dropped:
            raise ValueError(f"worker {worker!r}: batch {batch.seq}: {batch.dropped} events were dropped; "
                             "the index is stale")
        want = int if self.int_block_hashes else bytes
        for e in batch.events:
            if isinstance(e, BlockStored | BlockRemoved):
                for d in e.block_hashes:
                    if not isinstance(d, want):
                        raise ValueError(f"worker {worker!r}: a block hash of type {type(d).__name__}; this index "
                                         f"takes {want.__name__} hashes (int_block_hashes={self.int_block_hashes})")
        w.next_seq += 1
        blocks = w.blocks
        for e in batch.events:
            if isinstance(e, AllBlocksCleared):
                blocks.clear()
            elif isinstance(e, BlockStored):
                for d in e.block_hashes:
                    key = (d, e.group)
                    blocks[key] = blocks.get(key, 0) + 1
            else:
                for d in e.block_hashes:
                    key = (d, e.group)
                    left = blocks.get(key, 0) - 1
                    if left < 0:
                        shown = d.hex() if isinstance(d, bytes) else d
                        raise ValueError(f"worker {worker!r}: removal of a block never stored: {shown} "
                                         f"(group {e.group})")
                    if left:
                        blocks[key] = left
                    else:
                        del blocks[key]

    def block_hashes(self, token_ids: Sequence[int], *, lora_id: int | None = None, mm_items: Sequence[Any] = (),
                     cache_salt: str | None = None) -> list[BlockHash]:
        """The digests of the full blocks of ``token_ids`` (in this index's
        form), as a manager with this key and block size computes them for a
        request with these extra keys (``NewRequest``'s ``lora_id``,
        ``mm_items`` and ``cache_salt``)."""
        from gpukv import hashing

        if self.hash_key is None or self.block_size is None:
            raise ValueError("matching needs the managers' hash_key and block_size: "
                             "RouterIndex(hash_key, block_size) or RouterIndex.for_manager(manager)")
        key, bs = self.hash_key, self.block_size
        n = len(token_ids) // bs
        extras = hashing.extra_key_digests(key, n, bs, lora_id=lora_id, mm_items=mm_items, cache_salt=cache_salt)
        digests = hashing.hash_block_chain(key, token_ids, bs, extras=extras)
        return [int_block_hash(d) for d in digests] if self.int_block_hashes else list(digests)

    def match(self, token_ids: Sequence[int], *, lora_id: int | None = None, mm_items: Sequence[Any] = (),
              cache_salt: str | None = None, group: int = 0,
              workers: Sequence[Hashable] | None = None) -> dict[Hashable, int]:
        """The longest cached prefix of a request on each worker, in blocks:
        ``{worker: n}``, where the worker holds the request's first ``n``
        full blocks in KV-cache ``group`` (every worker seen, or those in
        ``workers``; 0 where none). A manager's hit is at most
        ``(len(token_ids) - 1) // block_size`` blocks (the last token is
        always computed), and for a sliding-window group it needs only the
        window's blocks: this answers the full-attention question."""
        hashes = self.block_hashes(token_ids, lora_id=lora_id, mm_items=mm_items, cache_salt=cache_salt)
        out: dict[Hashable, int] = {}
        for worker in (self.workers if workers is None else workers):
            blocks = self.blocks_of(worker)
            n = 0
            for d in hashes:
                if (d, group) not in blocks:
                    break
                n += 1
            out[worker] = n
        return out
