"""The device block-hash table: a multimap (digest, group) -> cached blocks.

Semantics (those of ``reference.BlockPool``'s table, ``docs/design.md``, Semantics):

* A key is ``(lo, hi, group)``: the 128-bit block digest as two int64 lanes
  (the two's-complement views of the uint64 halves, see
  ``gpukv/kernels/block_hash.py``) and the KV-cache group id (int32). Any value
  is a valid key, (0, 0) and negative lanes included.
* Several blocks may be cached under one key (duplicates, kept as in vLLM);
  they are ordered by insertion. A lookup returns the **oldest live** block
  under the key; erasing any block leaves the others serving.

Layout (``N`` = num_blocks, ``cap`` = capacity, a power of two >= 2N):

* ``slot_lo``, ``slot_hi``: int64[cap], ``slot_group``: int32[cap]: the key
  of the entry in each slot (meaningful only while the slot holds a block).
* ``slot_block``: int32[cap]: the block cached in the slot, or ``EMPTY`` (-1,
  never used since the last clear/rebuild: ends a probe) or ``TOMBSTONE``
  (-2, erased: a probe walks over it, an insert may reuse it).
* ``block_slot``: int32[N]: the slot holding block b, or ``NO_SLOT`` (-1).
* ``block_seq``: int64[N]: block b's insertion sequence number (meaningful
  while b is cached). "Oldest" = smallest sequence number, so the order of
  duplicates does not depend on where they sit in the slot array.
* ``counters``: int64[4] = ``[LIVE, TOMBSTONES, NEXT_SEQ, ERRORS]``; error
  bits: ``ERR_FULL`` (1: an insert found no free slot in ``cap`` probes; that
  entry was dropped), ``ERR_DOUBLE_INSERT`` (2: an insert of a block that was
  already cached, or twice in one batch; the later claimant was dropped),
  ``ERR_BAD_BLOCK`` (4: a block id outside ``0..N-1`` given to insert or
  erase; ignored). Flags are sticky until ``clear_errors``. The host reads
  the counters at most once per step (``read_counters``), never a launcher.
* Scratch for rebuild: ``scratch_lo/hi`` int64[N], ``scratch_group`` int32[N],
  ``rebuild_flag`` int32[1].

One slot per cached block (duplicates occupy separate slots), linear probing
from the home slot ``home(lo, hi, group) & (cap - 1)``.

Concurrency and visibility. Within one insert launch, entries claim slots with
``atomic_cas`` on ``slot_block`` (EMPTY/TOMBSTONE -> block), never racing plain
stores, and then write the key fields of the slot they own. No kernel reads a
slot's key fields in the launch that writes them: ``find_oldest`` and
``rebuild`` read keys only of slots filled by *earlier* launches, and the
boundary between launches on one stream makes those writes visible. Keep
lookups and inserts in separate launches on one stream (or synchronise the
streams); that is all the ordering the table needs. Erase also only runs in
its own launch. The interpreter runs the programs of a launch one after
another and the lanes of an atomic in lane order, so real races happen only
on a GPU (the ``gpu``-marked tests).

Ordering guarantee. ``insert`` gives the valid entries of a batch consecutive
sequence numbers in batch order (``NEXT_SEQ`` + rank among the batch's valid
entries), computed before any slot is claimed, so the insertion order is the
batch order whichever thread wins which slot; batches are ordered by launch
order. ``rebuild`` keeps every block's sequence number, hence the order.

Launchers (device tensors in and out, no host synchronisation):

* ``insert(table, lo, hi, group, block, valid=None)``      2 launches
* ``find_oldest(table, lo, hi, group, valid=None, out=None) -> int32[K]``
* ``erase(table, block, valid=None)``
* ``clear(table)``
* ``rebuild(table)`` / ``maybe_rebuild(table, min_tombstones=None)``  2 launches
* ``clear_errors(table)``

Host helpers for tests and invariants (these synchronise):
``HashTable.entries()``, ``HashTable.check_invariants()``,
``HashTable.read_counters()``, ``home_slot()``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpukv import _runtime  # noqa: F401  (sets TRITON_INTERPRET before triton loads)

import torch
import triton
import triton.language as tl

from gpukv.kernels.toolkit import (
    INT32,
    INT64,
    PROBE_TILE,
    SCAN_TILE,
    check_device,
    check_num_blocks,
    check_tensor,
    check_tile,
    false_like,
    full_like,
    pow2_at_least,
)
from gpukv.kernels.block_hash import to_u64

__all__ = [
    "NUM_COUNTERS",
    "COUNTER_SLOTS",
    "EMPTY",
    "TOMBSTONE",
    "NO_SLOT",
    "LIVE",
    "TOMBSTONES",
    "NEXT_SEQ",
    "ERRORS",
    "ERR_FULL",
    "ERR_DOUBLE_INSERT",
    "ERR_BAD_BLOCK",
    "HashTable",
    "home_slot",
    "insert",
    "find_oldest",
    "erase",
    "clear",
    "rebuild",
    "maybe_rebuild",
    "clear_errors",
]

# ---------------------------------------------------------------- sentinels
#: ``slot_block`` value of a slot never used since the last clear/rebuild.
EMPTY = -1
#: ``slot_block`` value of an erased slot (probes walk over it).
TOMBSTONE = -2
#: ``block_slot`` value of a block that is not cached.
NO_SLOT = -1
#: ``block_slot`` value of a block being inserted (only inside an insert launch).
_CLAIMING = -3
#: A compare value no slot_block/block_slot word ever holds: a CAS with it is a no-op.
_NEVER = -4

# ----------------------------------------------------------- counter layout
#: Slots of ``counters`` (int64[NUM_COUNTERS]): live entries, tombstones, the
#: next insertion sequence number, the sticky error bits.
LIVE = 0
TOMBSTONES = 1
NEXT_SEQ = 2
ERRORS = 3
NUM_COUNTERS = 4
#: Counter slot by name (host side, ``read_counters``).
COUNTER_SLOTS = {"live": LIVE, "tombstones": TOMBSTONES, "next_seq": NEXT_SEQ, "errors": ERRORS}

ERR_FULL = 1
ERR_DOUBLE_INSERT = 2
ERR_BAD_BLOCK = 4

# constexpr copies for the kernels (Triton reads globals only as constexpr)
_D_EMPTY = tl.constexpr(EMPTY)
_D_TOMBSTONE = tl.constexpr(TOMBSTONE)
_D_NO_SLOT = tl.constexpr(NO_SLOT)
_D_CLAIMING = tl.constexpr(_CLAIMING)
_D_NEVER = tl.constexpr(_NEVER)
_D_LIVE = tl.constexpr(LIVE)
_D_TOMBSTONES = tl.constexpr(TOMBSTONES)
_D_NEXT_SEQ = tl.constexpr(NEXT_SEQ)
_D_ERRORS = tl.constexpr(ERRORS)
_D_ERR_FULL = tl.constexpr(ERR_FULL)
_D_ERR_DOUBLE_INSERT = tl.constexpr(ERR_DOUBLE_INSERT)
_D_ERR_BAD_BLOCK = tl.constexpr(ERR_BAD_BLOCK)
_D_SEQ_NONE = tl.constexpr((1 << 63) - 1)  # no sequence number: larger than any

#: Entries per program of the per-entry kernels (probing lanes), and lanes per
#: step of the insert's one-program prefix sum (``toolkit``: why these sizes).
_TILE = PROBE_TILE
_PREP_TILE = SCAN_TILE

# Home-slot mix (host and device must agree): odd multiplier for the group.
_GROUP_MUL = 0x9E3779B97F4A7C15
_D_GROUP_MUL = tl.constexpr(_GROUP_MUL)
_M64 = (1 << 64) - 1

Device = torch.device | str


# --------------------------------------------------------------------------
# Device helpers
# --------------------------------------------------------------------------


@triton.jit
def rotl64(x, B: tl.constexpr):
    """Rotate the uint64 ``x`` left by the constant ``B`` (0 < B < 64): slot mixing."""
    return (x << B) | (x >> (64 - B))


@triton.jit
def _home(lo, hi, group, cap):
    """Home slot (int32) of keys (int64 lo, int64 hi, int32 group)."""
    h = to_u64(lo) ^ rotl64(to_u64(hi), 29)
    h = h ^ (to_u64(group.to(tl.int64)) * _D_GROUP_MUL)
    h = h ^ (h >> 32)
    return (h & (cap - 1)).to(tl.int32)


@triton.jit
def _claim_slots(slot_block_ptr, slot, blk, want, cap):
    """Claim one free slot per wanting lane, probing linearly from ``slot``.

    A lane reads its slot (a plain load: a hint), and if it looks free
    (EMPTY/TOMBSTONE) tries ``atomic_cas(slot, seen, blk)``; it owns the slot
    when the CAS returns what it saw. A failed CAS means another lane took the
    slot in this launch (slots only go free -> taken during an insert), so it
    moves on. Gives up after ``cap`` probes.
    Returns ``(slot, won, from_tombstone, failed)``.
    """
    won = false_like(want)
    from_tomb = won
    n = 0
    todo = tl.sum(want.to(tl.int32), 0)
    while todo > 0:
        seen = tl.load(slot_block_ptr + slot, mask=want, other=0)
        free = want & (seen < 0)
        old = tl.atomic_cas(slot_block_ptr + slot, tl.where(free, seen, _D_NEVER), blk)
        got = free & (old == seen)
        won = won | got
        from_tomb = from_tomb | (got & (seen == _D_TOMBSTONE))
        want = want & (~got)
        slot = tl.where(want, (slot + 1) & (cap - 1), slot)
        n += 1
        todo = tl.where(n < cap, tl.sum(want.to(tl.int32), 0), 0)
    return slot, won, from_tomb, want


@triton.jit
def _place(slot_lo_ptr, slot_hi_ptr, slot_group_ptr, slot_block_ptr, block_slot_ptr,
           lo, hi, g, blk, want, cap, TILE: tl.constexpr):
    """Claim a slot for each wanting lane's block from its key's home slot,
    then write the key (read only by later launches) and the block's slot
    (NO_SLOT where no slot was found). Returns ``_claim_slots``'s tuple."""
    slot, won, from_tomb, failed = _claim_slots(slot_block_ptr, _home(lo, hi, g, cap), blk, want, cap)
    tl.store(slot_lo_ptr + slot, lo, mask=won)
    tl.store(slot_hi_ptr + slot, hi, mask=won)
    tl.store(slot_group_ptr + slot, g, mask=won)
    tl.store(block_slot_ptr + blk, slot, mask=won)
    tl.store(block_slot_ptr + blk, tl.full([TILE], _D_NO_SLOT, tl.int32), mask=failed)
    return slot, won, from_tomb, failed


