"""The admission step's device work around the sequential ``_admit_kernel``
(``gpukv.kernels.lookup``): new requests into their rows, their lookups, the
chains of requests of the step sharing a block, and every entry the later
launches read, derived on the device from per-request counts.

The host plans a step admitting K new requests (``gpukv.device.admission.Admission``)
as int32 arrays of a bucket's fixed length ``KP`` (K padded to a power of
two), uploaded once:

* ``rows`` (request rows), ``ntok`` (prompt tokens), ``nfull`` (full blocks),
  ``nblocks`` (blocks, for the stats), ``max_hit`` (the longest hit the
  request may get: the last-token rule, ``skip_prefix_cache`` and any cap),
  ``comp`` (its chunk: tokens computed, the hit counts towards them),
  ``lookahead`` (slots reserved past the computed tokens), ``skip``,
  ``tok_off`` (where its tokens start in ``tokens``);
* ``tokens``: every new request's prompt, one after the other.

and ``num_requests`` (int32[1], K). Only the first K entries are read; the
padding holds zeros (so the hashing launch, over all KP rows, hashes nothing
there). No launch takes a per-step host value: the step's launches are the
same for every step of a bucket, so they are prepared once and replayed
(``gpukv.kernels.capture.preparing``). The step's launches, in order:

1. ``write_rows``: the prompts into the rows, the rows' extra digests zeroed
   (requests with extra keys get theirs next, on the host's path);
2. (hashing: ``gpukv.kernels.block_hash``, the rows' chained digests);
3. ``lookup``: per (request, position < max_hit, group) the oldest cached
   block under the row's digest, verified against its kept inputs, into
   ``cache[KP, PP, G]`` (-1: miss; every entry written);
4. ``chains``: per (request i, position p < its full blocks) the first
   request of the step with the same digest at p (the chain's head), the next
   one after i, and whether i's inputs equal the head's; entries at
   ``i * PP + p``. Pairwise over the step's requests: ``K * K * PP`` digest
   compares, no scratch table and no sort (a step admits at most
   ``max_num_reqs`` requests);
5. (``_admit_kernel``: the hits, who is admitted, ``start``: each admitted
   request's first new block in the step's pop order);
6. ``admission_entries``: the first touches (cache hits of admitted
   requests, in the cache's layout: a reference each, and a hit on a free
   block takes it out of the free queue), the allocation entries
   (group/row/pos/want/rank, ``[5, KP * G * A]``, A = the most new blocks a
   request takes per group, a bucket size) and the caching entries
   (group/row/pos/valid, ``[4, KP * G * C]``, C = the most full blocks a
   chunk holds), masked past the admitted requests;
7. (allocate: ``gpukv.device.pool``);
8. ``place_hits``: every admitted request's hits into its block table (a
   pending hit takes the block the earlier request just got; a window
   group's positions before its last W hit blocks hold the null block), and
   the pending hits' references (a reference each, never from the free queue);
9. (record).

Every launch but the admission itself is parallel over its entries; none
reads the host; the host reads the step's status once, after the last.
Deterministic: the only atomics are the touches' (``blocks.add_references``:
count additions, and claims that let one lane take a block out of the free
queue), whose results do not depend on the order programs run in.
"""

from __future__ import annotations

from gpukv import _runtime  # noqa: F401  (sets TRITON_INTERPRET before triton loads)

import torch
import triton
import triton.language as tl

from gpukv.kernels import lookup as lookup_ops
from gpukv.kernels.blocks import add_references, reference_args
from gpukv.kernels.toolkit import (
    BIG,
    DEFAULT_WARPS,
    INT32,
    PROBE_TILE,
    ROW_TILE,
    check_tensor,
    num_warps,
    zero_like,
)
from gpukv.kernels.free_queue import FreeQueue
from gpukv.kernels.hash_table import probe_oldest
from gpukv.kernels.lookup import inputs_equal

