"""Reference counts and block tables on the device: release, touch, place,
record.

* ``release``: a batch of free calls (a request's blocks of one group, tail
  first, is one call). Every entry drops one reference; the entry that takes a
  block to 0 in the *sequential* order (its last occurrence in the batch) sends
  it back to the free queue: to the back if cached, else to the front. Which
  thread's atomic happens to see the count reach 0 does not matter.
* ``touch``: hits add a reference; a hit on a free block takes it out of the
  free queue in the same launch (``add_references``, which the admission's
  own launches call for their hits: ``gpukv.kernels.prefill``).
* ``place``: blocks popped from the free queue go to the table positions that
  asked for them, in order (rank = prefix sum over the positions), with one
  reference each, and lose their hash-table entry (lazy eviction) in the
  same launch.
* ``record``: newly full blocks keep a copy of what they were computed from
  (parent digest, tokens, extra digest) so later hits can be verified, then
  join the hash table in batch order.
"""

from __future__ import annotations

from gpukv import _runtime  # noqa: F401  (sets TRITON_INTERPRET before triton loads)

import torch
import triton
import triton.language as tl

from gpukv.kernels import free_queue as fq_ops
from gpukv.kernels import hash_table as table_ops
from gpukv.kernels.block_hash import parent_digest
from gpukv.kernels.free_queue import take_out_blocks
from gpukv.kernels.hash_table import erase_blocks
from gpukv.kernels.toolkit import ENTRY_TILE, INDEX_DTYPES, INT32, INT64, MASK_DTYPES, check_tensor

#: Entries per program of every kernel here (``toolkit.ENTRY_TILE``: why 256).
_TILE = ENTRY_TILE

# The free queue's ``where`` codes, as the release kernel writes them.
_WHERE_SKIP: tl.constexpr = tl.constexpr(fq_ops.WHERE_SKIP)
_WHERE_BACK: tl.constexpr = tl.constexpr(fq_ops.WHERE_BACK)
_WHERE_FRONT: tl.constexpr = tl.constexpr(fq_ops.WHERE_FRONT)
#: ``last_seen`` of a block no entry of the current batch has reached.
_UNSEEN: tl.constexpr = tl.constexpr(-1)


# Arguments that change from step to step (counts, widths) are
# ``do_not_specialize``: Triton would otherwise compile a variant per value
# class (== 1, divisible by 16) they fall in, a compile stall inside a step
# on a GPU (``tests/kernels/test_compile.py`` bounds the variants). No kernel
# here takes a per-step value as a scalar argument: a CUDA graph would replay
# the value it captured.
@triton.jit(do_not_specialize=["E", "R"])
def _release_dec_kernel(
    bt_ptr,                   # int32[G, R, M] block tables (written: 0 at each released entry)
    g_ptr, row_ptr, pos_ptr,  # int32/int64[E] each entry's group, request row, block position
    valid_ptr,                # bool/int8/uint8/int32[E] entry e counts where != 0 (HAS_VALID; else unread)
    ref_ptr,                  # int32[N] blocks' reference counts (one dropped per entry)
    last_ptr,                 # int64[N] per block, the latest entry that dropped a reference (atomic_max)
    blk_ptr,                  # int32[E] out: each entry's block (0 for none)
    E,                        # entries
    R,                        # request rows of the block tables
    M,                        # block positions per row
    HAS_VALID: tl.constexpr,  # whether valid_ptr is read
    TILE: tl.constexpr,       # entries per program (a power of two)
):
    """Per entry: drop the reference of ``bt[g, row, pos]``, note the entry
    as the block's latest (``last[b] = max(entry)``), zero the table slot."""
    offs = tl.program_id(0) * TILE + tl.arange(0, TILE)
    lane = offs < E
    if HAS_VALID:  # padding entries of a fixed-shape batch
        lane = lane & (tl.load(valid_ptr + offs, mask=lane, other=0) != 0)
    g = tl.load(g_ptr + offs, mask=lane, other=0).to(tl.int64)
    r = tl.load(row_ptr + offs, mask=lane, other=0).to(tl.int64)
    p = tl.load(pos_ptr + offs, mask=lane, other=0).to(tl.int64)
    slot = bt_ptr + (g * R + r) * M + p
    b = tl.load(slot, mask=lane, other=0)
    real = lane & (b > 0)
    bs = tl.where(real, b, 0)
    tl.atomic_add(ref_ptr + bs, tl.where(real, -1, 0), mask=real)
    tl.atomic_max(last_ptr + bs, offs.to(tl.int64), mask=real)
    tl.store(slot, tl.zeros([TILE], tl.int32), mask=real)
    tl.store(blk_ptr + offs, tl.where(real, b, 0), mask=offs < E)