# --------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------


# Arguments that change from step to step (counts, stamps, widths) are
# ``do_not_specialize``: Triton would otherwise compile a variant per value
# class (== 1, divisible by 16) they fall in, a compile stall inside a step
# on a GPU (``tests/kernels/test_compile.py`` bounds the variants). ``cap``
# and ``N`` too: the manager sizes a scratch table per step.
@triton.jit(do_not_specialize=["K"])
def _insert_seq_kernel(
    valid_ptr,                # bool/int32[K] entry i is inserted where != 0 (HAS_VALID; else unread)
    seq_ptr,                  # int64[>= K] out: each entry's sequence number
    counters_ptr,             # int64[NUM_COUNTERS] the table's counters (NEXT_SEQ advanced)
    K,                        # entries
    HAS_VALID: tl.constexpr,  # whether valid_ptr is read (else every entry is valid)
    TILE: tl.constexpr,       # entries per step of the prefix sum (a power of two)
):
    """One program: seq[i] = NEXT_SEQ + #valid entries before i; NEXT_SEQ += #valid.
    A prefix sum over the batch (``K / TILE`` iterations), sequential because
    the batch order must become the insertion order."""
    base = tl.load(counters_ptr + _D_NEXT_SEQ)
    for start in range(0, K, TILE):
        offs = start + tl.arange(0, TILE)
        m = offs < K
        if HAS_VALID:
            v = (tl.load(valid_ptr + offs, mask=m, other=0) != 0) & m
        else:
            v = m
        v64 = v.to(tl.int64)
        incl = tl.cumsum(v64, 0)
        tl.store(seq_ptr + offs, base + incl - v64, mask=m)
        base = base + tl.sum(v64, 0)
    tl.store(counters_ptr + _D_NEXT_SEQ, base)