#: The per-request arrays of an admission plan, in upload order (then ``tokens``).
PLAN_ARRAYS = ("rows", "ntok", "nfull", "nblocks", "max_hit", "comp", "lookahead", "skip", "tok_off")

#: Positions per program of the lookup and the chains (probing, verifying
#: lanes), and lanes of the element-wise kernels (``toolkit``: why these sizes).
_TILE = PROBE_TILE
_ROW_TILE = ROW_TILE

# Constants a kernel reads must be constexpr globals (the real compiler
# rejects any other global; the interpreter accepts them).
_BIG: tl.constexpr = tl.constexpr(BIG)  # no request
_ST_ADMITTED: tl.constexpr = tl.constexpr(lookup_ops.ST_ADMITTED)


# Step sizes (request counts, bucket sizes) are runtime arguments, not
# constexprs, and not specialised: a new value must not compile a variant
# inside a step.
@triton.jit(do_not_specialize=["T", "M2"])
def _write_rows_kernel(
    rows_ptr,        # int32[KP] request rows
    ntok_ptr,        # int32[KP] prompt tokens
    tok_off_ptr,     # int32[KP] where each prompt starts in new_tok
    new_tok_ptr,     # int32[TP] the prompts, one after the other
    tokens_ptr, T,   # int32[R, T] request rows' tokens (written)
    extras_ptr, M2,  # int64[R, M, 2] rows' extra-key digests (zeroed: M2 = 2 * M per row)
    nreq_ptr,        # int32[1] requests K (the first K entries)
    TILE: tl.constexpr,  # tokens (and extras lanes) per step (a power of two)
):
    """One program per request: its prompt into its row, its extras zeroed."""
    i = tl.program_id(0)
    if i < tl.load(nreq_ptr):
        r = tl.load(rows_ptr + i).to(tl.int64)
        n = tl.load(ntok_ptr + i)
        off = tl.load(tok_off_ptr + i).to(tl.int64)
        lanes = tl.arange(0, TILE)
        for t0 in range(0, n, TILE):
            t = t0 + lanes
            m = t < n
            tl.store(tokens_ptr + r * T + t, tl.load(new_tok_ptr + off + t, mask=m, other=0), mask=m)
        for e0 in range(0, M2, TILE):
            e = e0 + lanes
            tl.store(extras_ptr + r * M2 + e, tl.zeros([TILE], tl.int64), mask=e < M2)


@triton.jit
def _request_tile(rows_ptr, nreq_ptr, limit_ptr, digests_ptr, M, P, TILE: tl.constexpr):
    """A (request, position tile) program's lanes: request i (program 0),
    positions p (program 1's tile), p < P, the request count K, i's row, p
    as int64, the lanes that are real and below ``limit[i]`` (the longest
    hit, or the full blocks), and their digest lanes. i < KP, so its plan
    entries are in bounds (past K: stale, masked)."""
    i = tl.program_id(0)
    p = tl.program_id(1) * TILE + tl.arange(0, TILE)
    K = tl.load(nreq_ptr)
    real = (zero_like(p) + i) < K  # as lanes: the interpreter refuses a scalar-and-block mask
    r = tl.load(rows_ptr + i).to(tl.int64)
    active = real & (p < tl.load(limit_ptr + i))
    p64 = p.to(tl.int64)
    d = (r * M + p64) * 2
    lo = tl.load(digests_ptr + d, mask=active, other=0)
    hi = tl.load(digests_ptr + d + 1, mask=active, other=0)
    return i, p, p < P, K, r, p64, active, lo, hi


