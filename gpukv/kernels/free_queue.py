"""The free-block queue on the device: exact LRU order, O(1) removal anywhere.

The queue holds the free block ids ``1..N-1`` (block 0, the null block, is
never in it) in eviction order: the front is reused first. It is the device
twin of the reference pool's ``OrderedDict`` (``gpukv/reference/manager.py``,
``BlockPool._free``) and must always hold the same ids in the same order.

State (all on one device, sized once; see ``FreeQueue``):

* ``ring``     int32[C], C a power of two >= 2N. Absolute position ``p`` lives in
  slot ``p & (C - 1)``. Entry -1 means empty (outside the window) or a
  tombstone (inside it).
* ``pos``      int64[N]: the absolute position of block b's entry, or -1 when b
  is not in the queue (``pos[0]`` is always -1).
* ``counters`` int64[8], indices ``HEAD .. COMPACTIONS`` below:
  ``HEAD``/``TAIL``: the live window is the absolute positions ``[head, tail)``;
  ``NUM_FREE``: live entries in the window (= queue length);
  ``NUM_TOMB``: tombstones in the window (``tail - head = NUM_FREE + NUM_TOMB``);
  ``ERROR``: sticky error bits (``ERR_*``), set when a caller broke a contract;
  ``LAST_POP``: how many blocks the last ``pop`` asked for any returned (a
  pop of none, a step whose blocks did not fit, changes no counter);
  ``COMPACTIONS``: how many compactions ran (statistics);
  slot 7 is reserved.

Invariants (``FreeQueue.check_invariants`` asserts them): ``pos[b] != -1`` iff
b is in the queue, and then ``ring[pos[b] & (C-1)] == b`` with ``head <=
pos[b] < tail``; every slot outside the window is -1; ``0 < tail - head <=
C`` or empty; the counters match the ring. Positions are monotone counters that
start at ``BASE = 2**40`` (a multiple of C), so prepends never go negative;
compaction re-bases ``head`` into ``[BASE, BASE + C)``.

Operations (kernels + thin launchers; the launchers only enqueue work: no
``.item()``, no ``nonzero``, no boolean-mask indexing, no host sync):

* ``remove(fq, blocks, valid=None, count=None)``: take blocks out wherever they
  stand (a prefix-cache hit on a free block). Duplicates and blocks that are not
  in the queue are ignored; each block is claimed once by ``atomic_xchg`` on its
  ``pos``. Many programs.
* ``pop(fq, count, out)``: the first ``count`` live entries, front first, into
  ``out[:count]``; ``out[count:] = -1``. One program scanning tiles of the ring
  from ``head`` with a prefix sum per tile, until ``count`` are found. Its cost
  is amortised over the steps, not bounded per pop: the head moves past every
  tombstone it scans (they are consumed, never scanned twice), and each
  tombstone was made by one ``remove`` (a hit on a free block) of some step, so
  a run's pops scan at most ``(pops + removes) / TILE + pops`` tiles in all. One
  pop after many hits scans their tombstones at once (at most ``N`` entries).
* ``push(fq, blocks, where, call=None)``: free blocks, to the back (``where`` =
  1) or the front (2), in the order the reference ``BlockPool.free`` calls would
  leave them; every entry's final position comes from prefix sums (one
  program, two passes over the entries). Compacts first when the window would
  overflow, so it is always safe.
* ``compact(fq)`` / ``maybe_compact(fq, incoming, tomb_limit)``: order-
  preserving compaction of the window (one program), unconditional or under a
  device-side condition (the host never reads the counters).

What a caller must do: nothing for safety. ``push`` is the only operation that
grows the window and it compacts first when it must; ``pop`` and ``remove``
never grow it. ``maybe_compact(fq)`` once per step is optional housekeeping
(it bounds the tombstones a pop may have to scan). Contracts: pop at most
``num_free`` and at most ``len(out)`` blocks; push only blocks that are not in
the queue, each once; read ``counters[ERROR]`` with the step's one host read.

Every result is deterministic: races between threads only decide which lane
does a piece of work, never what the state becomes (the one exception is a
``push`` that breaks its contract by pushing the same block twice; then which
copy wins is unspecified, and ``ERR_PRESENT`` is set).
"""

from __future__ import annotations

from dataclasses import dataclass

from gpukv import _runtime  # noqa: F401  (sets TRITON_INTERPRET before triton loads)

import torch
import triton
import triton.language as tl

from gpukv.kernels.toolkit import (
    INDEX_DTYPES,
    INT32,
    INT64,
    MASK_DTYPES,
    SCAN_TILE,
    check_device,
    check_num_blocks,
    check_tensor,
    check_tile,
    max_combine,
    min_combine,
    num_warps,
    pow2_at_least,
    true_like,
    zero_like,
)

__all__ = [
    "FreeQueue",
    "remove",
    "pop",
    "push",
    "compact",
    "maybe_compact",
    "HEAD",
    "TAIL",
    "NUM_FREE",
    "NUM_TOMB",
    "ERROR",
    "LAST_POP",
    "COMPACTIONS",
    "NUM_COUNTERS",
    "COUNTER_SLOTS",
    "ERR_SHORT",
    "ERR_PRESENT",
    "ERR_BAD_BLOCK",
    "WHERE_SKIP",
    "WHERE_BACK",
    "WHERE_FRONT",
    "BASE",
    "DEFAULT_TILE",
]