@triton.jit
def _insert_lanes(block_ptr, valid_ptr, perm_ptr, K, N, HAS_VALID: tl.constexpr, HAS_PERM: tl.constexpr,
                  TILE: tl.constexpr):
    """This program's lanes of an insert: the entry each handles (``perm``'s
    with HAS_PERM), its block (0 where it is not inserted), whether it is to
    be inserted, and whether its block id is out of range."""
    lane = tl.program_id(0) * TILE + tl.arange(0, TILE)
    m = lane < K
    if HAS_PERM:
        idx = tl.load(perm_ptr + lane, mask=m, other=0)
    else:
        idx = lane
    blk = tl.load(block_ptr + idx, mask=m, other=0)
    if HAS_VALID:
        v = m & (tl.load(valid_ptr + idx, mask=m, other=0) != 0)
    else:
        v = m
    in_range = (blk >= 0) & (blk < N)
    want = v & in_range
    return idx, tl.where(want, blk, 0), want, v & (~in_range)


@triton.jit
def _count_inserts(counters_ptr, won, from_tomb, failed, dup, bad):
    """LIVE, TOMBSTONES and the error bits (``ERR_FULL``, ``ERR_DOUBLE_INSERT``,
    ``ERR_BAD_BLOCK``) updated atomically for one program's lanes."""
    n_won = tl.sum(won.to(tl.int64), 0)
    n_tomb = tl.sum(from_tomb.to(tl.int64), 0)
    tl.atomic_add(counters_ptr + _D_LIVE, n_won, mask=n_won > 0)
    tl.atomic_add(counters_ptr + _D_TOMBSTONES, -n_tomb, mask=n_tomb > 0)
    err = (tl.max(failed.to(tl.int64), 0) * _D_ERR_FULL
           | tl.max(dup.to(tl.int64), 0) * _D_ERR_DOUBLE_INSERT
           | tl.max(bad.to(tl.int64), 0) * _D_ERR_BAD_BLOCK)
    tl.atomic_or(counters_ptr + _D_ERRORS, err, mask=err != 0)


@triton.jit(do_not_specialize=["K", "cap", "N"])
def _insert_kernel(
    slot_lo_ptr, slot_hi_ptr,  # int64[cap] the slots' key lanes (written where a slot is claimed)
    slot_group_ptr,            # int32[cap] the slots' groups (likewise)
    slot_block_ptr,            # int32[cap] the slots' blocks, EMPTY or TOMBSTONE (claimed by atomic_cas)
    block_slot_ptr,            # int32[N] each block's slot or NO_SLOT (claimed: NO_SLOT -> CLAIMING -> slot)
    block_seq_ptr,             # int64[N] each block's sequence number (written for the inserted)
    counters_ptr,              # int64[NUM_COUNTERS] the counters (LIVE, TOMBSTONES, ERRORS updated)
    lo_ptr, hi_ptr,            # int64[K] the entries' key lanes, strided:
    s_lo, s_hi,                # ... entry i's at lo_ptr + i * s_lo, hi_ptr + i * s_hi
    group_ptr,                 # int32[K] the entries' groups
    block_ptr,                 # int32[K] the blocks to cache (outside 0..N-1: ERR_BAD_BLOCK)
    valid_ptr,                 # bool/int32[K] entry i is inserted where != 0 (HAS_VALID; else unread)
    seq_ptr,                   # int64[K] each entry's sequence number (``_insert_seq_kernel``'s)
    perm_ptr,                  # int32[K] lane j handles entry perm[j] (HAS_PERM, tests only; else unread)
    K,                         # entries
    cap,                       # slots (a power of two)
    N,                         # blocks in the pool (ids 0..N-1)
    HAS_VALID: tl.constexpr,   # whether valid_ptr is read
    HAS_PERM: tl.constexpr,    # whether perm_ptr is read
    TILE: tl.constexpr,        # entries per program (a power of two)
):
    idx, blk, want, bad = _insert_lanes(block_ptr, valid_ptr, perm_ptr, K, N, HAS_VALID, HAS_PERM, TILE)
    i64 = idx.to(tl.int64)
    # Claim the block itself: NO_SLOT -> CLAIMING. Catches a block that is
    # already cached, or given twice in this batch (only one claimant wins).
    old = tl.atomic_cas(block_slot_ptr + blk, tl.where(want, _D_NO_SLOT, _D_NEVER),
                        tl.full([TILE], _D_CLAIMING, tl.int32))
    dup = want & (old != _D_NO_SLOT)
    want = want & (old == _D_NO_SLOT)

    lo = tl.load(lo_ptr + i64 * s_lo, mask=want, other=0)
    hi = tl.load(hi_ptr + i64 * s_hi, mask=want, other=0)
    g = tl.load(group_ptr + idx, mask=want, other=0)
    seq = tl.load(seq_ptr + idx, mask=want, other=0)

    slot, won, from_tomb, failed = _place(slot_lo_ptr, slot_hi_ptr, slot_group_ptr, slot_block_ptr, block_slot_ptr,
                                          lo, hi, g, blk, want, cap, TILE)
    tl.store(block_seq_ptr + blk, seq, mask=won)
    _count_inserts(counters_ptr, won, from_tomb, failed, dup, bad)