@triton.jit(do_not_specialize=["P", "T", "M", "cap", "root_lo", "root_hi"])
def _lookup_kernel(
    rows_ptr, max_hit_ptr, nreq_ptr, P,  # int32[KP] rows, longest hits; int32[1] requests; positions per request
    cache_ptr,                        # int32[KP, P, G] out: verified cached block or -1
    tokens_ptr, T, digests_ptr, extras_ptr, M, root_lo: tl.int64, root_hi: tl.int64,  # request rows
    slot_lo_ptr, slot_hi_ptr, slot_group_ptr, slot_block_ptr, block_seq_ptr, cap,      # the pool's hash table
    blk_tokens_ptr, blk_parent_ptr, blk_extra_ptr,                                     # cached blocks' inputs
    G: tl.constexpr,      # KV-cache groups
    BS: tl.constexpr,     # block size (tokens)
    BS_P2: tl.constexpr,  # BS rounded up to a power of two (the token tile's width)
    TILE: tl.constexpr,   # positions per program (a power of two)
):
    """Grid (KP, P / TILE): request i's positions p of this tile, every group."""
    i, p, in_p, _, r, p64, active, lo, hi = _request_tile(rows_ptr, nreq_ptr, max_hit_ptr, digests_ptr, M, P, TILE)
    for g in tl.static_range(G):
        grp = tl.zeros([TILE], tl.int32) + g
        found = probe_oldest(slot_lo_ptr, slot_hi_ptr, slot_group_ptr, slot_block_ptr, block_seq_ptr, lo, hi, grp,
                             active, cap)
        ok = inputs_equal(tl.maximum(found, 0).to(tl.int64), r + tl.zeros([TILE], tl.int64), p64, active & (found >= 0),
                          tokens_ptr, T, digests_ptr, extras_ptr, M, root_lo, root_hi,
                          blk_tokens_ptr, blk_parent_ptr, blk_extra_ptr, True, BS, BS_P2)
        tl.store(cache_ptr + (i * P + p64) * G + g, tl.where(ok, found, -1), mask=in_p)


@triton.jit(do_not_specialize=["P", "T", "M", "root_lo", "root_hi"])
def _chains_kernel(
    rows_ptr, nfull_ptr, max_hit_ptr, nreq_ptr, P,  # int32[KP] rows, full blocks, longest hits; int32[1] requests
    pend_ptr,                                # int32[KP, P] out: chain head entry for a lookup position, or -1
    next_ptr,                                # int32[KP * P] out: next entry with the same digest, or -1
    ok_ptr,                                  # int32[KP * P] out: the entry's inputs equal its head's
    tokens_ptr, T, digests_ptr, extras_ptr, M, root_lo: tl.int64, root_hi: tl.int64,  # request rows
    BS: tl.constexpr,     # block size (tokens)
    BS_P2: tl.constexpr,  # BS rounded up to a power of two (the token tile's width)
    TILE: tl.constexpr,   # positions per program (a power of two)
):
    """Grid (KP, P / TILE): request i's positions p of this tile. An entry
    (j, p) exists for each full block p of request j; the loop over j < K
    finds the first entry with i's digest at p (i's own at the latest) and
    the first after i."""
    i, p, in_p, K, r, p64, mine, lo, hi = _request_tile(rows_ptr, nreq_ptr, nfull_ptr, digests_ptr, M, P, TILE)
    head = tl.full([TILE], _BIG, tl.int32)
    after = tl.full([TILE], _BIG, tl.int32)
    head_row = r + tl.zeros([TILE], tl.int64)
    for j in range(0, K):
        rj = tl.load(rows_ptr + j).to(tl.int64)
        there = mine & (p < tl.load(nfull_ptr + j))
        d = (rj * M + p64) * 2
        same = there & (tl.load(digests_ptr + d, mask=there, other=0) == lo)
        same = same & (tl.load(digests_ptr + d + 1, mask=same, other=0) == hi)
        first = same & (head == _BIG)
        head = tl.where(first, j, head)
        head_row = tl.where(first, rj, head_row)
        after = tl.where(same & (j > i) & (after == _BIG), j, after)
    ok = inputs_equal(head_row, r + tl.zeros([TILE], tl.int64), p64, mine, tokens_ptr, T, digests_ptr, extras_ptr, M,
                      root_lo, root_hi, tokens_ptr, digests_ptr, digests_ptr, False, BS, BS_P2)
    e = i * P + p
    tl.store(pend_ptr + e, tl.where(ok & (p < tl.load(max_hit_ptr + i)), head * P + p, -1), mask=in_p)
    tl.store(next_ptr + e, tl.where(mine & (after < _BIG), after * P + p, -1), mask=in_p)
    tl.store(ok_ptr + e, ok.to(tl.int32), mask=in_p)