# ---------------------------------------------------------------- constants
#: Counter slots (int64[8] ``FreeQueue.counters``).
HEAD: tl.constexpr = tl.constexpr(0)
TAIL: tl.constexpr = tl.constexpr(1)
NUM_FREE: tl.constexpr = tl.constexpr(2)
NUM_TOMB: tl.constexpr = tl.constexpr(3)
ERROR: tl.constexpr = tl.constexpr(4)
LAST_POP: tl.constexpr = tl.constexpr(5)
COMPACTIONS: tl.constexpr = tl.constexpr(6)
NUM_COUNTERS = 8

#: Error bits (sticky, OR-ed into ``counters[ERROR]``).
#: A pop asked for more than is free (or more than ``out`` holds), or a push
#: would overflow the ring even after compaction (only possible when the
#: caller broke the push contract); what there was got popped / nothing got
#: pushed.
ERR_SHORT: tl.constexpr = tl.constexpr(1)
#: A pushed block was already in the queue (or pushed twice in one call); that
#: entry became a tombstone and the block stayed where it was.
ERR_PRESENT: tl.constexpr = tl.constexpr(2)
#: A block id outside ``1..N-1`` was pushed, or one ``>= N`` removed; ignored.
ERR_BAD_BLOCK: tl.constexpr = tl.constexpr(4)

#: ``where`` codes of ``push``.
WHERE_SKIP = 0
WHERE_BACK = 1
WHERE_FRONT = 2
_WHERE_BACK: tl.constexpr = tl.constexpr(WHERE_BACK)
_WHERE_FRONT: tl.constexpr = tl.constexpr(WHERE_FRONT)

#: ``ring`` entry of an empty slot or a tombstone, and ``pos`` of a block that
#: is not in the queue.
_NONE: tl.constexpr = tl.constexpr(-1)
#: A compare value ``pos`` never holds (its entries are -1 or >= BASE): an
#: idle lane's ``atomic_cas`` with it changes nothing.
_NO_MATCH: tl.constexpr = tl.constexpr(-2)

#: Where absolute positions start (and where compaction re-bases them).
BASE = 1 << 40

#: Lanes per tile (power of two): ring positions per step of a scan, entries
#: per step of a push, blocks per program of a remove (``toolkit.SCAN_TILE``:
#: the queue's scans and pushes are one program).
DEFAULT_TILE = SCAN_TILE

_SHORT = int(ERR_SHORT)
_PRESENT = int(ERR_PRESENT)
_BAD = int(ERR_BAD_BLOCK)
#: Counter slot by name (host side): head, tail, num_free, num_tomb, error,
#: last_pop, compactions.
COUNTER_SLOTS = {name: int(v) for name, v in (("head", HEAD), ("tail", TAIL), ("num_free", NUM_FREE),
                                               ("num_tomb", NUM_TOMB), ("error", ERROR),
                                               ("last_pop", LAST_POP), ("compactions", COMPACTIONS))}
_IDX = COUNTER_SLOTS  # older name, kept for callers that use it


# ---------------------------------------------------------------- device helpers