@triton.jit
def probe_oldest(slot_lo_ptr, slot_hi_ptr, slot_group_ptr, slot_block_ptr, block_seq_ptr, lo, hi, g, active, cap):
    """Per active lane, the oldest live block cached under key (``lo``, ``hi``,
    ``g``), -1 if none: probes linearly from the key's home slot to the first
    EMPTY slot (at most ``cap`` probes). Shared by ``_find_kernel`` and the
    admission's lookup (``gpukv.kernels.prefill``)."""
    slot = _home(lo, hi, g, cap)
    best_blk = full_like(active, -1)  # int32 lanes: no block
    best_seq = full_like(active, _D_SEQ_NONE).to(tl.int64)
    n = 0
    todo = tl.sum(active.to(tl.int32), 0)
    while todo > 0:
        b = tl.load(slot_block_ptr + slot, mask=active, other=_D_EMPTY)
        live = active & (b >= 0)
        match = live & (tl.load(slot_lo_ptr + slot, mask=live, other=0) == lo)
        match = match & (tl.load(slot_hi_ptr + slot, mask=match, other=0) == hi)
        match = match & (tl.load(slot_group_ptr + slot, mask=match, other=0) == g)
        seq = tl.load(block_seq_ptr + tl.where(match, b, 0), mask=match, other=_D_SEQ_NONE)
        better = match & (seq < best_seq)
        best_seq = tl.where(better, seq, best_seq)
        best_blk = tl.where(better, b, best_blk)
        active = active & (b != _D_EMPTY)
        slot = (slot + 1) & (cap - 1)
        n += 1
        # stop after cap probes: no EMPTY slot at all, every slot has been seen
        todo = tl.where(n < cap, tl.sum(active.to(tl.int32), 0), 0)
    return best_blk


@triton.jit(do_not_specialize=["K", "cap"])
def _find_kernel(
    slot_lo_ptr, slot_hi_ptr,  # int64[cap] the slots' key lanes
    slot_group_ptr,            # int32[cap] the slots' groups
    slot_block_ptr,            # int32[cap] the slots' blocks, EMPTY or TOMBSTONE
    block_seq_ptr,             # int64[N] each block's sequence number (the oldest wins)
    lo_ptr, hi_ptr,            # int64[K] the queries' key lanes, strided:
    s_lo, s_hi,                # ... query i's at lo_ptr + i * s_lo, hi_ptr + i * s_hi
    group_ptr,                 # int32[K] the queries' groups
    valid_ptr,                 # bool/int32[K] query i is asked where != 0 (HAS_VALID; else unread)
    out_ptr,                   # int32[K] out: the oldest live block under the key, or -1
    K,                         # queries
    cap,                       # slots (a power of two)
    HAS_VALID: tl.constexpr,   # whether valid_ptr is read
    TILE: tl.constexpr,        # queries per program (a power of two)
):
    pid = tl.program_id(0)
    offs = pid * TILE + tl.arange(0, TILE)
    m = offs < K
    o64 = offs.to(tl.int64)
    if HAS_VALID:
        active = m & (tl.load(valid_ptr + offs, mask=m, other=0) != 0)
    else:
        active = m
    lo = tl.load(lo_ptr + o64 * s_lo, mask=active, other=0)
    hi = tl.load(hi_ptr + o64 * s_hi, mask=active, other=0)
    g = tl.load(group_ptr + offs, mask=active, other=0)
    best_blk = probe_oldest(slot_lo_ptr, slot_hi_ptr, slot_group_ptr, slot_block_ptr, block_seq_ptr, lo, hi, g,
                            active, cap)
    tl.store(out_ptr + offs, best_blk, mask=m)


@triton.jit
def erase_blocks(slot_block_ptr, block_slot_ptr, counters_ptr, erased_ptr, blk, v, cap, N,
                 COUNT_ERASED: tl.constexpr):
    """Remove the table entries of a tile of blocks ``blk`` where ``v``
    (distinct blocks across the whole launch): a block that is not cached
    is skipped, a negative id too (padding), an id ``>= N`` sets
    ``ERR_BAD_BLOCK``. Updates LIVE and TOMBSTONES (and ``erased_ptr``, an
    int64[1], by the entries removed, with ``COUNT_ERASED``) atomically, so
    any number of programs may erase at once, in any order. Shared by
    ``_erase_kernel`` and the allocation's place (``blocks._place_kernel``),
    which erases each block it places."""
    bad = v & (blk >= N)
    want = v & (blk >= 0) & (blk < N)
    slot = tl.load(block_slot_ptr + blk, mask=want, other=_D_NO_SLOT)
    want = want & (slot >= 0)
    # A slot followed by an EMPTY one ends every probe that reaches it, so it
    # can become EMPTY itself instead of a tombstone. Concurrent erases of
    # neighbours stay correct: the next slot is read either before (a block or
    # a tombstone -> we leave a tombstone) or after it became EMPTY (which it
    # did only because the slot after it was EMPTY), both a sequential order.
    nxt = tl.load(slot_block_ptr + ((slot + 1) & (cap - 1)), mask=want, other=0)
    to_empty = nxt == _D_EMPTY
    tl.store(slot_block_ptr + slot, tl.where(to_empty, _D_EMPTY, _D_TOMBSTONE), mask=want)
    tl.store(block_slot_ptr + blk, tl.full(blk.shape, _D_NO_SLOT, tl.int32), mask=want)
    n_gone = tl.sum(want.to(tl.int64), 0)
    n_tomb = tl.sum((want & (~to_empty)).to(tl.int64), 0)
    tl.atomic_add(counters_ptr + _D_LIVE, -n_gone, mask=n_gone > 0)
    tl.atomic_add(counters_ptr + _D_TOMBSTONES, n_tomb, mask=n_tomb > 0)
    if COUNT_ERASED:  # allocation's evictions: the popped blocks that were cached
        tl.atomic_add(erased_ptr, n_gone, mask=n_gone > 0)
    err = tl.max(bad.to(tl.int64), 0) * _D_ERR_BAD_BLOCK
    tl.atomic_or(counters_ptr + _D_ERRORS, err, mask=err != 0)