@triton.jit(do_not_specialize=["E"])
def _release_where_kernel(
    blk_ptr,                       # int32[E] each entry's block (``_release_dec_kernel``'s)
    ref_ptr,                       # int32[N] blocks' reference counts, after the drops
    last_ptr,                      # int64[N] the latest entry per block (reset to -1 by that entry)
    slot_ptr,                      # int32[N] the hash table's block_slot: >= 0 where a block is cached
    where_ptr,                     # int32[E] out: the free queue's where code per entry
    E,                             # entries
    UNCACHED_FIRST: tl.constexpr,  # uncached blocks go to the front (else every block to the back)
    TILE: tl.constexpr,            # entries per program (a power of two)
):
    """Per entry: where its block goes (0 stays, 1 back, 2 front). Only the
    block's latest entry can send it back, and that entry alone resets
    ``last[b]`` to -1 afterwards: an entry that reads after the reset sees -1,
    not its own index, so it is not the latest either way, and ``last``
    is all -1 again between batches (no stamp to carry from step to step)."""
    offs = tl.program_id(0) * TILE + tl.arange(0, TILE)
    lane = offs < E
    b = tl.load(blk_ptr + offs, mask=lane, other=0)
    real = lane & (b > 0)
    bs = tl.where(real, b, 0)
    rc = tl.load(ref_ptr + bs, mask=real, other=1)
    latest = real & (tl.load(last_ptr + bs, mask=real, other=_UNSEEN) == offs.to(tl.int64))
    goes = latest & (rc == 0)
    cached = tl.load(slot_ptr + bs, mask=real, other=-1) >= 0
    if UNCACHED_FIRST:
        where = tl.where(cached, _WHERE_BACK, _WHERE_FRONT)
    else:
        where = tl.full([TILE], _WHERE_BACK, tl.int32)
    tl.store(where_ptr + offs, tl.where(goes, where, _WHERE_SKIP).to(tl.int32), mask=lane)
    tl.store(last_ptr + bs, tl.full([TILE], _UNSEEN, tl.int64), mask=latest)


def _check_entries(block_table, group, row, pos) -> None:
    """The block tables (int32[G, R, M]) and an entry list's group, row and
    position arrays (int32/int64), by dtype: a few attribute reads, no sync
    (these launchers run every step that is not replayed)."""
    check_tensor(block_table, "block_table", dtypes=INT32, ndim=3)
    check_tensor(group, "group", dtypes=INDEX_DTYPES)
    check_tensor(row, "row", dtypes=INDEX_DTYPES)
    check_tensor(pos, "pos", dtypes=INDEX_DTYPES)