@triton.jit
def _window_real(win_ptr, g, p, hit):
    """Positions of a hit where group ``g`` holds a real block: all of them for
    full attention (W < 0), the last W for a window of W blocks."""
    W = tl.load(win_ptr + g)
    return (p < hit) & (p >= tl.where(W < 0, 0, tl.maximum(hit - W, 0)))


@triton.jit
def _hit_entries(e, KP, P, G: tl.constexpr, admitted, hit_ptr, win_ptr, cache_ptr):
    """Entries ``e`` of the cache's (i, p, g) layout: in range, request,
    group, position, its hit, inside an admitted request's hit, where the
    group holds a real block there, and the cached block (-1: none; read
    only where real)."""
    m = e < KP * P * G
    i = e // (P * G)
    g = e % G
    p = (e // G) % P
    hit = tl.load(hit_ptr + i, mask=m, other=0)
    in_hit = m & (i < admitted) & (p < hit)
    real = in_hit & _window_real(win_ptr, g, p, hit)
    return m, i, g, p, hit, in_hit, real, tl.load(cache_ptr + e, mask=real, other=-1)


@triton.jit(do_not_specialize=["KP", "P", "A", "C"])
def _admission_entries_kernel(
    status_ptr,              # int64[NUM_STATUS] the admission's (ST_ADMITTED: admitted requests)
    hit_ptr, start_ptr,      # int32[KP] hits, first new block in the step's pop order
    rows_ptr, comp_ptr, lookahead_ptr,  # int32[KP] the plan's
    cache_ptr, win_ptr,      # int32[KP, P, G] cached hits; int32[G] window blocks (-1: full attention)
    alloc_ptr,               # int32[5, KP * G * A] out: group, row, pos, want, rank
    record_ptr,              # int32[4, KP * G * C] out: group, row, pos, valid
    ref_ptr,                 # int32[N] blocks' reference counts (one added per first touch)
    ring_ptr, fq_pos_ptr, fq_ctr_ptr,  # the free queue's ring, positions, counters (a touched free block leaves)
    N, CMASK,                # blocks in the pool; the free queue's ring slots - 1
    KP, P, A, C,             # bucket requests, positions, alloc and record entries per request and group
    G: tl.constexpr,         # KV-cache groups
    BS: tl.constexpr,        # block size (tokens)
    TILE: tl.constexpr,      # entries of each layout per program (a power of two)
):
    """Each program one tile of each of the three entry layouts; the first
    touches (an admitted request's real cached hits, in the cache's layout)
    are made here (``blocks.add_references``), before the next launch pops."""
    admitted = tl.load(status_ptr + _ST_ADMITTED)
    e = tl.program_id(0) * TILE + tl.arange(0, TILE)
    # first touches: the cache's own layout (i, p, g)
    _, _, _, _, _, _, real, c = _hit_entries(e, KP, P, G, admitted, hit_ptr, win_ptr, cache_ptr)
    add_references(ref_ptr, ring_ptr, fq_pos_ptr, fq_ctr_ptr, c, real & (c >= 0), N, CMASK, TILE)
    # allocation: positions hit + a of each group, a < the new blocks per group
    EA = KP * G * A
    m = e < EA
    i = e // (G * A)
    g = (e // A) % G
    a = e % A
    hit = tl.load(hit_ptr + i, mask=m, other=0)
    comp = tl.maximum(tl.load(comp_ptr + i, mask=m, other=0), hit * BS)
    new = (comp + tl.load(lookahead_ptr + i, mask=m, other=0) + BS - 1) // BS - hit
    tl.store(alloc_ptr + e, g, mask=m)
    tl.store(alloc_ptr + EA + e, tl.maximum(tl.load(rows_ptr + i, mask=m, other=0), 0), mask=m)
    tl.store(alloc_ptr + 2 * EA + e, hit + a, mask=m)
    tl.store(alloc_ptr + 3 * EA + e, (m & (i < admitted) & (a < new)).to(tl.int32), mask=m)
    tl.store(alloc_ptr + 4 * EA + e, tl.load(start_ptr + i, mask=m & (i < admitted), other=0) + g * new + a, mask=m)
    # caching: the chunk's full blocks past the hit (a hit past the chunk is cached already)
    EC = KP * G * C
    m = e < EC
    i = e // (G * C)
    g = (e // C) % G
    hit = tl.load(hit_ptr + i, mask=m, other=0)
    pos = hit + e % C
    full = tl.load(comp_ptr + i, mask=m, other=0) // BS
    tl.store(record_ptr + e, g, mask=m)
    tl.store(record_ptr + EC + e, tl.maximum(tl.load(rows_ptr + i, mask=m, other=0), 0), mask=m)
    tl.store(record_ptr + 2 * EC + e, pos, mask=m)
    tl.store(record_ptr + 3 * EC + e, (m & (i < admitted) & (pos < full)).to(tl.int32), mask=m)


@triton.jit(do_not_specialize=["KP", "P", "R", "MB"])
def _place_hits_kernel(
    status_ptr, hit_ptr, rows_ptr,  # the admission's status, hits; int32[KP] rows
    cache_ptr, resolved_ptr,        # int32[KP, P, G] cached hits; int32[KP, P] pending hits' requests
    win_ptr,                        # int32[G] window blocks (-1: full attention)
    bt_ptr, R, MB,                  # int32[G, R, MB] block tables (written: the hits)
    ref_ptr,                        # int32[N] blocks' reference counts (one added per pending hit)
    ring_ptr, fq_pos_ptr, fq_ctr_ptr,  # the free queue's ring, positions, counters (read: no pending block is free)
    N, CMASK,                       # blocks in the pool; the free queue's ring slots - 1
    KP, P,                          # bucket requests, positions per request
    G: tl.constexpr,                # KV-cache groups
    TILE: tl.constexpr,             # entries per program (a power of two)
):
    """Per (i, p, g) entry of an admitted request's hit: the block into its
    table, and a pending hit's reference to the block its earlier request
    just got (``blocks.add_references``: held, so it never leaves the free
    queue here). Reads earlier requests' tables only where they allocated (a
    pending hit's block is new to its owner), so no lane reads what another
    writes."""
    admitted = tl.load(status_ptr + _ST_ADMITTED)
    e = tl.program_id(0) * TILE + tl.arange(0, TILE)
    _, i, g, p, hit, in_hit, real, c = _hit_entries(e, KP, P, G, admitted, hit_ptr, win_ptr, cache_ptr)
    pend = real & (c < 0)
    who = tl.load(resolved_ptr + i * P + p, mask=pend, other=0)
    g64, p64 = g.to(tl.int64), p.to(tl.int64)
    owner = tl.load(rows_ptr + tl.maximum(who, 0), mask=pend, other=0).to(tl.int64)
    theirs = tl.load(bt_ptr + (g64 * R + owner) * MB + p64, mask=pend, other=0)
    blk = tl.where(real, tl.where(c >= 0, c, theirs), 0)
    r = tl.load(rows_ptr + i, mask=in_hit, other=0).to(tl.int64)
    tl.store(bt_ptr + (g64 * R + r) * MB + p64, blk, mask=in_hit)
    add_references(ref_ptr, ring_ptr, fq_pos_ptr, fq_ctr_ptr, blk, pend, N, CMASK, TILE)


# ----------------------------------------------------------------- launchers
def write_rows(plan: dict, *, tokens: torch.Tensor, extras: torch.Tensor) -> None:
    """Launch ``_write_rows_kernel`` (``plan``: the named int32 views)."""
    KP = plan["rows"].numel()
    _write_rows_kernel[(KP,)](plan["rows"], plan["ntok"], plan["tok_off"], plan["tokens"], tokens, tokens.shape[1],
                              extras, extras.shape[1] * 2, plan["num_requests"], TILE=_ROW_TILE,
                              num_warps=num_warps(_ROW_TILE, max_warps=DEFAULT_WARPS))


def lookup(plan: dict, cache: torch.Tensor, *, table, tokens, digests, extras, root,
           blk_tokens, blk_parent, blk_extra) -> None:
    """Launch ``_lookup_kernel``: ``cache`` int32[KP, P, G] is written whole."""
    KP, P, G = cache.shape
    check_tensor(plan["rows"], "rows", dtypes=INT32, min_numel=KP, contiguous=True)
    bs = blk_tokens.shape[1]
    _lookup_kernel[(KP, triton.cdiv(P, _TILE))](
        plan["rows"], plan["max_hit"], plan["num_requests"], P, cache,
        tokens, tokens.shape[1], digests, extras, digests.shape[1], root[0], root[1],
        table.slot_lo, table.slot_hi, table.slot_group, table.slot_block, table.block_seq, table.capacity,
        blk_tokens, blk_parent, blk_extra, G=G, BS=bs, BS_P2=triton.next_power_of_2(bs), TILE=_TILE)


def chains(plan: dict, head: torch.Tensor, nxt: torch.Tensor, ok: torch.Tensor, *, tokens,
           digests, extras, root, block_size: int) -> None:
    """Launch ``_chains_kernel``: ``head`` int32[KP, P], ``nxt``/``ok``
    int32[KP * P], written whole (``_admit_kernel``'s ``chains``)."""
    KP, P = head.shape
    check_tensor(nxt, "next", dtypes=INT32, min_numel=KP * P, contiguous=True)
    check_tensor(ok, "ok", dtypes=INT32, min_numel=KP * P, contiguous=True)
    _chains_kernel[(KP, triton.cdiv(P, _TILE))](
        plan["rows"], plan["nfull"], plan["max_hit"], plan["num_requests"], P, head, nxt, ok,
        tokens, tokens.shape[1], digests, extras, digests.shape[1], root[0], root[1],
        BS=block_size, BS_P2=triton.next_power_of_2(block_size), TILE=_TILE)


def admission_entries(plan: dict, status, hit, start, cache, window_blocks, alloc, record, *, block_size: int,
                      ref_cnt: torch.Tensor, free_queue: FreeQueue) -> None:
    """Launch ``_admission_entries_kernel`` (``alloc`` int32[5, KP * G * A],
    ``record`` int32[4, KP * G * C]; A and C read from their shapes): the
    entries, and the first touches into ``ref_cnt`` and ``free_queue``."""
    KP, P, G = cache.shape
    A, C = alloc.shape[1] // (KP * G), record.shape[1] // (KP * G)
    largest = max(KP * P * G, alloc.shape[1], record.shape[1])
    _admission_entries_kernel[(triton.cdiv(largest, _ROW_TILE),)](
        status, hit, start, plan["rows"], plan["comp"], plan["lookahead"], cache, window_blocks, alloc, record,
        *reference_args(ref_cnt, free_queue), KP, P, A, C, G=G, BS=block_size, TILE=_ROW_TILE)


def place_hits(plan: dict, status, hit, cache, resolved, window_blocks, *, block_table, ref_cnt: torch.Tensor,
               free_queue: FreeQueue) -> None:
    """Launch ``_place_hits_kernel``: the hits into ``block_table``, the
    pending hits' references into ``ref_cnt``."""
    KP, P, G = cache.shape
    _, R, MB = block_table.shape
    _place_hits_kernel[(triton.cdiv(KP * P * G, _ROW_TILE),)](
        status, hit, plan["rows"], cache, resolved, window_blocks, block_table, R, MB,
        *reference_args(ref_cnt, free_queue), KP, P, G=G, TILE=_ROW_TILE)


from gpukv.kernels import capture  # noqa: E402

capture.count_launches(globals())