@triton.jit(do_not_specialize=["K", "cap", "N"])
def _erase_kernel(
    slot_block_ptr,              # int32[cap] the slots' blocks (written: EMPTY or TOMBSTONE where erased)
    block_slot_ptr,              # int32[N] each block's slot or NO_SLOT (written: NO_SLOT where erased)
    counters_ptr,                # int64[NUM_COUNTERS] the counters (LIVE, TOMBSTONES, ERRORS updated)
    block_ptr,                   # int32[K] blocks to erase (< 0: padding; >= N: ERR_BAD_BLOCK)
    valid_ptr,                   # bool/int32[K] entry i counts where != 0 (HAS_VALID; else unread)
    erased_ptr,                  # int64[1] increased by the entries erased (COUNT_ERASED; else unread)
    K,                           # entries
    cap,                         # slots (a power of two)
    N,                           # blocks in the pool (ids 0..N-1)
    HAS_VALID: tl.constexpr,     # whether valid_ptr is read
    COUNT_ERASED: tl.constexpr,  # whether erased_ptr is written
    TILE: tl.constexpr,          # entries per program (a power of two)
):
    pid = tl.program_id(0)
    offs = pid * TILE + tl.arange(0, TILE)
    m = offs < K
    blk = tl.load(block_ptr + offs, mask=m, other=0)
    if HAS_VALID:
        v = m & (tl.load(valid_ptr + offs, mask=m, other=0) != 0)
    else:
        v = m
    erase_blocks(slot_block_ptr, block_slot_ptr, counters_ptr, erased_ptr, blk, v, cap, N, COUNT_ERASED)


@triton.jit
def _clear_kernel(
    slot_block_ptr,       # int32[cap] out: EMPTY everywhere
    block_slot_ptr,       # int32[N] out: NO_SLOT everywhere
    counters_ptr,         # int64[NUM_COUNTERS] the counters (LIVE and TOMBSTONES zeroed)
    cap,                  # slots
    N,                    # blocks in the pool
    TILE: tl.constexpr,   # slots (and blocks) per program (a power of two)
):
    pid = tl.program_id(0)
    offs = pid * TILE + tl.arange(0, TILE)
    tl.store(slot_block_ptr + offs, tl.full([TILE], _D_EMPTY, tl.int32), mask=offs < cap)
    tl.store(block_slot_ptr + offs, tl.full([TILE], _D_NO_SLOT, tl.int32), mask=offs < N)
    if pid == 0:
        tl.store(counters_ptr + _D_LIVE, 0)
        tl.store(counters_ptr + _D_TOMBSTONES, 0)


@triton.jit
def _rebuild_gather_kernel(
    slot_lo_ptr, slot_hi_ptr,         # int64[cap] the slots' key lanes (read through block_slot)
    slot_group_ptr,                   # int32[cap] the slots' groups (likewise)
    slot_block_ptr,                   # int32[cap] the slots' blocks (out, when rebuilding: EMPTY everywhere)
    block_slot_ptr,                   # int32[N] each block's slot or NO_SLOT
    scratch_lo_ptr, scratch_hi_ptr,   # int64[N] out: each cached block's key lanes
    scratch_group_ptr,                # int32[N] out: ... and group
    counters_ptr,                     # int64[NUM_COUNTERS] the counters (TOMBSTONES read)
    flag_ptr,                         # int32[1] out: 1 when rebuilding (for phase 2)
    threshold,                        # rebuild when TOMBSTONES > threshold (-1: always)
    cap,                              # slots
    N,                                # blocks in the pool
    TILE: tl.constexpr,               # slots or blocks per program and step (a power of two)
):
    """Phase 1: decide (TOMBSTONES > threshold), copy each cached block's key
    to per-block scratch, and wipe ``slot_block`` to EMPTY. Nothing here reads
    what this launch writes (keys are read through ``block_slot``)."""
    pid = tl.program_id(0)
    go = tl.load(counters_ptr + _D_TOMBSTONES) > threshold
    if pid == 0:
        tl.store(flag_ptr, go.to(tl.int32))
    if go:  # a fixed number of programs, each striding over the tiles
        for tile in range(pid, tl.cdiv(tl.maximum(cap, N), TILE), tl.num_programs(0)):
            offs = tile * TILE + tl.arange(0, TILE)
            mb = offs < N
            slot = tl.load(block_slot_ptr + offs, mask=mb, other=_D_NO_SLOT)
            cached = mb & (slot >= 0)
            tl.store(scratch_lo_ptr + offs, tl.load(slot_lo_ptr + slot, mask=cached, other=0), mask=cached)
            tl.store(scratch_hi_ptr + offs, tl.load(slot_hi_ptr + slot, mask=cached, other=0), mask=cached)
            tl.store(scratch_group_ptr + offs, tl.load(slot_group_ptr + slot, mask=cached, other=0), mask=cached)
            tl.store(slot_block_ptr + offs, tl.full([TILE], _D_EMPTY, tl.int32), mask=offs < cap)