@triton.jit
def _compact_window(ring_ptr, pos_ptr, head, tail, need, CMASK, base,
                    TILE: tl.constexpr):
    """Pack the live entries of ``[head, tail)`` densely from ``head``, in
    order, when ``need`` (a scalar bool); a no-op (zero loop trips) otherwise.

    Moves happen in place, front to back: an entry only moves towards the
    front, and a tile's writes stay below the next tile's reads, so a barrier
    between a tile's loads and its stores is all the ordering needed. Absolute
    positions are re-based by a multiple of C (slots do not move) so that the
    new head lies in ``[base, base + C)``. Returns ``(head, tail)`` after.
    Must run in a single program.
    """
    lanes = tl.arange(0, TILE)
    end = tl.where(need, tail, head)
    shift = (base + (head & CMASK)) - head  # a multiple of C
    n_tiles = ((end - head + TILE - 1) // TILE).to(tl.int32)
    w = head
    for t in range(0, n_tiles):
        offs = head + t * TILE + lanes
        inwin = offs < end
        e = tl.load(ring_ptr + (offs & CMASK), mask=inwin, other=_NONE)
        live = e >= 0
        li = live.to(tl.int64)
        dst = w + tl.cumsum(li, 0) - li
        tl.debug_barrier()  # every lane has read its entry before any moves
        tl.store(ring_ptr + (dst & CMASK), e, mask=live)
        tl.store(pos_ptr + e, dst + shift, mask=live)
        w += tl.sum(li, 0)
    tl.debug_barrier()
    n_clear = ((end - w + TILE - 1) // TILE).to(tl.int32)
    for t in range(0, n_clear):
        offs = w + t * TILE + lanes
        tl.store(ring_ptr + (offs & CMASK), tl.full([TILE], _NONE, tl.int32), mask=offs < end)
    tl.debug_barrier()
    new_head = tl.where(need, head + shift, head)
    new_tail = tl.where(need, w + shift, tail)
    return new_head, new_tail


# ---------------------------------------------------------------- kernels


# Arguments that change from step to step (counts, stamps, widths) are
# ``do_not_specialize``: Triton would otherwise compile a variant per value
# class (== 1, divisible by 16) they fall in, a compile stall inside a step
# on a GPU (``tests/kernels/test_compile.py`` bounds the variants).
@triton.jit(do_not_specialize=["K"])
def _remove_kernel(
    ring_ptr,                 # int32[C] the ring (written: -1 where a block is taken out)
    pos_ptr,                  # int64[N] each block's absolute position, -1 when not queued (claimed here)
    ctr_ptr,                  # int64[NUM_COUNTERS] the counters (NUM_FREE, NUM_TOMB, ERROR updated)
    blk_ptr,                  # int32[K] blocks to take out (<= 0: skipped; >= N: ERR_BAD_BLOCK)
    valid_ptr,                # uint8/int8/int32[K] entry k counts only where != 0 (HAS_VALID; else unread)
    count_ptr,                # int32/int64[1] entries k >= count are skipped (HAS_COUNT; else unread)
    K,                        # entries
    N,                        # blocks in the pool (ids 0..N-1)
    CMASK,                    # C - 1: absolute position p lives in slot p & CMASK
    HAS_VALID: tl.constexpr,  # whether valid_ptr is read
    HAS_COUNT: tl.constexpr,  # whether count_ptr is read
    TILE: tl.constexpr,       # entries per program (a power of two)
):
    pid = tl.program_id(0)
    idx = pid * TILE + tl.arange(0, TILE)
    m = idx < K
    if HAS_COUNT:
        m = m & (idx < tl.load(count_ptr))
    if HAS_VALID:
        m = m & (tl.load(valid_ptr + idx, mask=m, other=0) != 0)
    b = tl.load(blk_ptr + idx, mask=m, other=0)
    take_out_blocks(ring_ptr, pos_ptr, ctr_ptr, b, m, N, CMASK, TILE)


@triton.jit
def take_out_blocks(ring_ptr, pos_ptr, ctr_ptr, b, m, N, CMASK, TILE: tl.constexpr):
    """Take a tile of blocks ``b`` (int32[TILE]) out of the queue where ``m``:
    ids ``<= 0`` and blocks not queued are skipped, an id ``>= N`` sets
    ``ERR_BAD_BLOCK``; each block taken out leaves a tombstone. A block is
    claimed by ``atomic_xchg`` on its ``pos``, so a block listed by several
    lanes or programs is taken out once, by whichever runs first: any
    number of programs, in any order. Shared by ``_remove_kernel`` and the
    touches (``blocks.add_references``), which take out each block whose
    count they took from 0."""
    ok = m & (b > 0) & (b < N)
    bad = m & (b >= N)
    # Claim: exactly one lane (of all programs) sees a block's old position.
    old = tl.atomic_xchg(pos_ptr + tl.where(ok, b, 0),
                         tl.full([TILE], _NONE, tl.int64), mask=ok)
    got = ok & (old >= 0)
    tl.store(ring_ptr + (old & CMASK), tl.full([TILE], _NONE, tl.int32), mask=got)
    n = tl.sum(got.to(tl.int64), 0)
    tl.atomic_add(ctr_ptr + NUM_FREE, -n, mask=n > 0)
    tl.atomic_add(ctr_ptr + NUM_TOMB, n, mask=n > 0)
    n_bad = tl.sum(bad.to(tl.int64), 0)
    tl.atomic_or(ctr_ptr + ERROR, zero_like(n_bad) + ERR_BAD_BLOCK, mask=n_bad > 0)


# ``count_ptr`` is read once, as a scalar: its alignment (a fresh tensor or a
# slice of a status vector, depending on the caller) gains nothing.
@triton.jit(do_not_specialize=["M"], do_not_specialize_on_alignment=["count_ptr"])
def _pop_kernel(
    ring_ptr,             # int32[C] the ring (written: -1 over every entry consumed)
    pos_ptr,              # int64[N] blocks' positions (written: -1 for each block popped)
    ctr_ptr,              # int64[NUM_COUNTERS] the counters (HEAD, NUM_FREE, NUM_TOMB, ERROR, LAST_POP updated)
    count_ptr,            # int32/int64[1] how many blocks to pop
    out_ptr,              # int32[M] out: the popped blocks, front first, then -1
    M,                    # out's length
    CMASK,                # C - 1: absolute position p lives in slot p & CMASK
    TILE: tl.constexpr,   # ring positions per scan step (a power of two)
):
    lanes = tl.arange(0, TILE)
    head = tl.load(ctr_ptr + HEAD)
    tail = tl.load(ctr_ptr + TAIL)
    nfree = tl.load(ctr_ptr + NUM_FREE)
    ntomb = tl.load(ctr_ptr + NUM_TOMB)
    err = tl.load(ctr_ptr + ERROR)
    req = tl.load(count_ptr).to(tl.int64)
    want = tl.minimum(tl.maximum(req, 0), tl.minimum(nfree, M))
    err = tl.where(req > want, err | ERR_SHORT, err)

    found = zero_like(want)
    cur = head
    while (found < want) & (cur < tail):
        offs = cur + lanes
        inwin = offs < tail
        slot = offs & CMASK
        e = tl.load(ring_ptr + slot, mask=inwin, other=_NONE)
        live = e >= 0
        li = live.to(tl.int64)
        rank = found + tl.cumsum(li, 0) - li
        take = live & (rank < want)
        tl.store(out_ptr + rank, e, mask=take)
        tl.store(pos_ptr + e, tl.full([TILE], _NONE, tl.int64), mask=take)
        found += tl.sum(take.to(tl.int64), 0)
        last = tl.max(tl.where(take, offs, -1), 0)
        # Consume up to the last entry taken once done, else the whole tile.
        stop = tl.where(found >= want, last + 1, tl.minimum(cur + TILE, tail))
        tl.store(ring_ptr + slot, tl.full([TILE], _NONE, tl.int32), mask=inwin & (offs < stop))
        cur = stop
    err = tl.where(found < want, err | ERR_SHORT, err)  # counters disagreed with the ring

    for i in range(0, M, TILE):
        o = i + lanes
        tl.store(out_ptr + o, tl.full([TILE], _NONE, tl.int32), mask=(o >= found) & (o < M))
    tl.store(ctr_ptr + HEAD, cur)
    tl.store(ctr_ptr + NUM_FREE, nfree - found)
    tl.store(ctr_ptr + NUM_TOMB, ntomb - ((cur - head) - found))
    tl.store(ctr_ptr + ERROR, err)
    # A pop of none (a step reported as not fitting pops 0) leaves it as it
    # was: a refused step changes no state, this counter included.
    tl.store(ctr_ptr + LAST_POP, found, mask=req > 0)


@triton.jit
def _push_ranks(blk_ptr, where_ptr, call_ptr, ws_ptr, E, N, HAS_CALL: tl.constexpr, TILE: tl.constexpr):
    """Pass 1 of ``push``, front to back: front-goers before each entry (P),
    where its call starts (S = P at the call's first entry), back-goers
    before it. The workspace keeps the back rank of a back-goer and the rank
    of a front-goer within its call's front group (P - S). Returns the
    front-goers F, the back-goers B and the entries with a bad block id."""
    lanes = tl.arange(0, TILE)
    zero = tl.full([], 0, tl.int64)
    p_run = zero
    b_run = zero
    s_run = zero - 1
    n_bad = zero
    for t in range(0, tl.cdiv(E, TILE)):
        idx = t * TILE + lanes
        m = idx < E
        blk = tl.load(blk_ptr + idx, mask=m, other=0)
        wh = tl.load(where_ptr + idx, mask=m, other=0)
        goes = m & ((wh == _WHERE_BACK) | (wh == _WHERE_FRONT))
        okid = (blk > 0) & (blk < N)
        front = goes & okid & (wh == _WHERE_FRONT)
        back = goes & okid & (wh == _WHERE_BACK)
        n_bad += tl.sum((goes & ~okid).to(tl.int64), 0)
        if HAS_CALL:
            c = tl.load(call_ptr + idx, mask=m, other=0)
            cp = tl.load(call_ptr + idx - 1, mask=m & (idx > 0), other=0)
            start = m & ((idx == 0) | (c != cp))
        else:
            start = idx == 0
        fi = front.to(tl.int64)
        bi = back.to(tl.int64)
        p_ex = p_run + tl.cumsum(fi, 0) - fi
        st = tl.where(start, p_ex, -1)
        s_at = tl.maximum(tl.associative_scan(st, 0, max_combine), s_run)
        b_ex = b_run + tl.cumsum(bi, 0) - bi
        tl.store(ws_ptr + idx, tl.where(front, p_ex - s_at, b_ex), mask=m)
        p_run += tl.sum(fi, 0)
        b_run += tl.sum(bi, 0)
        s_run = tl.maximum(s_run, tl.max(st, 0))
    return p_run, b_run, n_bad


@triton.jit
def _push_place(ring_ptr, pos_ptr, blk_ptr, where_ptr, call_ptr, ws_ptr, E, N, CMASK, F, new_head, tail,
                fits_lanes, HAS_CALL: tl.constexpr, TILE: tl.constexpr):
    """Pass 2 of ``push``, back to front: P at the end of each entry's call
    (the smallest inclusive P at a call end at or after the entry); then a
    front-goer stands after the F - P(end) front-goers of later calls, from
    ``new_head``, and a back-goer at its back rank from ``tail``. Each block
    claims its ``pos`` from -1 (only where ``fits_lanes``) and is written to
    the ring; returns the entries whose block was already queued."""
    lanes = tl.arange(0, TILE)
    zero = tl.full([], 0, tl.int64)
    n_tiles = tl.cdiv(E, TILE)
    q_run = zero
    e_run = F
    n_dup = zero
    for t in range(0, n_tiles):
        idx = (n_tiles - 1 - t) * TILE + lanes
        m = idx < E
        blk = tl.load(blk_ptr + idx, mask=m, other=0)
        wh = tl.load(where_ptr + idx, mask=m, other=0)
        okid = (blk > 0) & (blk < N)
        front = m & okid & (wh == _WHERE_FRONT)
        back = m & okid & (wh == _WHERE_BACK)
        if HAS_CALL:
            c = tl.load(call_ptr + idx, mask=m, other=0)
            cn = tl.load(call_ptr + idx + 1, mask=m & (idx + 1 < E), other=0)
            last = m & ((idx == E - 1) | (c != cn))
        else:
            last = idx == E - 1
        fi = front.to(tl.int64)
        after = q_run + tl.cumsum(fi, 0, reverse=True) - fi  # front-goers after idx
        en = tl.where(last, F - after, F)  # inclusive P where a call ends
        p_end = tl.minimum(tl.associative_scan(en, 0, min_combine, reverse=True), e_run)
        r = tl.load(ws_ptr + idx, mask=m, other=0)
        dst = tl.where(front, new_head + (F - p_end) + r, tail + r)
        act = (front | back) & fits_lanes
        # Claim pos[b] from -1; idle lanes compare _NO_MATCH against pos[0] (-1), which never matches.
        old = tl.atomic_cas(pos_ptr + tl.where(act, blk, 0), tl.where(act, _NONE, _NO_MATCH).to(tl.int64), dst)
        ok = act & (old == _NONE)
        tl.store(ring_ptr + (dst & CMASK), tl.where(ok, blk, _NONE), mask=act)
        n_dup += tl.sum((act & ~ok).to(tl.int64), 0)
        q_run += tl.sum(fi, 0)
        e_run = tl.minimum(e_run, tl.min(en, 0))
    return n_dup


@triton.jit(do_not_specialize=["E"])
def _push_kernel(
    ring_ptr,                # int32[C] the ring (written: the pushed blocks at their new positions)
    pos_ptr,                 # int64[N] blocks' positions (claimed from -1 for each pushed block)
    ctr_ptr,                 # int64[NUM_COUNTERS] the counters (all but LAST_POP updated)
    blk_ptr,                 # int32[E] blocks to push, in the order a reference frees them
    where_ptr,               # int8/uint8/int32[E] WHERE_BACK, WHERE_FRONT, anything else: skipped
    call_ptr,                # int32/int64[E] call ids, a call a maximal run of equal ids (HAS_CALL; else unread)
    ws_ptr,                  # int64[>= E] scratch: each entry's rank between the two passes
    E,                       # entries
    N,                       # blocks in the pool (ids 0..N-1)
    C,                       # ring capacity (a power of two)
    CMASK,                   # C - 1: absolute position p lives in slot p & CMASK
    base,                    # BASE: where compaction re-bases head
    HAS_CALL: tl.constexpr,  # whether call_ptr is read (else the entries are one call)
    TILE: tl.constexpr,      # entries (and ring positions, compacting) per step (a power of two)
):
    """``push`` (one program): every entry's final position from prefix
    sums, so the result is deterministic whatever the lanes' schedule
    (``_push_ranks``, then ``_push_place``), after a compaction when the
    window would overflow C. A block that is already queued (a broken
    contract) keeps one copy and sets ``ERR_PRESENT``; a bad block id sets
    ``ERR_BAD_BLOCK``; a push that cannot fit even compacted (a broken
    contract) places nothing and sets ``ERR_SHORT``."""
    F, B, n_bad = _push_ranks(blk_ptr, where_ptr, call_ptr, ws_ptr, E, N, HAS_CALL, TILE)
    head = tl.load(ctr_ptr + HEAD)
    tail = tl.load(ctr_ptr + TAIL)
    nfree = tl.load(ctr_ptr + NUM_FREE)
    ntomb = tl.load(ctr_ptr + NUM_TOMB)
    err = tl.load(ctr_ptr + ERROR)
    comps = tl.load(ctr_ptr + COMPACTIONS)
    need = (tail - head) + F + B > C
    head, tail = _compact_window(ring_ptr, pos_ptr, head, tail, need, CMASK, base, TILE)
    ntomb = tl.where(need, 0, ntomb)
    comps += need.to(tl.int64)
    fits = (tail - head) + F + B <= C  # false only if the contract was broken
    overflow = (tail - head) + F + B > C
    new_head = head - F
    # A scalar bool as a lane mask (built from ints: the interpreter mistypes
    # a 0-d bool broadcast in ``&``).
    fits_lanes = (zero_like(tl.arange(0, TILE)) + fits.to(tl.int32)) != 0
    n_dup = _push_place(ring_ptr, pos_ptr, blk_ptr, where_ptr, call_ptr, ws_ptr, E, N, CMASK, F, new_head, tail,
                        fits_lanes, HAS_CALL, TILE)
    err = tl.where(n_bad > 0, err | ERR_BAD_BLOCK, err)
    err = tl.where(n_dup > 0, err | ERR_PRESENT, err)
    err = tl.where(overflow & (F + B > 0), err | ERR_SHORT, err)
    tl.store(ctr_ptr + HEAD, tl.where(overflow, head, new_head))
    tl.store(ctr_ptr + TAIL, tl.where(overflow, tail, tail + B))
    tl.store(ctr_ptr + NUM_FREE, tl.where(overflow, nfree, nfree + F + B - n_dup))
    tl.store(ctr_ptr + NUM_TOMB, ntomb + n_dup)
    tl.store(ctr_ptr + ERROR, err)
    tl.store(ctr_ptr + COMPACTIONS, comps)


@triton.jit(do_not_specialize=["incoming"])
def _compact_kernel(
    ring_ptr,             # int32[C] the ring (entries packed towards head)
    pos_ptr,              # int64[N] blocks' positions (rewritten for every entry moved)
    ctr_ptr,              # int64[NUM_COUNTERS] the counters (HEAD, TAIL, NUM_TOMB, COMPACTIONS updated)
    incoming,             # entries about to be pushed: compact when the window + incoming > C
    tomb_limit,           # ... or when there are more tombstones than this
    C,                    # ring capacity (a power of two)
    CMASK,                # C - 1: absolute position p lives in slot p & CMASK
    base,                 # BASE: where compaction re-bases head
    FORCE: tl.constexpr,  # compact whatever the counters say
    TILE: tl.constexpr,   # ring positions per step (a power of two)
):
    head = tl.load(ctr_ptr + HEAD)
    tail = tl.load(ctr_ptr + TAIL)
    ntomb = tl.load(ctr_ptr + NUM_TOMB)
    need = ((tail - head) + incoming > C) | (ntomb > tomb_limit)
    if FORCE:
        need = need | true_like(head)  # a scalar true
    head, tail = _compact_window(ring_ptr, pos_ptr, head, tail, need, CMASK, base, TILE)
    tl.store(ctr_ptr + HEAD, head)
    tl.store(ctr_ptr + TAIL, tail)
    tl.store(ctr_ptr + NUM_TOMB, tl.where(need, 0, ntomb))
    tl.atomic_add(ctr_ptr + COMPACTIONS, need.to(tl.int64))


# ---------------------------------------------------------------- the queue


@dataclass
class FreeQueue:
    """Device tensors of one free queue (layouts in the module docstring).

    ``num_blocks`` = N (ids ``0..N-1``; 0 is never queued), ``capacity`` = C.
    ``tile`` is the lanes per tile every launcher uses by default.
    """

    ring: torch.Tensor      # int32[C]
    pos: torch.Tensor       # int64[N]
    counters: torch.Tensor  # int64[8]
    num_blocks: int
    capacity: int
    tile: int = DEFAULT_TILE

    @classmethod
    def create(cls, num_blocks: int, device: torch.device | str | None = None, *,
               capacity: int | None = None, tile: int = DEFAULT_TILE) -> FreeQueue:
        """A queue holding ``1..N-1`` in order (front first). ``capacity``
        defaults to the smallest power of two >= 2N. ``num_blocks`` has the
        one limit of every pool structure (``toolkit.check_num_blocks``)."""
        n = check_num_blocks(num_blocks)
        cap = pow2_at_least(2 * n) if capacity is None else int(capacity)
        if cap < 2 * n or cap & (cap - 1):
            raise ValueError(f"capacity must be a power of two >= 2 * num_blocks = {2 * n}, got {cap}")
        if cap > BASE:
            raise ValueError(f"capacity must be <= 2**40, got {cap}")
        check_tile(tile)
        device = torch.device(device) if device is not None else _runtime.default_device()
        check_device(device)
        ring = torch.full((cap,), -1, dtype=torch.int32, device=device)
        ring[: n - 1] = torch.arange(1, n, dtype=torch.int32, device=device)
        pos = torch.full((n,), -1, dtype=torch.int64, device=device)
        pos[1:] = torch.arange(BASE, BASE + n - 1, dtype=torch.int64, device=device)
        counters = torch.zeros(NUM_COUNTERS, dtype=torch.int64, device=device)
        counters[_IDX["head"]] = BASE
        counters[_IDX["tail"]] = BASE + n - 1
        counters[_IDX["num_free"]] = n - 1
        return cls(ring, pos, counters, n, cap, int(tile))

    @property
    def device(self) -> torch.device:
        return self.ring.device

    def counter(self, name: str) -> torch.Tensor:
        """A 1-element view of one counter on the device (no host read), e.g.
        ``counter("num_free")`` for a kernel that needs the free count."""
        i = COUNTER_SLOTS[name]
        return self.counters[i:i + 1]

    # ------------------------------------------------ host helpers (sync)
    def counter_values(self) -> dict[str, int]:
        """All counters by name (reads the device: tests and diagnostics)."""
        vals = self.counters.tolist()
        return {name: vals[i] for name, i in _IDX.items()}

    def read_num_free(self) -> int:
        """The free count (reads the device: waits for the GPU)."""
        return int(self.counters[_IDX["num_free"]].item())

    def read_error_flags(self) -> int:
        """The sticky error word (reads the device: waits for the GPU)."""
        return int(self.counters[_IDX["error"]].item())

    def clear_errors(self) -> None:
        self.counters[_IDX["error"]] = 0

    def to_list(self) -> list[int]:
        """Block ids front (next to be reused) to back. Syncs."""
        ctr = self.counters.tolist()
        head, tail = ctr[_IDX["head"]], ctr[_IDX["tail"]]
        if tail <= head:
            return []
        ring = self.ring.cpu()
        slots = torch.arange(head, tail, dtype=torch.int64) & (self.capacity - 1)
        entries = ring[slots]
        return entries[entries >= 0].tolist()

    def check_invariants(self, *, allow_errors: bool = False) -> None:
        """Assert every invariant of the module docstring. Syncs."""
        n, cap = self.num_blocks, self.capacity
        ring = self.ring.tolist()
        pos = self.pos.tolist()
        c = self.counter_values()
        head, tail = c["head"], c["tail"]
        assert len(ring) == cap and len(pos) == n
        if not allow_errors:
            assert c["error"] == 0, f"error flags set: {c['error']:#x}"
        assert 0 <= head <= tail, f"head {head} > tail {tail}"
        assert tail - head <= cap, f"window {tail - head} exceeds capacity {cap}"
        assert pos[0] == -1, "the null block has a queue position"
        seen: dict[int, int] = {}
        tombs = 0
        for p in range(head, tail):
            b = ring[p & (cap - 1)]
            if b == -1:
                tombs += 1
                continue
            assert 0 < b < n, f"ring position {p} holds bad id {b}"
            assert b not in seen, f"block {b} is in the ring at {seen[b]} and {p}"
            seen[b] = p
            assert pos[b] == p, f"block {b} stands at {p}, pos says {pos[b]}"
        in_window = {p & (cap - 1) for p in range(head, tail)}
        for s in range(cap):
            if s not in in_window:
                assert ring[s] == -1, f"slot {s} outside the window holds {ring[s]}"
        for b in range(1, n):
            assert (pos[b] != -1) == (b in seen), f"block {b}: pos {pos[b]}, in ring: {b in seen}"
        assert c["num_free"] == len(seen), f"num_free {c['num_free']} != live entries {len(seen)}"
        assert c["num_tomb"] == tombs, f"num_tomb {c['num_tomb']} != tombstones {tombs}"


# ---------------------------------------------------------------- launchers

#: ``where`` dtypes of ``push`` (``remove``'s ``valid``: ``MASK_DTYPES``, a
#: bool mask read as its uint8 view).
_WHERE_DTYPES = (torch.int8, torch.uint8, torch.int32)


def _count_tensor(count, name: str, device: torch.device) -> torch.Tensor:
    """A device int[1] count; a host int is copied over (no sync, not graph-safe)."""
    if isinstance(count, torch.Tensor):
        if count.numel() != 1:
            raise ValueError(f"{name} must hold one value, got shape {list(count.shape)}")
        return check_tensor(count.reshape(1), name, dtypes=INDEX_DTYPES, device=device).contiguous()
    if isinstance(count, bool) or not isinstance(count, int):
        raise TypeError(f"{name} must be an int or an int32/int64[1] device tensor")
    return torch.tensor([count], dtype=torch.int64, device=device)


def remove(fq: FreeQueue, blocks: torch.Tensor, valid: torch.Tensor | None = None,
           *, count: torch.Tensor | None = None, tile: int | None = None) -> None:
    """Take ``blocks`` (int32[K]) out of the queue wherever they stand.

    Entry k counts only if ``valid[k]`` (bool/int8/uint8/int32[K], optional)
    is true and ``k < count`` (int32/int64[1] device tensor, optional). Ids
    ``<= 0`` (null block, padding) and blocks not in the queue are ignored;
    a block listed several times is removed once. An id ``>= N`` sets
    ``ERR_BAD_BLOCK`` and is ignored. Each removed entry becomes a tombstone.
    """
    dev = fq.device
    blocks = check_tensor(blocks, "blocks", dtypes=INT32, shape=(None,), device=dev).contiguous()
    K = blocks.shape[0]
    if valid is not None:
        valid = check_tensor(valid, "valid", dtypes=MASK_DTYPES, shape=(K,), device=dev).contiguous()
        if valid.dtype == torch.bool:
            valid = valid.view(torch.uint8)
    if count is not None:
        count = _count_tensor(count, "count", dev)
    if K == 0:
        return
    tile = check_tile(fq.tile if tile is None else int(tile))
    _remove_kernel[(triton.cdiv(K, tile),)](
        fq.ring, fq.pos, fq.counters, blocks,
        valid if valid is not None else blocks, count if count is not None else fq.counters,
        K, fq.num_blocks, fq.capacity - 1,
        HAS_VALID=valid is not None, HAS_COUNT=count is not None, TILE=tile,
        num_warps=num_warps(tile),
    )


def pop(fq: FreeQueue, count: torch.Tensor | int, out: torch.Tensor | None = None,
        *, max_count: int | None = None, tile: int | None = None) -> torch.Tensor:
    """Pop the first ``count`` free blocks, front first; returns ``out``.

    ``count`` is an int32/int64[1] device tensor (or a host int). ``out`` is
    int32[M] (allocated with ``M = max_count`` when None); afterwards
    ``out[:count]`` holds the blocks in queue order and ``out[count:] = -1``.
    Contract: ``count <= num_free`` and ``count <= M``; otherwise
    ``ERR_SHORT`` is set and only what there is (at most M) is popped.
    ``counters[LAST_POP]`` says how many were popped (unchanged by a pop of
    ``count`` 0, which changes nothing). One program (a pop
    takes the first ``count`` live entries in order, a scan): it walks tiles
    from ``head`` until it has them, so its cost is ``(count + the tombstones
    among them) / TILE`` iterations; tombstones come from ``remove`` and are
    dropped by compaction (``push`` when the window would overflow,
    ``maybe_compact`` when asked), so they can reach the window's length
    (at most C) between compactions.
    """
    dev = fq.device
    count = _count_tensor(count, "count", dev)
    if out is None:
        if max_count is None:
            raise ValueError("pop needs out or max_count (a host-known upper bound)")
        out = torch.empty(int(max_count), dtype=torch.int32, device=dev)
    else:
        check_tensor(out, "out", dtypes=INT32, shape=(None,), device=dev, contiguous=True)
    tile = check_tile(fq.tile if tile is None else int(tile))
    _pop_kernel[(1,)](
        fq.ring, fq.pos, fq.counters, count, out, out.shape[0], fq.capacity - 1,
        TILE=tile, num_warps=num_warps(tile),
    )
    return out


def push(fq: FreeQueue, blocks: torch.Tensor, where: torch.Tensor,
         call: torch.Tensor | None = None, *, workspace: torch.Tensor | None = None,
         tile: int | None = None) -> None:
    """Put freed blocks back, in the order sequential ``BlockPool.free`` calls
    would leave them.

    ``blocks`` int32[E], ``where`` int8/int32[E] (0 skip, 1 back, 2 front;
    other codes skip), ``call`` int32/int64[E] or None (one call). Entries are
    in the order a reference frees them; a *call* is a maximal run of equal
    ``call`` values (a non-decreasing call id gives one run per call). Calls
    apply in entry order; within a call, back-goers are appended in entry
    order, then the call's front-goers are prepended as a group keeping their
    entry order. So the front-goers of a later call stand before those of an
    earlier call. ``workspace`` is an optional int64[>=E] scratch tensor.

    Contract: a pushed block is not in the queue and appears once with a
    non-zero ``where`` (else ``ERR_PRESENT``: that entry becomes a tombstone);
    ids are in ``1..N-1`` (else ``ERR_BAD_BLOCK``, skipped). Compacts first when
    the window would overflow, so no ``maybe_compact`` is needed for safety.
    One program, two passes over the entries (``E / TILE`` iterations each:
    the order of a call's front-goers depends on the calls before it), plus a
    compaction when the window would overflow (``window / TILE``, rare).
    """
    dev = fq.device
    blocks = check_tensor(blocks, "blocks", dtypes=INT32, shape=(None,), device=dev).contiguous()
    E = blocks.shape[0]
    where = check_tensor(where, "where", dtypes=_WHERE_DTYPES, shape=(E,), device=dev).contiguous()
    if call is not None:
        call = check_tensor(call, "call", dtypes=INDEX_DTYPES, shape=(E,), device=dev).contiguous()
    if workspace is None:
        workspace = torch.empty(max(E, 1), dtype=torch.int64, device=dev)
    else:
        workspace = check_tensor(workspace, "workspace", dtypes=INT64, shape=(None,), device=dev,
                                 min_numel=E).contiguous()
    if E == 0:
        return
    tile = check_tile(fq.tile if tile is None else int(tile))
    _push_kernel[(1,)](
        fq.ring, fq.pos, fq.counters, blocks, where, call if call is not None else blocks,
        workspace, E, fq.num_blocks, fq.capacity, fq.capacity - 1, BASE,
        HAS_CALL=call is not None, TILE=tile, num_warps=num_warps(tile),
    )


def compact(fq: FreeQueue, *, tile: int | None = None) -> None:
    """Pack the window's live entries densely, keeping their order (one program)."""
    tile = check_tile(fq.tile if tile is None else int(tile))
    _compact_kernel[(1,)](
        fq.ring, fq.pos, fq.counters, 0, 0, fq.capacity, fq.capacity - 1, BASE,
        FORCE=True, TILE=tile, num_warps=num_warps(tile),
    )


def maybe_compact(fq: FreeQueue, incoming: int = 0, *, tomb_limit: int | None = None,
                  tile: int | None = None) -> None:
    """Compact when ``window + incoming > C`` or ``tombstones > tomb_limit``
    (default N), decided on the device: the kernel does nothing otherwise and
    the host never reads the counters. Optional: ``push`` compacts by itself
    when it must; this keeps tombstones (and so pop's scan) short."""
    tile = check_tile(fq.tile if tile is None else int(tile))
    limit = fq.num_blocks if tomb_limit is None else int(tomb_limit)
    _compact_kernel[(1,)](
        fq.ring, fq.pos, fq.counters, int(incoming), limit, fq.capacity, fq.capacity - 1, BASE,
        FORCE=False, TILE=tile, num_warps=num_warps(tile),
    )


from gpukv.kernels import capture  # noqa: E402

capture.count_launches(globals())
