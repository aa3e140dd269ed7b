"""The device manager's KV-cache event buffer (``gpukv.events.schema``).

Events are written on the device, in the order the step changes the cache,
by torch operations around the kernels that cache and evict (no host read):
``removes`` between a pop and the erase of the popped blocks' hashes (the
digests are still in the table then), ``stores`` right after ``record``
(the block's inputs were just copied into the pool). Each event is one row of
``meta`` (int64[capacity + 1, 9]: kind, group, digest lanes, parent lanes,
LoRA id, position, whether there is a LoRA id; no block id: an event names
its block by its digest, so a drain never brings an id to the host) and of ``tokens`` (int32[capacity + 1,
block_size]); the last row is where masked-out entries and overflow go.
``count`` (int64[1]) counts the events written since the last drain, so
``count - capacity`` were dropped when it exceeds the capacity.

The host drains the buffer with a read it makes anyway (the step's status)
or, in ``take_events``, with a read of its own; ``bound`` is the host's upper
bound of the events written since the last drain (entries of the launches
that could write one), so a drain copies only that many rows.
"""

from __future__ import annotations

import torch

from gpukv.events.schema import BlockRemoved, BlockStored, KVCacheEvent

STORE, REMOVE = 1, 2
_WIDTH = 9  # kind, group, lo, hi, parent lo, parent hi, lora, position, has lora


def _u64(x: int) -> int:
    return x & (2**64 - 1)


def _digest(lo: int, hi: int) -> bytes:
    return _u64(lo).to_bytes(8, "little") + _u64(hi).to_bytes(8, "little")


class DeviceEventLog:
    """A bounded event buffer on ``device`` (see the module docstring)."""

    def __init__(self, capacity: int, block_size: int, device: torch.device) -> None:
        self.capacity = capacity
        self.block_size = block_size
        self.meta = torch.zeros((capacity + 1, _WIDTH), dtype=torch.int64, device=device)
        self.tokens = torch.zeros((capacity + 1, block_size), dtype=torch.int32, device=device)
        self.count = torch.zeros(1, dtype=torch.int64, device=device)
        self.bound = 0  # host: events possibly written since the last drain

    def _slots(self, flags: torch.Tensor) -> torch.Tensor:
        """Buffer rows for the flagged entries, in entry order (the spare last
        row for the others and past the capacity); counts them."""
        f = flags.to(torch.int64)
        slot = self.count + torch.cumsum(f, 0) - f
        slot = torch.where((f > 0) & (slot < self.capacity), slot, torch.full_like(slot, self.capacity))
        self.count += f.sum()
        return slot

    def stores(self, ok, blk, key, group, row, pos, *, blk_parent, blk_tokens, row_lora) -> None:
        """The blocks ``record`` just cached (``ok`` int32[K] set): digest
        ``key`` int64[K, 2], the pool's copy of their parent and tokens, the
        LoRA id of their request's row (``row_lora`` int64[R, 2]: whether it
        has one, and the id's bits)."""
        slot = self._slots(ok != 0)
        b = blk.to(torch.int64).clamp(min=0)
        r = row.to(torch.int64)
        cols = [torch.full_like(b, STORE), group.to(torch.int64), key[:, 0], key[:, 1], blk_parent[b, 0],
                blk_parent[b, 1], row_lora[r, 1], pos.to(torch.int64), row_lora[r, 0]]
        self.meta[slot] = torch.stack(cols, 1)
        self.tokens[slot] = blk_tokens[b]

    def removes(self, popped, table) -> None:
        """The popped blocks (int32[E], -1 padding) that are still cached,
        with their digests, before the erase drops them."""
        p = popped.to(torch.int64)
        pc = p.clamp(min=0)
        s = table.block_slot[pc].to(torch.int64)
        cached = (p >= 0) & (s >= 0)
        slot = self._slots(cached)
        sc = s.clamp(min=0)
        zero = torch.zeros_like(pc)
        cols = [torch.full_like(pc, REMOVE), table.slot_group[sc].to(torch.int64), table.slot_lo[sc],
                table.slot_hi[sc], zero, zero, zero, zero, zero]
        self.meta[slot] = torch.stack(cols, 1)

    def drain_parts(self) -> list[torch.Tensor]:
        """What a drain reads (flat int64): the count, then ``min(bound,
        capacity)`` rows of meta and of tokens. Empty when nothing can be pending."""
        rows = min(self.bound, self.capacity)
        if rows == 0:
            return []
        return [self.count, self.meta[:rows].reshape(-1), self.tokens[:rows].to(torch.int64).reshape(-1)]

    def drained(self, values: list[int]) -> tuple[list[KVCacheEvent], int]:
        """The events a drain read (``values``: what ``drain_parts`` gave, as
        host ints), and how many were dropped; resets the device count."""
        rows = min(self.bound, self.capacity)
        count = values[0]
        n = min(count, rows)
        meta = values[1: 1 + rows * _WIDTH]
        toks = values[1 + rows * _WIDTH:]
        bs = self.block_size
        events: list[KVCacheEvent] = []
        for i in range(n):
            kind, group, lo, hi, plo, phi, lora, pos, has_lora = meta[i * _WIDTH: (i + 1) * _WIDTH]
            if kind == STORE:
                tokens = [t & 0xFFFFFFFF for t in toks[i * bs: (i + 1) * bs]]
                events.append(BlockStored([_digest(lo, hi)], _digest(plo, phi) if pos > 0 else None, tokens, bs,
                                          _u64(lora) if has_lora else None, group))
            else:
                events.append(BlockRemoved([_digest(lo, hi)], group))
        self.count.zero_()
        self.bound = 0
        return events, max(0, count - self.capacity)