@triton.jit
def _rebuild_place_kernel(
    slot_lo_ptr, slot_hi_ptr,         # int64[cap] the slots' key lanes (written for the placed)
    slot_group_ptr,                   # int32[cap] the slots' groups (likewise)
    slot_block_ptr,                   # int32[cap] the slots' blocks (claimed by atomic_cas)
    block_slot_ptr,                   # int32[N] each block's slot or NO_SLOT (its new slot)
    scratch_lo_ptr, scratch_hi_ptr,   # int64[N] each cached block's key lanes (phase 1's)
    scratch_group_ptr,                # int32[N] ... and group
    counters_ptr,                     # int64[NUM_COUNTERS] the counters (TOMBSTONES zeroed; LIVE, ERRORS on failure)
    flag_ptr,                         # int32[1] phase 1's decision
    cap,                              # slots (a power of two)
    N,                                # blocks in the pool
    TILE: tl.constexpr,               # blocks per program and step (a power of two)
):
    """Phase 2 (when phase 1 decided to): re-insert every cached block into the
    wiped slot array. Sequence numbers are untouched, so the order is kept."""
    pid = tl.program_id(0)
    go = tl.load(flag_ptr) != 0
    if go:  # a fixed number of programs, each striding over the tiles
        for tile in range(pid, tl.cdiv(N, TILE), tl.num_programs(0)):
            offs = tile * TILE + tl.arange(0, TILE)
            mb = offs < N
            old_slot = tl.load(block_slot_ptr + offs, mask=mb, other=_D_NO_SLOT)
            want = mb & (old_slot >= 0)
            lo = tl.load(scratch_lo_ptr + offs, mask=want, other=0)
            hi = tl.load(scratch_hi_ptr + offs, mask=want, other=0)
            g = tl.load(scratch_group_ptr + offs, mask=want, other=0)
            blk = offs.to(tl.int32)
            # (failing cannot happen while live <= cap; kept so a bug shows up as a flag)
            slot, won, from_tomb, failed = _place(slot_lo_ptr, slot_hi_ptr, slot_group_ptr, slot_block_ptr,
                                                  block_slot_ptr, lo, hi, g, blk, want, cap, TILE)
            n_failed = tl.sum(failed.to(tl.int64), 0)
            tl.atomic_add(counters_ptr + _D_LIVE, -n_failed, mask=n_failed > 0)
            tl.atomic_or(counters_ptr + _D_ERRORS, _D_ERR_FULL, mask=n_failed > 0)
        if pid == 0:
            tl.store(counters_ptr + _D_TOMBSTONES, 0)


# --------------------------------------------------------------------------
# The table
# --------------------------------------------------------------------------


def _signed64(x: int) -> int:
    x &= _M64
    return x - (1 << 64) if x >> 63 else x


def home_slot(lo: int, hi: int, group: int, capacity: int) -> int:
    """Host copy of the device home-slot function (for tests and invariants)."""
    lo &= _M64
    hi &= _M64
    h = lo ^ (((hi << 29) | (hi >> 35)) & _M64)
    h ^= ((group & _M64) * _GROUP_MUL) & _M64
    h ^= h >> 32
    return h & (capacity - 1)


