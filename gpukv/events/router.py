"""A KV-aware router's index of the KV-cache events (``gpukv.events.schema``).

``RouterIndex`` is what a KV-aware router keeps from the events of many
workers, and ``match`` answers its question: how long a prefix of these
tokens each worker holds. It hashes the tokens as the managers do, so it
needs their hash key and block size (``RouterIndex.for_manager(m)``, or both
given); the key is a secret of the deployment and never on the wire.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gpukv.events.schema import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, KVEventBatch, int_block_hash

if TYPE_CHECKING:
    from gpukv.core.protocol import BlockManager


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
    vLLM's int form (``gpukv.events.wire``' default). ``blocks`` and
    ``next_seq`` are worker 0's (the only one when ``apply`` is given none).
    """

    def __init__(self, hash_key: bytes | str | None = None, block_size: int | None = None, *,
                 int_block_hashes: bool = False) -> None:
        from gpukv.core.hashing import resolve_hash_key

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
    def for_manager(cls, manager: BlockManager, *, int_block_hashes: bool = False) -> RouterIndex:
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
        from gpukv.core import hashing

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
