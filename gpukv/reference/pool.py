"""The reference's block pool (vLLM's ``BlockPool``): reference counts, the
free queue and the block-hash table, and the verbs every part of the
reference runs on (touch, allocate, free, cache). The rules are the
manager's module docstring's (``gpukv.reference.manager``)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence

from gpukv.core.checks import check_size
from gpukv.core.limits import MAX_NUM_BLOCKS
from gpukv.core.memory import check_memory
from gpukv.errors import NoFreeBlocksError
from gpukv.reference.digests import CachedBlockInfo

NULL_BLOCK = 0

# Host bytes per block of a full reference pool (counts, free-queue links,
# cached-block records and table entries), for the check before allocating.
_HOST_BYTES_PER_BLOCK = 640


class BlockPool:
    """Reference counts, the free queue and the block-hash table.

    Invariants (``check_invariants`` asserts them): every block but the null
    block is either in the free queue (count 0) or referenced (count > 0),
    never both; every cached block is in the table exactly once, under its own
    (digest, group); the table holds nothing else.
    """

    def __init__(self, num_blocks: int, *, uncached_first: bool = True, enable_caching: bool = True) -> None:
        self.num_blocks = check_size(num_blocks, "num_blocks", 2, MAX_NUM_BLOCKS)
        check_memory({"num_blocks": self.num_blocks * _HOST_BYTES_PER_BLOCK}, None, "the reference pool")
        self.uncached_first = bool(uncached_first)
        self.enable_caching = bool(enable_caching)
        self.ref_cnt = [0] * self.num_blocks
        # OrderedDict = a doubly linked list with O(1) pop-front, append,
        # prepend and removal from the middle.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, self.num_blocks))
        self._info: list[CachedBlockInfo | None] = [None] * self.num_blocks
        # (digest, group) -> its blocks in insertion order (dict keeps order).
        self._table: dict[tuple[bytes, int], dict[int, None]] = {}
        self.num_evictions = 0
        # called with a block's CachedBlockInfo as it is evicted (KV-cache events)
        self.on_evict: Callable[[CachedBlockInfo], None] | None = None

    # ---------------------------------------------------------------- reading
    @property
    def num_free_blocks(self) -> int:
        """Blocks in the free queue."""
        return len(self._free)

    def free_queue(self) -> list[int]:
        """Block ids of the free queue, front (next to be reused) to back."""
        return list(self._free)

    def free_blocks_in_order(self) -> Iterator[int]:
        """The free queue, front first, lazily (valid until the queue changes)."""
        return iter(self._free)

    def cached_info(self, block_id: int) -> CachedBlockInfo | None:
        return self._info[block_id]

    def table(self) -> dict[tuple[bytes, int], list[int]]:
        """(digest, group) -> cached blocks, oldest first."""
        return {key: list(blocks) for key, blocks in self._table.items()}

    def lookup(self, digest: bytes, group: int) -> int | None:
        """The oldest block cached under (digest, group), or None."""
        blocks = self._table.get((digest, group))
        return next(iter(blocks)) if blocks else None

    def verify(self, block_id: int, parent: bytes, tokens: bytes, extra: bytes) -> bool:
        """Whether a cached block was computed from exactly these inputs. A
        digest match whose parent, tokens or extra digest differ is a miss."""
        info = self._info[block_id]
        assert info is not None, f"block {block_id} is not cached"
        return info.parent == parent and info.extra == extra and info.tokens == tokens

    # --------------------------------------------------------------- changing
    def touch(self, block_ids: Iterable[int]) -> None:
        """Add a reference to each block; a free one leaves the free queue."""
        block_ids = list(block_ids)
        for b in block_ids:
            if b != NULL_BLOCK and self.ref_cnt[b] == 0 and self._info[b] is None:
                raise ValueError(f"touch: block {b} is free and not cached; only cached or referenced blocks can "
                                 "be hit")
        for b in block_ids:
            if b == NULL_BLOCK:
                continue
            if self.ref_cnt[b] == 0:
                del self._free[b]
            self.ref_cnt[b] += 1

    def allocate(self, num_blocks: int) -> list[int]:
        """Pop ``num_blocks`` blocks from the front, each with one reference.

        A popped block that is still cached loses its hash here (lazy eviction).
        """
        num_blocks = check_size(num_blocks, "num_blocks", 0)
        if num_blocks > len(self._free):
            raise NoFreeBlocksError(
                f"cannot allocate {num_blocks} blocks: only {len(self._free)} are free"
            )
        out = []
        for _ in range(num_blocks):
            b, _ = self._free.popitem(last=False)
            if self._info[b] is not None:
                self._evict(b)
            self.ref_cnt[b] = 1
            out.append(b)
        return out

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block, in the order given (callers pass
        a request's blocks tail first). Nothing changes if any block would go
        below zero."""
        block_ids = list(block_ids)
        drops: dict[int, int] = {}
        for b in block_ids:
            if b == NULL_BLOCK:
                continue
            if not 0 < b < self.num_blocks:
                raise ValueError(f"free: block id {b} is outside 1..{self.num_blocks - 1}")
            drops[b] = drops.get(b, 0) + 1
            if drops[b] > self.ref_cnt[b]:
                raise ValueError(f"free: block {b} has {self.ref_cnt[b]} references, cannot drop {drops[b]} "
                                 "(double free?)")
        to_front = []
        for b in block_ids:
            if b == NULL_BLOCK:
                continue
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                if self.uncached_first and self._info[b] is None:
                    to_front.append(b)
                else:
                    self._free[b] = None
        for b in reversed(to_front):
            self._free[b] = None
            self._free.move_to_end(b, last=False)

    def cache(self, block_id: int, info: CachedBlockInfo) -> None:
        """Give a referenced, uncached block its hash; it joins the end of its
        hash's list (a duplicate of an existing hash is kept, as in vLLM)."""
        if self.ref_cnt[block_id] == 0 or self._info[block_id] is not None:
            raise ValueError(f"cache: block {block_id} must be referenced and not cached yet")
        self._info[block_id] = info
        self._table.setdefault((info.digest, info.group), {})[block_id] = None

    def reset_prefix_cache(self) -> bool:
        """Drop every hash, only when every block but the null block is free."""
        if len(self._free) != self.num_blocks - 1:
            return False
        self._table.clear()
        self._info = [None] * self.num_blocks
        return True

    def _evict(self, block_id: int) -> None:
        info = self._info[block_id]
        assert info is not None, f"block {block_id} is not cached"
        key = (info.digest, info.group)
        blocks = self._table[key]
        del blocks[block_id]
        if not blocks:
            del self._table[key]
        self._info[block_id] = None
        self.num_evictions += 1
        if self.on_evict is not None:
            self.on_evict(info)

    # ----------------------------------------------------------------- checks
    def check_invariants(self) -> None:
        assert NULL_BLOCK not in self._free, "the null block is in the free queue"
        for b in range(1, self.num_blocks):
            in_free = b in self._free
            assert self.ref_cnt[b] >= 0, f"block {b} has a negative count"
            assert in_free == (self.ref_cnt[b] == 0), f"block {b}: count {self.ref_cnt[b]}, in free queue: {in_free}"
        seen = 0
        for (digest, group), blocks in self._table.items():
            assert blocks, f"empty table entry for {digest.hex()}"
            for b in blocks:
                info = self._info[b]
                assert info is not None and info.digest == digest and info.group == group, \
                    f"stale table entry -> block {b}"
                seen += 1
        assert seen == sum(info is not None for info in self._info), "a cached block is missing from the table"