@dataclass
class HashTable:
    """Device state of the block-hash table (see the module docstring)."""

    num_blocks: int
    capacity: int
    slot_lo: torch.Tensor
    slot_hi: torch.Tensor
    slot_group: torch.Tensor
    slot_block: torch.Tensor
    block_slot: torch.Tensor
    block_seq: torch.Tensor
    counters: torch.Tensor
    scratch_lo: torch.Tensor
    scratch_hi: torch.Tensor
    scratch_group: torch.Tensor
    rebuild_flag: torch.Tensor

    @classmethod
    def create(cls, num_blocks: int, device: Device | None = None, *,
               capacity: int | None = None) -> HashTable:
        """An empty table for blocks ``0..num_blocks-1``.

        ``capacity`` defaults to the smallest power of two >= 2 * num_blocks.
        A smaller power of two is accepted (tests of the full-table flag);
        inserts may then fail with ``ERR_FULL``. ``num_blocks`` has the one
        limit of every pool structure (``toolkit.check_num_blocks``, which
        says why the capacity is at most 2**30).
        """
        num_blocks = check_num_blocks(num_blocks)
        if capacity is None:
            capacity = pow2_at_least(2 * num_blocks)
        if (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1
                or capacity & (capacity - 1) or capacity > 2 ** 30):
            raise ValueError(f"capacity must be a power of two in [1, 2**30], got {capacity!r}")
        device = _runtime.default_device() if device is None else torch.device(device)
        check_device(device)
        i32: dict[str, Any] = dict(dtype=torch.int32, device=device)
        i64: dict[str, Any] = dict(dtype=torch.int64, device=device)
        return cls(
            num_blocks=num_blocks,
            capacity=capacity,
            slot_lo=torch.zeros(capacity, **i64),
            slot_hi=torch.zeros(capacity, **i64),
            slot_group=torch.zeros(capacity, **i32),
            slot_block=torch.full((capacity,), EMPTY, **i32),
            block_slot=torch.full((num_blocks,), NO_SLOT, **i32),
            block_seq=torch.zeros(num_blocks, **i64),
            counters=torch.zeros(NUM_COUNTERS, **i64),
            scratch_lo=torch.zeros(num_blocks, **i64),
            scratch_hi=torch.zeros(num_blocks, **i64),
            scratch_group=torch.zeros(num_blocks, **i32),
            rebuild_flag=torch.zeros(1, **i32),
        )

    @property
    def device(self) -> torch.device:
        return self.slot_block.device

    # ------------------------------------------------ host helpers (they sync)
    def read_counters(self) -> dict:
        """One device-to-host read: live, tombstones, next_seq, errors."""
        values = self.counters.cpu().tolist()
        return {name: int(values[i]) for name, i in COUNTER_SLOTS.items()}

    def entries(self) -> dict:
        """``{(lo, hi, group): [block, ...]}``, each list oldest first."""
        sb = self.slot_block.cpu().tolist()
        lo = self.slot_lo.cpu().tolist()
        hi = self.slot_hi.cpu().tolist()
        grp = self.slot_group.cpu().tolist()
        seq = self.block_seq.cpu().tolist()
        out: dict = {}
        for s, b in enumerate(sb):
            if b >= 0:
                out.setdefault((lo[s], hi[s], grp[s]), []).append((seq[b], b))
        return {k: [b for _, b in sorted(v)] for k, v in out.items()}

    def check_invariants(self) -> None:
        """Assert the table's structural invariants (syncs; tests only)."""
        cap, N = self.capacity, self.num_blocks
        sb = self.slot_block.cpu().tolist()
        lo = self.slot_lo.cpu().tolist()
        hi = self.slot_hi.cpu().tolist()
        grp = self.slot_group.cpu().tolist()
        bslot = self.block_slot.cpu().tolist()
        seq = self.block_seq.cpu().tolist()
        c = self.read_counters()
        # run[s]: number of consecutive non-EMPTY slots ending at s (cyclic)
        run = [0] * cap
        if EMPTY in sb:
            start = sb.index(EMPTY)
            n = 0
            for i in range(1, cap + 1):
                s = (start + i) & (cap - 1)
                n = 0 if sb[s] == EMPTY else n + 1
                run[s] = n
        else:
            run = [cap] * cap
        live = tomb = 0
        seen_blocks: dict = {}
        for s, b in enumerate(sb):
            assert b in (EMPTY, TOMBSTONE) or 0 <= b < N, f"slot {s} holds {b}"
            if b == TOMBSTONE:
                tomb += 1
            elif b >= 0:
                live += 1
                assert b not in seen_blocks, f"block {b} in slots {seen_blocks[b]} and {s}"
                seen_blocks[b] = s
                assert bslot[b] == s, f"slot {s} holds block {b} but block_slot[{b}] = {bslot[b]}"
                # reachable: no EMPTY slot from the home slot up to this one
                dist = (s - home_slot(lo[s], hi[s], grp[s], cap)) & (cap - 1)
                assert dist < run[s], (
                    f"block {b} at slot {s} unreachable: an EMPTY slot lies on its probe path")
        for b, s in enumerate(bslot):
            assert s == NO_SLOT or (0 <= s < cap and sb[s] == b), (
                f"block_slot[{b}] = {s} but that slot holds {sb[s] if 0 <= s < cap else None}")
        assert c["live"] == live, f"live counter {c['live']} != {live} slots holding blocks"
        assert c["tombstones"] == tomb, f"tombstone counter {c['tombstones']} != {tomb}"
        seqs = [seq[b] for b in seen_blocks]
        assert len(set(seqs)) == len(seqs), "two cached blocks share a sequence number"
        assert all(0 <= q < c["next_seq"] for q in seqs), "a sequence number >= next_seq"


# --------------------------------------------------------------------------
# Host launchers
# --------------------------------------------------------------------------


def _keys(table: HashTable, lo, hi, group):
    """The keys' tensors, checked: ``lo``/``hi`` int64[K] (any stride: the
    kernels take it), ``group`` int32[K] (an int for all), contiguous."""
    dev = table.device
    lo = check_tensor(lo, "lo", dtypes=INT64, shape=(None,), device=dev)
    K = lo.shape[0]
    hi = check_tensor(hi, "hi", dtypes=INT64, shape=(K,), device=dev)
    if isinstance(group, int) and not isinstance(group, bool):
        group = torch.full((K,), group, dtype=torch.int32, device=dev)
    group = check_tensor(group, "group", dtypes=INT32, shape=(K,), device=dev).contiguous()
    return K, lo, hi, group


def _valid(valid, K: int, dev: torch.device):
    """An optional bool/int32[K] mask, checked and contiguous (None stays None)."""
    if valid is None:
        return None
    return check_tensor(valid, "valid", dtypes=(torch.bool, torch.int32), shape=(K,), device=dev).contiguous()


def insert(table: HashTable, lo: torch.Tensor, hi: torch.Tensor,
           group: torch.Tensor | int, block: torch.Tensor,
           valid: torch.Tensor | None = None, *, tile: int = _TILE, seq: torch.Tensor | None = None,
           _lane_perm: torch.Tensor | None = None) -> None:
    """Cache ``block[i]`` under key ``(lo[i], hi[i], group[i])`` for each valid i.

    ``lo``/``hi`` int64[K] (strided views such as ``digests[:, 0]`` are fine),
    ``group`` int32[K] or an int for all, ``block`` int32[K], ``valid``
    bool/int32[K] or None (all valid). Valid entries join their keys' lists in
    batch order (after everything cached before). A block that is already
    cached (or appears twice) is dropped and sets ``ERR_DOUBLE_INSERT``; an id
    outside ``0..N-1`` sets ``ERR_BAD_BLOCK``. Two launches, no host sync.
    ``seq`` (int64[>= K], optional) is scratch for the sequence numbers.
    ``_lane_perm`` (int32[K], a permutation; tests only) makes lane j handle
    entry ``_lane_perm[j]``, to simulate another thread schedule under the
    interpreter: the result must not change.
    """
    K, lo, hi, group = _keys(table, lo, hi, group)
    dev = table.device
    block = check_tensor(block, "block", dtypes=INT32, shape=(K,), device=dev).contiguous()
    valid = _valid(valid, K, dev)
    if _lane_perm is not None:
        _lane_perm = check_tensor(_lane_perm, "_lane_perm", dtypes=INT32, shape=(K,), device=dev).contiguous()
    check_tile(tile)
    if K == 0:
        return
    if seq is None:  # scratch: each entry's sequence number
        seq = torch.empty(K, dtype=torch.int64, device=dev)
    vptr = valid if valid is not None else block  # placeholder, never read
    _insert_seq_kernel[(1,)](vptr, seq, table.counters, K,
                             HAS_VALID=valid is not None, TILE=_PREP_TILE)
    _insert_kernel[(triton.cdiv(K, tile),)](
        table.slot_lo, table.slot_hi, table.slot_group, table.slot_block,
        table.block_slot, table.block_seq, table.counters,
        lo, hi, lo.stride(0), hi.stride(0), group, block, vptr, seq,
        _lane_perm if _lane_perm is not None else block,
        K, table.capacity, table.num_blocks,
        HAS_VALID=valid is not None, HAS_PERM=_lane_perm is not None, TILE=tile,
    )