def release(block_table, group, row, pos, call, *, ref_cnt, last_seen, fq, table, uncached_first: bool,
            valid=None, scratch=None, workspace=None) -> None:
    """Drop one reference per entry (``block_table[group, row, pos]``, entries
    in sequential free order, ``call`` non-decreasing), zero those table
    slots, and return the blocks that reach 0 to the free queue.
    ``last_seen`` int64[N] is all -1 between calls (this keeps it so).
    ``valid`` (int32[E], optional) masks padding entries off; ``scratch``
    (optional int32[2, >= E]) takes the per-entry blocks and destinations,
    ``workspace`` (optional int64[E]) the push's."""
    _check_entries(block_table, group, row, pos)
    check_tensor(call, "call", dtypes=INDEX_DTYPES)
    if valid is not None:
        check_tensor(valid, "valid", dtypes=MASK_DTYPES)
    check_tensor(ref_cnt, "ref_cnt", dtypes=INT32)
    check_tensor(last_seen, "last_seen", dtypes=INT64)
    if scratch is not None:
        check_tensor(scratch, "scratch", dtypes=INT32, ndim=2)
    E = group.numel()
    if E == 0:
        return
    G, R, M = block_table.shape
    if scratch is None:  # rows a multiple of 16 lanes apart: the pointers' alignment never varies
        scratch = torch.empty((2, -(-E // 16) * 16), dtype=torch.int32, device=group.device)
    blocks, where = scratch[0, :E], scratch[1, :E]
    grid = (triton.cdiv(E, _TILE),)
    _release_dec_kernel[grid](block_table, group, row, pos, valid if valid is not None else group, ref_cnt,
                              last_seen, blocks, E, R, M, HAS_VALID=valid is not None, TILE=_TILE)
    _release_where_kernel[grid](blocks, ref_cnt, last_seen, table.block_slot, where, E,
                                UNCACHED_FIRST=uncached_first, TILE=_TILE)
    fq_ops.push(fq, blocks, where, call, workspace=workspace)


@triton.jit
def add_references(ref_ptr, ring_ptr, fq_pos_ptr, fq_ctr_ptr, b, v, N, CMASK, TILE: tl.constexpr):
    """A reference more for each block ``b`` (int32[TILE]) of a tile where
    ``v``: ids ``<= 0`` are skipped, an id ``>= N`` counts nothing and sets
    ``ERR_BAD_BLOCK`` in the free queue's error word. The one lane (of all
    programs) that takes a block's count from 0 takes the block out of the
    free queue (``free_queue.take_out_blocks``), since a block is queued
    exactly while its count is 0. Counts and claims are atomic: any number
    of programs, in any order, leave the same counts and queue. Shared by
    ``_touch_kernel`` and the admission's entries and hit placement
    (``prefill``), which touch their hits in their own launches."""
    v = v & (b > 0)
    inside = v & (b < N)
    old = tl.atomic_add(ref_ptr + tl.where(inside, b, 0), tl.where(inside, 1, 0), mask=inside)
    take_out_blocks(ring_ptr, fq_pos_ptr, fq_ctr_ptr, b, (inside & (old == 0)) | (v & (b >= N)), N, CMASK, TILE)


def reference_args(ref_cnt: torch.Tensor, fq: fq_ops.FreeQueue) -> tuple:
    """What ``add_references`` reads, in the order every kernel that calls
    it takes them: ``ref_ptr, ring_ptr, fq_pos_ptr, fq_ctr_ptr, N, CMASK``."""
    return ref_cnt, fq.ring, fq.pos, fq.counters, fq.num_blocks, fq.capacity - 1


@triton.jit(do_not_specialize=["K"])
def _touch_kernel(
    blk_ptr,              # int32[K] blocks hit (<= 0: skipped; >= N: ERR_BAD_BLOCK in the free queue's error word)
    valid_ptr,            # bool/int8/uint8/int32[K] entry k counts where != 0
    ref_ptr,              # int32[N] blocks' reference counts (one added per entry)
    ring_ptr,             # int32[C] the free queue's ring (a tombstone where a block leaves it)
    fq_pos_ptr,           # int64[N] ... each queued block's position (-1 where a block leaves it)
    fq_ctr_ptr,           # int64[NUM_COUNTERS] ... its counters (NUM_FREE, NUM_TOMB, ERROR)
    N,                    # blocks in the pool (ids 0..N-1)
    CMASK,                # the ring's slots - 1
    K,                    # entries
    TILE: tl.constexpr,   # entries per program (a power of two)
):
    """Each valid entry adds a reference to its block (``add_references``)."""
    offs = tl.program_id(0) * TILE + tl.arange(0, TILE)
    lane = offs < K
    b = tl.load(blk_ptr + offs, mask=lane, other=0)
    v = lane & (tl.load(valid_ptr + offs, mask=lane, other=0) != 0)
    add_references(ref_ptr, ring_ptr, fq_pos_ptr, fq_ctr_ptr, b, v, N, CMASK, TILE)


def touch(blocks, valid, *, ref_cnt, fq) -> None:
    """Add a reference to each valid block; free ones leave the free queue.
    One launch."""
    check_tensor(blocks, "blocks", dtypes=INT32)
    check_tensor(valid, "valid", dtypes=MASK_DTYPES)
    check_tensor(ref_cnt, "ref_cnt", dtypes=INT32)
    K = blocks.numel()
    if K == 0:
        return
    _touch_kernel[(triton.cdiv(K, _TILE),)](blocks, valid, *reference_args(ref_cnt, fq), K, TILE=_TILE)


@triton.jit(do_not_specialize=["E", "R", "cap", "N"])
def _place_kernel(
    popped_ptr,               # int32[>= wanted] the popped blocks, in pop order
    want_ptr,                 # bool/int8/uint8/int32[E] entry e takes a block where != 0
    rank_ptr,                 # int32/int64[E] wanted entries before e: its block is popped[rank]
    g_ptr, row_ptr, pos_ptr,  # int32/int64[E] each entry's group, request row, block position
    bt_ptr,                   # int32[G, R, M] block tables (written: the wanted entries)
    ref_ptr,                  # int32[N] blocks' reference counts (1 for each block placed)
    slot_block_ptr,           # int32[cap] the hash table's slots' blocks (its entries of placed blocks erased)
    block_slot_ptr,           # int32[N] ... each block's slot (NO_SLOT for each placed block)
    table_ctr_ptr,            # int64[NUM_COUNTERS] ... its counters (LIVE, TOMBSTONES, ERRORS)
    evictions_ptr,            # int64[1] increased by the placed blocks that were cached
    E,                        # entries
    R,                        # request rows of the block tables
    M,                        # block positions per row
    cap,                      # the hash table's slots (a power of two)
    N,                        # blocks in the pool (ids 0..N-1)
    TILE: tl.constexpr,       # entries per program (a power of two)
):
    """Each wanted entry takes its popped block (``popped[rank]``, a block
    id >= 1; -1 where the pop came short, which writes -1 and counts
    nothing) with one reference, and the block's hash-table entry goes
    (lazy eviction: ``hash_table.erase_blocks``). The wanted entries' ranks
    are ``0 .. count - 1``, so each popped block is erased and placed once,
    by the program of its entry; entries are independent, so programs run
    in any order."""
    offs = tl.program_id(0) * TILE + tl.arange(0, TILE)
    lane = offs < E
    want = lane & (tl.load(want_ptr + offs, mask=lane, other=0) != 0)
    rank = tl.load(rank_ptr + offs, mask=want, other=0)
    b = tl.load(popped_ptr + rank, mask=want, other=0)
    erase_blocks(slot_block_ptr, block_slot_ptr, table_ctr_ptr, evictions_ptr, b, want, cap, N, True)
    g = tl.load(g_ptr + offs, mask=want, other=0).to(tl.int64)
    r = tl.load(row_ptr + offs, mask=want, other=0).to(tl.int64)
    p = tl.load(pos_ptr + offs, mask=want, other=0).to(tl.int64)
    tl.store(bt_ptr + (g * R + r) * M + p, b, mask=want)
    tl.store(ref_ptr + tl.where(want, b, 0), tl.full([TILE], 1, tl.int32), mask=want & (b > 0))


def allocate(count, want, group, row, pos, *, block_table, ref_cnt, fq, table, evictions, rank=None,
             popped=None, on_popped=None) -> None:
    """Pop ``count`` (int64[1] device tensor) blocks and place them, in order,
    at the entries where ``want`` is set (``count`` must equal their number).
    Popped blocks that are still cached lose their hash (lazy eviction);
    ``evictions`` (int64[1]) counts them. ``rank`` (int32[E], optional: the
    number of wanted entries before each) and ``popped`` (int32[E] scratch)
    let a caller that planned them on the device skip the prefix sum.
    ``on_popped(popped)`` (optional) sees the popped blocks before their
    hashes go (KV-cache events). Two launches: the pop, then the place,
    which erases the blocks' hashes as it places them."""
    _check_entries(block_table, group, row, pos)
    check_tensor(want, "want", dtypes=MASK_DTYPES)
    check_tensor(ref_cnt, "ref_cnt", dtypes=INT32)
    check_tensor(evictions, "evictions", dtypes=INT64, shape=(1,))
    if rank is not None:
        check_tensor(rank, "rank", dtypes=INDEX_DTYPES)
    E = want.numel()
    if E == 0:
        return
    if popped is None:
        popped = torch.empty(E, dtype=torch.int32, device=want.device)
    fq_ops.pop(fq, count, popped)
    if on_popped is not None:
        on_popped(popped)
    if rank is None:
        rank = (torch.cumsum(want.to(torch.int32), 0) - 1).to(torch.int32)
    G, R, M = block_table.shape
    _place_kernel[(triton.cdiv(E, _TILE),)](popped, want, rank, group, row, pos, block_table, ref_cnt,
                                            table.slot_block, table.block_slot, table.counters, evictions,
                                            E, R, M, table.capacity, table.num_blocks, TILE=_TILE)


@triton.jit(do_not_specialize=["root_lo", "root_hi", "K", "R"])
def _record_kernel(
    bt_ptr,                                # int32[G, R, MB] block tables
    g_ptr, row_ptr, pos_ptr,               # int32/int64[K] each entry's group, request row, block position
    valid_ptr,                             # bool/int8/uint8/int32[K] entry k is recorded where != 0
    R, MB,                                 # request rows, block positions per row of the block tables
    tokens_ptr, T,                         # int32[R, T] request rows' tokens
    digests_ptr, extras_ptr, M,            # int64[R, M, 2] request rows' digests and extra digests
    root_lo: tl.int64, root_hi: tl.int64,  # the root digest lanes (block 0's parent)
    blk_tokens_ptr,                        # int32[N, BS] out: each recorded block's tokens
    blk_parent_ptr, blk_extra_ptr,         # int64[N, 2] out: ... its parent and extra digests
    blk_out_ptr,                           # int32[K] out: the entry's block (0 for none)
    ok_out_ptr,                            # int32[K] out: 1 where the entry was recorded
    key_out_ptr,                           # int64[K, 2] out: the entry's digest lanes
    K,                                     # entries
    BS: tl.constexpr,                      # block size (tokens)
    BS_P2: tl.constexpr,                   # BS rounded up to a power of two (the token tile's width)
    TILE: tl.constexpr,                    # entries per program (a power of two)
):
    """Per valid entry whose table slot ``bt[g, row, pos]`` (``bt`` int32[G, R,
    MB]) holds a block b: copy the block's inputs (parent digest, tokens,
    extra digest) into b's record, and write the insert's inputs: ``blk_out``
    b, ``ok_out`` 1 (else 0), ``key_out[2 * i]`` the digest lanes."""
    offs = tl.program_id(0) * TILE + tl.arange(0, TILE)
    lane = offs < K
    v = lane & (tl.load(valid_ptr + offs, mask=lane, other=0) != 0)
    g = tl.load(g_ptr + offs, mask=v, other=0).to(tl.int64)
    r = tl.load(row_ptr + offs, mask=v, other=0).to(tl.int64)
    p = tl.load(pos_ptr + offs, mask=v, other=0).to(tl.int64)
    b = tl.load(bt_ptr + (g * R + r) * MB + p, mask=v, other=0).to(tl.int64)
    v = v & (b > 0)
    par_lo, par_hi = parent_digest(digests_ptr, r, p, M, v, root_lo, root_hi)
    tl.store(blk_parent_ptr + b * 2, par_lo, mask=v)
    tl.store(blk_parent_ptr + b * 2 + 1, par_hi, mask=v)
    ext = (r * M + p) * 2
    tl.store(blk_extra_ptr + b * 2, tl.load(extras_ptr + ext, mask=v, other=0), mask=v)
    tl.store(blk_extra_ptr + b * 2 + 1, tl.load(extras_ptr + ext + 1, mask=v, other=0), mask=v)
    cols = tl.arange(0, BS_P2)
    m2 = v[:, None] & (cols < BS)[None, :]
    toks = tl.load(tokens_ptr + (r * T + p * BS)[:, None] + cols[None, :], mask=m2, other=0)
    tl.store(blk_tokens_ptr + (b * BS)[:, None] + cols[None, :], toks, mask=m2)
    tl.store(blk_out_ptr + offs, tl.where(v, b, 0).to(tl.int32), mask=lane)
    tl.store(ok_out_ptr + offs, v.to(tl.int32), mask=lane)
    tl.store(key_out_ptr + offs * 2, tl.load(digests_ptr + ext, mask=v, other=0), mask=lane)
    tl.store(key_out_ptr + offs * 2 + 1, tl.load(digests_ptr + ext + 1, mask=v, other=0), mask=lane)


def record(group, row, pos, valid, *, block_table, tokens, digests, extras, root, blk_tokens, blk_parent,
           blk_extra, table, scratch=None, seq=None):
    """Cache the blocks at ``block_table[group, row, pos]`` where ``valid``:
    keep their inputs for verification, then insert them into the table in
    entry order (duplicates of a cached hash are kept, newest last).
    ``scratch`` (optional int64[4, >= K]) holds the insert's inputs, ``seq``
    (optional int64[K]) its sequence numbers. Returns the insert's inputs
    (block int32[K], ok int32[K], digest lanes int64[K, 2]), or None for no
    entry."""
    _check_entries(block_table, group, row, pos)
    check_tensor(group, "group", dtypes=INT32)  # the hash table's group lanes are int32
    check_tensor(valid, "valid", dtypes=MASK_DTYPES)
    check_tensor(tokens, "tokens", dtypes=INT32, ndim=2)
    check_tensor(digests, "digests", dtypes=INT64, ndim=3)
    check_tensor(extras, "extras", dtypes=INT64, ndim=3)
    check_tensor(blk_tokens, "blk_tokens", dtypes=INT32, ndim=2)
    check_tensor(blk_parent, "blk_parent", dtypes=INT64)
    check_tensor(blk_extra, "blk_extra", dtypes=INT64)
    if scratch is not None:
        check_tensor(scratch, "scratch", dtypes=INT64, ndim=2)
    K = group.numel()
    if K == 0:
        return None
    G, R, MB = block_table.shape
    T = tokens.shape[1]
    M = digests.shape[1]  # digests and extras share one layout (may be wider than the block table)
    bs = blk_tokens.shape[1]
    if scratch is None:  # rows a multiple of 16 lanes apart: the pointers' alignment never varies
        scratch = torch.empty((4, -(-K // 16) * 16), dtype=torch.int64, device=group.device)
    key = scratch[0:2].view(-1)[: 2 * K].view(K, 2)
    blk, ok = scratch[2].view(torch.int32)[:K], scratch[3].view(torch.int32)[:K]
    _record_kernel[(triton.cdiv(K, _TILE),)](
        block_table, group, row, pos, valid, R, MB, tokens, T, digests, extras, M, root[0], root[1],
        blk_tokens, blk_parent, blk_extra, blk, ok, key, K,
        BS=bs, BS_P2=triton.next_power_of_2(bs), TILE=_TILE,
    )
    table_ops.insert(table, key[:, 0], key[:, 1], group, blk, ok, seq=seq)
    return blk, ok, key


from gpukv.kernels import capture  # noqa: E402

capture.count_launches(globals())