def find_oldest(table: HashTable, lo: torch.Tensor, hi: torch.Tensor,
                group: torch.Tensor | int, valid: torch.Tensor | None = None,
                out: torch.Tensor | None = None, *, tile: int = _TILE) -> torch.Tensor:
    """For each query, the oldest live block cached under its key; -1 if none
    or the query is invalid. Returns int32[K] (``out`` when given). One launch,
    parallel across queries; a query probes from its home slot to the first
    EMPTY slot."""
    K, lo, hi, group = _keys(table, lo, hi, group)
    dev = table.device
    valid = _valid(valid, K, dev)
    if out is None:
        out = torch.empty(K, dtype=torch.int32, device=dev)
    else:
        check_tensor(out, "out", dtypes=INT32, shape=(K,), device=dev, contiguous=True)
    check_tile(tile)
    if K == 0:
        return out
    _find_kernel[(triton.cdiv(K, tile),)](
        table.slot_lo, table.slot_hi, table.slot_group, table.slot_block,
        table.block_seq, lo, hi, lo.stride(0), hi.stride(0), group,
        valid if valid is not None else group, out, K, table.capacity,
        HAS_VALID=valid is not None, TILE=tile,
    )
    return out


def erase(table: HashTable, block: torch.Tensor, valid: torch.Tensor | None = None,
          *, erased: torch.Tensor | None = None, tile: int = _TILE) -> None:
    """Remove the given blocks' entries (int32[K], distinct within one call);
    a block that is not cached is ignored, a negative id is padding (skipped),
    an id ``>= N`` sets ``ERR_BAD_BLOCK``. ``erased`` (int64[1], optional)
    is increased by the number of entries removed. One launch."""
    dev = table.device
    block = check_tensor(block, "block", dtypes=INT32, shape=(None,), device=dev).contiguous()
    K = block.shape[0]
    valid = _valid(valid, K, dev)
    if erased is not None:
        erased = check_tensor(erased, "erased", dtypes=INT64, shape=(1,), device=dev)
    if K == 0:
        return
    _erase_kernel[(triton.cdiv(K, tile),)](
        table.slot_block, table.block_slot, table.counters, block,
        valid if valid is not None else block, erased if erased is not None else table.counters,
        K, table.capacity, table.num_blocks,
        HAS_VALID=valid is not None, COUNT_ERASED=erased is not None, TILE=tile,
    )


def clear(table: HashTable) -> None:
    """Drop every entry (``reset_prefix_cache``). Keeps NEXT_SEQ and the error
    flags. One launch."""
    n = max(table.capacity, table.num_blocks)
    _clear_kernel[(triton.cdiv(n, _TILE),)](
        table.slot_block, table.block_slot, table.counters,
        table.capacity, table.num_blocks, TILE=_TILE,
    )


#: Programs of a rebuild launch, whatever the pool's size: when
#: ``maybe_rebuild`` finds no rebuild due its cost is this many programs
#: reading one flag (a check's cost must not grow with the pool); when one is
#: due they stride over the tiles (about one wave on an H100/H200). (The
#: manager's steps decide on the host instead: ``DevicePool.rebuild_if_due``.)
_REBUILD_PROGRAMS = 128


def _rebuild(table: HashTable, threshold: int) -> None:
    n = max(table.capacity, table.num_blocks)
    grid = (min(triton.cdiv(n, _TILE), _REBUILD_PROGRAMS),)
    common = (table.slot_lo, table.slot_hi, table.slot_group, table.slot_block,
              table.block_slot, table.scratch_lo, table.scratch_hi, table.scratch_group,
              table.counters, table.rebuild_flag)
    _rebuild_gather_kernel[grid](*common, threshold, table.capacity, table.num_blocks,
                                 TILE=_TILE)
    _rebuild_place_kernel[grid](*common, table.capacity, table.num_blocks, TILE=_TILE)


def rebuild(table: HashTable) -> None:
    """Re-insert every live entry into a wiped slot array (drops all
    tombstones). Sequence numbers are kept, so lookups and order are
    unchanged. Two launches, no host sync."""
    _rebuild(table, -1)


def maybe_rebuild(table: HashTable, min_tombstones: int | None = None) -> None:
    """``rebuild`` when the device's tombstone count exceeds ``min_tombstones``
    (default ``capacity // 4``); decided on the device, so the host reads
    nothing (both launches exit at once when not needed)."""
    if min_tombstones is None:
        min_tombstones = table.capacity // 4
    _rebuild(table, int(min_tombstones))


def clear_errors(table: HashTable) -> None:
    """Reset the error flags (after the host has read them)."""
    table.counters[ERRORS:ERRORS + 1].zero_()


from gpukv.kernels import capture  # noqa: E402

capture.count_launches(globals())
