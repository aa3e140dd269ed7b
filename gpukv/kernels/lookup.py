"""Prefix-cache lookup on the device: verify candidate hits, then admit.

Two kernels, run once per step over every new request of the step:

* ``_verify_kernel`` (parallel, one lane per (request, position, group)):
  a candidate block found by the hash table (or a block an earlier new request
  of the step will compute) is a hit only if its parent digest, extra-key
  digest and tokens equal the request's. Everything the comparison reads is
  already on the device: the request's tokens and digests in its row, the
  cached block's copy in the pool.
* ``_admit_kernel`` (one program, sequential over requests, parallel over
  positions): each request's hit is the first position that misses (a
  first-miss reduction), capped by the last-token rule; it needs its new blocks
  plus the free cached blocks it is the first of the step to hit; requests are
  admitted in order while their needs fit. This is the one place where the
  semantics are sequential (a request's admission depends on the earlier
  ones'), so it runs over requests, not blocks. In a model with both kinds
  of group it also reports each request's full-attention hit (what its
  full-attention groups alone serve); a request whose full-attention blocks
  past its hit the earlier requests' pops take is deferred, as one whose
  hit they take, and looked up again with the pops done.

The admission's cost: sequential over the step's K new requests (a request's
admission depends on the blocks the earlier ones took), parallel over each
one's positions: ``K * P * G / TILE`` iterations per fixpoint pass (one pass
for full attention, a few with windows), linear in the step's requests and
positions, plus the pending chains, walked only at the positions where a
group has no verified cached block (the reference looks for a pending hit
only where the cache misses). A walk at (i, p) stops at the first earlier
request that computes p's block and passes only earlier ones sharing it that
do not (they hit p, or their chunk stops short of it): at most i. So a step
whose requests all hit a cached shared prefix walks no chain (walking at
every position made that O(K^2 * P) per pass), and the cost grows with the
step, never with the pool.

No host synchronisation: counts arrive and leave as device tensors.
"""

from __future__ import annotations

from gpukv import _runtime  # noqa: F401  (sets TRITON_INTERPRET before triton loads)

import torch
import triton
import triton.language as tl

from gpukv.kernels.toolkit import (
    ADMIT_TILE,
    BIG,
    INDEX_DTYPES,
    INT32,
    INT64,
    PROBE_TILE,
    check_tensor,
    false_like,
    full_like,
    max_combine,
    zero_like,
)
from gpukv.kernels.block_hash import parent_digest
from gpukv.kernels.free_queue import HEAD, TAIL

# Layout of the admission outputs (``status``, int64).
ST_ADMITTED = 0  # requests admitted (a prefix of the candidates)
ST_USED = 1  # blocks the admitted requests take from the free queue (new + first touches)
ST_REQUESTS = 2  # stats: lookup attempts counted this step
ST_QUERIES = 3  # stats: blocks asked
ST_HITS = 4  # stats: blocks hit
ST_QUERY_TOKENS = 5  # stats: prompt tokens asked
ST_HIT_TOKENS = 6  # stats: tokens hit
ST_NEW_BLOCKS = 7  # blocks the admitted requests pop (their new blocks)
ST_DEFERRED = 8  # 1: the loop stopped before a request whose hit (or full-attention blocks) the earlier pops evict
ST_TOUCHES = 9  # first touches of the requests looked up and not deferred, admitted or not (a lookup's unheld blocks)
NUM_STATUS = 10

# Constexpr copies for the kernels: the real compiler reads only constexpr
# globals in a kernel (the interpreter reads any).
_ST_ADMITTED: tl.constexpr = tl.constexpr(ST_ADMITTED)
_ST_USED: tl.constexpr = tl.constexpr(ST_USED)
_ST_REQUESTS: tl.constexpr = tl.constexpr(ST_REQUESTS)
_ST_QUERIES: tl.constexpr = tl.constexpr(ST_QUERIES)
_ST_HITS: tl.constexpr = tl.constexpr(ST_HITS)
_ST_QUERY_TOKENS: tl.constexpr = tl.constexpr(ST_QUERY_TOKENS)
_ST_HIT_TOKENS: tl.constexpr = tl.constexpr(ST_HIT_TOKENS)
_ST_NEW_BLOCKS: tl.constexpr = tl.constexpr(ST_NEW_BLOCKS)
_ST_DEFERRED: tl.constexpr = tl.constexpr(ST_DEFERRED)
_ST_TOUCHES: tl.constexpr = tl.constexpr(ST_TOUCHES)
# "No request" / "no position": larger than any request index or block
# position (``toolkit.BIG``).
_BIG: tl.constexpr = tl.constexpr(BIG)


@triton.jit
def _row_inputs(digests_ptr, extras_ptr, r, p, M, mask, root_lo, root_hi):
    """Parent digest (the root for block 0) and extra digest of block ``p`` of
    request row ``r``, as lanes."""
    par_lo, par_hi = parent_digest(digests_ptr, r, p, M, mask, root_lo, root_hi)
    ext = (r * M + p) * 2
    ext_lo = tl.load(extras_ptr + ext, mask=mask, other=0)
    return par_lo, par_hi, ext_lo, tl.load(extras_ptr + ext + 1, mask=mask, other=0)


# Arguments that change from step to step (counts, stamps, widths) are
# ``do_not_specialize``: Triton would otherwise compile a variant per value
# class (== 1, divisible by 16) they fall in, a compile stall inside a step
# on a GPU (``tests/kernels/test_compile.py`` bounds the variants). Stamps
# and root-digest lanes are typed ``tl.int64``, so a stamp past 2**31 does
# not switch them from i32 to i64 either.
@triton.jit(do_not_specialize=["K", "root_lo", "root_hi"])
def _verify_kernel(
    cand_ptr,                              # int32[K] candidate blocks (FROM_POOL) or request rows; < 0: none
    row_ptr, pos_ptr,                      # int32/int64[K] the asking request row and block position
    out_ptr,                               # int32[K] out: the candidate where it verifies, else -1
    K,                                     # candidates
    tokens_ptr, T,                         # int32[R, T] request rows' tokens
    digests_ptr, extras_ptr, M,            # int64[R, M, 2] request rows' digests and extra digests
    root_lo: tl.int64, root_hi: tl.int64,  # the root digest lanes (block 0's parent)
    blk_tokens_ptr,                        # int32[N, BS] pool blocks' kept tokens (FROM_POOL)
    blk_parent_ptr, blk_extra_ptr,         # int64[N, 2] ... and their parent and extra digests
    FROM_POOL: tl.constexpr,               # candidates are pool blocks (else request rows)
    BS: tl.constexpr,                      # block size (tokens)
    BS_P2: tl.constexpr,                   # BS rounded up to a power of two (the token tile's width)
    TILE: tl.constexpr,                    # candidates per program (a power of two)
):
    """out[k] = cand[k] if that block (FROM_POOL) or that request row's block
    (not FROM_POOL) at position pos[k] was computed from exactly the inputs of
    row[k]'s block at pos[k]; else -1."""
    offs = tl.program_id(0) * TILE + tl.arange(0, TILE)
    lane = offs < K
    c = tl.load(cand_ptr + offs, mask=lane, other=-1)
    r = tl.load(row_ptr + offs, mask=lane, other=0).to(tl.int64)
    p = tl.load(pos_ptr + offs, mask=lane, other=0).to(tl.int64)
    ok = lane & (c >= 0)
    ok = inputs_equal(tl.where(ok, c, 0).to(tl.int64), r, p, ok, tokens_ptr, T, digests_ptr, extras_ptr, M,
                      root_lo, root_hi, blk_tokens_ptr, blk_parent_ptr, blk_extra_ptr, FROM_POOL, BS, BS_P2)
    tl.store(out_ptr + offs, tl.where(ok, c, -1), mask=lane)


@triton.jit
def inputs_equal(c64, r, p, ok, tokens_ptr, T, digests_ptr, extras_ptr, M, root_lo, root_hi,
                 blk_tokens_ptr, blk_parent_ptr, blk_extra_ptr, FROM_POOL: tl.constexpr, BS: tl.constexpr,
                 BS_P2: tl.constexpr):
    """``ok`` where block ``p`` of request row ``r`` (int64 lanes) has exactly
    the inputs (parent digest, extra digest, tokens) of pool block ``c64``
    (``FROM_POOL``: its kept copy) or of block ``p`` of request row ``c64``.
    Shared by ``_verify_kernel`` and the admission's lookup and chains
    (``gpukv.kernels.prefill``)."""
    par_lo, par_hi, ext_lo, ext_hi = _row_inputs(digests_ptr, extras_ptr, r, p, M, ok, root_lo, root_hi)
    cols = tl.arange(0, BS_P2)
    mask2 = ok[:, None] & (cols < BS)[None, :]
    mine = tl.load(tokens_ptr + (r * T + p * BS)[:, None] + cols[None, :], mask=mask2, other=0)
    if FROM_POOL:
        o_par_lo = tl.load(blk_parent_ptr + c64 * 2, mask=ok, other=0)
        o_par_hi = tl.load(blk_parent_ptr + c64 * 2 + 1, mask=ok, other=0)
        o_ext_lo = tl.load(blk_extra_ptr + c64 * 2, mask=ok, other=0)
        o_ext_hi = tl.load(blk_extra_ptr + c64 * 2 + 1, mask=ok, other=0)
        theirs = tl.load(blk_tokens_ptr + (c64 * BS)[:, None] + cols[None, :], mask=mask2, other=0)
    else:
        o_par_lo, o_par_hi, o_ext_lo, o_ext_hi = _row_inputs(digests_ptr, extras_ptr, c64, p, M, ok, root_lo, root_hi)
        theirs = tl.load(tokens_ptr + (c64 * T + p * BS)[:, None] + cols[None, :], mask=mask2, other=0)
    same_tokens = tl.min(tl.where(mask2, (mine == theirs).to(tl.int32), 1), axis=1) == 1
    return ok & same_tokens & (par_lo == o_par_lo) & (par_hi == o_par_hi) & (ext_lo == o_ext_lo) & \
        (ext_hi == o_ext_hi)


def verify(cand, row, pos, *, tokens, digests, extras, root, block_size: int, blk_tokens=None, blk_parent=None,
           blk_extra=None, from_pool: bool, tile: int = PROBE_TILE) -> torch.Tensor:
    """Keep the candidates that verify (see ``_verify_kernel``); -1 elsewhere.

    ``cand``/``row``/``pos``: int32[K]. ``tokens``: int32[R, T] request rows;
    ``digests``/``extras``: int64[R, M, 2] (one layout); ``root``: (lo, hi) ints of the root
    digest. With ``from_pool`` the candidates are pool blocks whose copies are
    in ``blk_tokens`` int32[N, bs], ``blk_parent``/``blk_extra`` int64[N, 2];
    else they are request rows of the same tensors.
    """
    check_tensor(cand, "cand", dtypes=INT32)
    check_tensor(row, "row", dtypes=INDEX_DTYPES)
    check_tensor(pos, "pos", dtypes=INDEX_DTYPES)
    check_tensor(tokens, "tokens", dtypes=INT32, ndim=2)
    check_tensor(digests, "digests", dtypes=INT64, ndim=3)
    check_tensor(extras, "extras", dtypes=INT64, ndim=3)
    if from_pool and blk_tokens is not None:
        check_tensor(blk_tokens, "blk_tokens", dtypes=INT32, ndim=2)
        check_tensor(blk_parent, "blk_parent", dtypes=INT64)
        check_tensor(blk_extra, "blk_extra", dtypes=INT64)
    K = cand.numel()
    out = torch.empty_like(cand)
    if K == 0:
        return out
    R, T = tokens.shape
    M = digests.shape[1]
    if extras.shape != digests.shape:
        raise ValueError(f"extras {tuple(extras.shape)} and digests {tuple(digests.shape)} must share one layout")
    bs = block_size
    if from_pool and blk_tokens is None:
        raise ValueError("verify(from_pool=True) needs blk_tokens, blk_parent and blk_extra")
    dummy = digests
    _verify_kernel[(triton.cdiv(K, tile),)](
        cand, row, pos, out, K, tokens, T, digests, extras, M, root[0], root[1],
        blk_tokens if from_pool else tokens, blk_parent if from_pool else dummy, blk_extra if from_pool else dummy,
        FROM_POOL=from_pool, BS=bs, BS_P2=triton.next_power_of_2(bs), TILE=tile,
    )
    return out


@triton.jit
def _pending(pend_ptr, next_ptr, ok_ptr, hit_ptr, comp_ptr, i, P, p, inr, BS):
    """Per position ``p``: whether an earlier request of the step computes a
    block with request ``i``'s digest there (it did not hit it itself, and its
    chunk ``comp`` covers the whole block, so it caches it), and which.
    Entries are (request j, position p) at ``j * P + p``; ``pend[i, p]`` is
    the first entry of the chain of entries with that (digest, position) in
    request order; ``next``/``ok`` per entry: the next one, whether its
    inputs equal the chain's first."""
    ent = tl.load(pend_ptr + i * P + p, mask=inr, other=-1)
    found = false_like(ent)
    who = full_like(found, -1)  # int32 lanes: no request
    searching = ent >= 0
    while tl.max(searching.to(tl.int32)) > 0:
        es = tl.where(searching, ent, 0)
        c = tl.where(searching, es // P, _BIG)
        earlier = searching & (c < i)
        he = tl.load(hit_ptr + tl.where(earlier, c, 0), mask=earlier, other=_BIG)
        ce = tl.load(comp_ptr + tl.where(earlier, c, 0), mask=earlier, other=0)
        here = earlier & (he <= p) & (p < ce // BS)
        same = tl.load(ok_ptr + es, mask=here, other=0) != 0
        found = found | (here & same)
        who = tl.where(here & same, c, who)
        stop = (searching == 0) | (c >= i) | here
        ent = tl.where(stop, -1, tl.load(next_ptr + es, mask=searching & (stop == 0), other=-1))
        searching = ent >= 0
    return found, who


@triton.jit
def _available(cache_ptr, pend_ptr, next_ptr, ok_ptr, hit_ptr, comp_ptr, i, P, p, limit, g, BS,
               G: tl.constexpr):
    """Whether request ``i`` can hit position ``p`` (< ``limit``) in group
    ``g``: a verified cached block, or (only looked for where there is none,
    as the reference's ``block_at``) a block an earlier request computes. The
    pending chains are walked only at cache misses: where every request of the
    step hits a cached shared prefix, no chain is walked at all."""
    inr = p < limit
    c = tl.load(cache_ptr + (i * P + p) * G + g, mask=inr, other=-1)
    pending, _ = _pending(pend_ptr, next_ptr, ok_ptr, hit_ptr, comp_ptr, i, P, p, inr & (c < 0), BS)
    return inr & ((c >= 0) | pending)


@triton.jit
def _group_hit(cache_ptr, pend_ptr, next_ptr, ok_ptr, hit_ptr, comp_ptr, i, P, limit, g, W, BS,
               G: tl.constexpr, TILE: tl.constexpr):
    """The longest hit (<= ``limit`` blocks) group ``g`` can serve. Full
    attention (``W < 0``): its first miss. Sliding window of ``W`` blocks: the
    end of the rightmost run of ``W`` available blocks, or the leading run when
    it is longer (it reaches block 0, where the window needs nothing earlier)."""
    lanes = tl.arange(0, TILE)
    first_miss = limit
    last_end = tl.zeros((), tl.int32)
    carry = tl.full((), -1, tl.int32)  # the last miss before this tile
    for p0 in range(0, P, TILE):
        p = p0 + lanes
        inr = p < limit
        avail = _available(cache_ptr, pend_ptr, next_ptr, ok_ptr, hit_ptr, comp_ptr, i, P, p, limit, g, BS, G)
        miss = inr & (avail == 0)
        first_miss = tl.minimum(first_miss, tl.min(tl.where(miss, p, _BIG)))
        last_miss = tl.maximum(tl.associative_scan(tl.where(miss, p, -1), 0, max_combine), carry)
        window_ok = inr & (p - last_miss >= W)
        last_end = tl.maximum(last_end, tl.max(tl.where(window_ok, p + 1, 0)))
        carry = tl.maximum(carry, tl.max(tl.where(miss, p, -1)))
    if W < 0:
        out = first_miss
    else:
        out = tl.maximum(last_end, first_miss)
    return tl.minimum(out, limit)


@triton.jit
def _cached_hit(cache_ptr, win_ptr, i, P, p, hit, g, G: tl.constexpr):
    """Request ``i``'s cached hit block at positions ``p`` of group ``g``, and
    where it is real: inside the hit, a verified cache block, and for a window
    group among the last W positions of the hit (before them: the null block)."""
    W = tl.load(win_ptr + g)
    lo = tl.where(W < 0, 0, tl.maximum(hit - W, 0))
    inh = (p < hit) & (p >= lo)
    c = tl.load(cache_ptr + (i * P + p) * G + g, mask=inh, other=-1)
    return c, inh & (c >= 0)


@triton.jit
def _extend_reach(ring_ptr, touched_ptr, stamp, reach, tail, doomed, want, CMASK, TILE: tl.constexpr):
    """Move ``reach`` forward over the free queue until ``want`` live entries
    no admitted request touched lie before it (``doomed`` counts those
    already passed); returns the new (reach, doomed). Entries touched by
    this admission are taken out before the pops that follow their toucher,
    so the pops pass over them, as over tombstones."""
    lanes = tl.arange(0, TILE)
    while (doomed < want) & (reach < tail):
        offs = reach + lanes
        inwin = offs < tail
        e = tl.load(ring_ptr + (offs & CMASK), mask=inwin, other=-1)
        live = e >= 0
        tt = tl.load(touched_ptr + tl.where(live, e, 0), mask=live, other=stamp)
        li = (live & (tt != stamp)).to(tl.int64)
        rank = doomed + tl.cumsum(li, 0) - li
        take = (li != 0) & (rank < want)
        doomed += tl.sum(take.to(tl.int64), 0)
        last = tl.max(tl.where(take, offs, -1), 0)
        reach = tl.where(doomed >= want, last + 1, tl.minimum(reach + TILE, tail))
    return reach, doomed


@triton.jit
def _groups_bound(cache_ptr, pend_ptr, next_ptr, ok_ptr, hit_ptr, comp_ptr, win_ptr, i, P, hit, below, BS,
                  G: tl.constexpr, TILE: tl.constexpr):
    """``hit`` bounded, in one pass over request ``i``'s groups in order, by
    the longest hit each group whose window (blocks, -1: full attention) is
    below ``below`` can serve within the bound so far (``_BIG``: every
    group; 0: the full-attention groups, whose first misses need one pass)."""
    for g in tl.static_range(G):
        window = tl.load(win_ptr + g)
        if window < below:
            hit = tl.minimum(hit, _group_hit(cache_ptr, pend_ptr, next_ptr, ok_ptr, hit_ptr, comp_ptr, i, P,
                                             hit, g, window, BS, G, TILE))
    return hit


@triton.jit
def _request_hit(cache_ptr, pend_ptr, next_ptr, ok_ptr, hit_ptr, comp_ptr, win_ptr, i, P, max_hit, skip, BS,
                 G: tl.constexpr, TILE: tl.constexpr):
    """Request ``i``'s hit (blocks): the longest every group can serve, at
    most ``max_hit`` (0 where the request skips the cache). A fixpoint,
    since a window group's run depends on the bound the other groups set:
    one pass for full attention, a few with windows."""
    hit = tl.where(skip != 0, 0, max_hit)
    prev = hit + 1
    while hit != prev:
        prev = hit
        hit = _groups_bound(cache_ptr, pend_ptr, next_ptr, ok_ptr, hit_ptr, comp_ptr, win_ptr, i, P, hit, _BIG, BS,
                            G, TILE)
    return hit


@triton.jit
def _full_attention_evicted(cache_ptr, win_ptr, ref_ptr, touched_ptr, qpos_ptr, stamp, i, P, hit, longest, reach,
                            G: tl.constexpr, TILE: tl.constexpr):
    """Whether the earlier requests' pops (the free-queue entries before
    ``reach``) take one of request ``i``'s full-attention blocks past its
    ``hit`` and below ``longest`` (a free cached block no admitted request
    touched). vLLM looks the request up after those pops, when another copy
    of the block, or an earlier request's, may serve the position or none
    does: the admission defers it, as for its hit's own blocks, and the next
    round looks it up with the pops done."""
    lanes = tl.arange(0, TILE)
    taken = tl.zeros((), tl.int32)
    for p0 in range(0, P, TILE):
        p = p0 + lanes
        past = (p >= hit) & (p < longest)
        for g in tl.static_range(G):
            full = (zero_like(p) + tl.load(win_ptr + g)) < 0  # (the group's kind on every lane: a mask's shape)
            c = tl.load(cache_ptr + (i * P + p) * G + g, mask=past & full, other=-1)
            real = c >= 0
            cs = tl.where(real, c, 0)
            free = real & (tl.load(ref_ptr + cs, mask=real, other=1) == 0)
            untouched = free & (tl.load(touched_ptr + cs, mask=free, other=stamp) != stamp)
            q = tl.load(qpos_ptr + cs, mask=untouched, other=-1)
            taken = tl.maximum(taken, tl.max((untouched & (q >= 0) & (q < reach)).to(tl.int32)))
    return taken != 0


@triton.jit
def _first_touches(cache_ptr, win_ptr, ref_ptr, touched_ptr, qpos_ptr, stamp, i, P, hit, tail, G: tl.constexpr,
                   TILE: tl.constexpr):
    """Request ``i``'s first touches: its free cached hits (reference count
    0) that no earlier request of this admission touched (``touched !=
    stamp``; a window group holds real blocks only for its last W hit
    positions). Returns their count and the front-most free-queue position
    among them (``tail`` where none is queued)."""
    lanes = tl.arange(0, TILE)
    touches = tl.zeros((), tl.int64)
    first_pos = tail
    for p0 in range(0, P, TILE):
        p = p0 + lanes
        for g in tl.static_range(G):
            c, real = _cached_hit(cache_ptr, win_ptr, i, P, p, hit, g, G)
            cs = tl.where(real, c, 0)
            rc = tl.load(ref_ptr + cs, mask=real, other=1)
            tt = tl.load(touched_ptr + cs, mask=real, other=stamp)
            first = real & (rc == 0) & (tt != stamp)
            touches += tl.sum(first.to(tl.int64))
            q = tl.load(qpos_ptr + cs, mask=first, other=-1)
            first_pos = tl.minimum(first_pos, tl.min(tl.where(q >= 0, q, tail), 0))
    return touches, first_pos


@triton.jit
def _hit_evicted(ring_ptr, touched_ptr, stamp, reach, tail, doomed, new_total, first_pos, CMASK,
                 TILE: tl.constexpr):
    """Whether the earlier admitted requests' pops evict a first touch at
    free-queue position ``first_pos``, and the new (``reach``, ``doomed``).
    vLLM allocates (pops) for a request before it looks the next one up, so a
    free cached block the earlier requests' pops take is no hit for a later
    one. ``reach`` is just past the ``new_total``-th live entry from the head
    that no admitted request touched; it is extended lazily, only for a
    request with a queued first touch (``first_pos < tail``), so the scan is
    bounded by the pops and the tombstones they pass, as ``pop``'s own."""
    if first_pos < tail:
        reach, doomed = _extend_reach(ring_ptr, touched_ptr, stamp, reach, tail, doomed, new_total, CMASK, TILE)
    return first_pos < reach, reach, doomed


@triton.jit
def _charge(comp_ptr, num_tokens_ptr, lookahead_ptr, i, hit, budget, budget_left, BS, G: tl.constexpr):
    """Request ``i``'s chunk past its hit, as vLLM's waiting loop counts it:
    ``new = min(num_tokens - hit * BS, comp, budget left)`` tokens (no
    budget where ``budget < 0``); ``comp[i]`` is overwritten with ``hit * BS
    + new`` (later requests' ``_pending`` read it: only the full blocks of
    those tokens are ones they can hit before they are cached, as vLLM
    caches them at allocation). Returns ``new`` and the blocks it allocates
    over all groups, ``(ceil((hit * BS + new + lookahead) / BS) - hit) * G``."""
    n_tok = tl.load(num_tokens_ptr + i).to(tl.int64)
    comp = tl.load(comp_ptr + i).to(tl.int64)
    lookahead = tl.load(lookahead_ptr + i).to(tl.int64)
    hit64 = hit.to(tl.int64)
    new = tl.minimum(n_tok - hit64 * BS, comp)
    new = tl.where(budget >= 0, tl.minimum(new, budget_left), new)
    comp = hit64 * BS + new
    tl.store(comp_ptr + i, comp.to(tl.int32))
    n_alloc = (comp + lookahead + BS - 1) // BS
    return new, (n_alloc - hit64) * G


@triton.jit
def _count_lookup(requests, queries, hits, qtok, htok, num_blocks_ptr, num_tokens_ptr, i, skip, hit, BS):
    """The step's lookup stats (requests, blocks asked, blocks hit, tokens
    asked, tokens hit) with request ``i``'s lookup added; a request that
    skips the cache asks nothing."""
    n_blocks = tl.load(num_blocks_ptr + i).to(tl.int64)
    n_tok = tl.load(num_tokens_ptr + i).to(tl.int64)
    hit64 = hit.to(tl.int64)
    return (requests + 1, queries + tl.where(skip != 0, 0, n_blocks), hits + hit64,
            qtok + tl.where(skip != 0, 0, n_tok), htok + hit64 * BS)


@triton.jit
def _mark_admitted(cache_ptr, pend_ptr, next_ptr, ok_ptr, hit_ptr, comp_ptr, win_ptr, resolved_ptr, touched_ptr,
                   stamp, i, P, hit, BS, G: tl.constexpr, TILE: tl.constexpr):
    """For admitted request ``i``: ``resolved[i, p]``, the earlier request
    whose block a pending hit takes where a group has no cached block
    (``_place_hits_kernel`` reads it only there), -1 elsewhere; and its
    cached hit blocks marked touched by this admission (``stamp``)."""
    lanes = tl.arange(0, TILE)
    for p0 in range(0, P, TILE):
        p = p0 + lanes
        miss = false_like(p)
        for g in tl.static_range(G):
            cg = tl.load(cache_ptr + (i * P + p) * G + g, mask=p < hit, other=-1)
            miss = miss | (cg < 0)
        _, who = _pending(pend_ptr, next_ptr, ok_ptr, hit_ptr, comp_ptr, i, P, p, (p < hit) & miss, BS)
        tl.store(resolved_ptr + i * P + p, who, mask=p < P)
        for g in tl.static_range(G):
            c, real = _cached_hit(cache_ptr, win_ptr, i, P, p, hit, g, G)
            tl.store(touched_ptr + tl.where(real, c, 0), stamp + zero_like(c).to(tl.int64), mask=real)


@triton.jit
def _admit_requests(cache_ptr, pend_ptr, next_ptr, ok_ptr, resolved_ptr, start_ptr, max_hit_ptr, num_blocks_ptr,
                    num_tokens_ptr, comp_ptr, lookahead_ptr, skip_ptr, win_ptr, K, P, ref_ptr, touched_ptr, stamp,
                    num_free, go, budget, hit_ptr, full_ptr, ring_ptr, qpos_ptr, reach, tail, CMASK, BS,
                    G: tl.constexpr, TILE: tl.constexpr, FULL: tl.constexpr):
    """vLLM's waiting loop over requests ``0..K-1`` (none with ``go ==
    0``), in order: stop before a request when the budget is spent (it is
    not looked up); else look it up (``_request_hit``); stop before it,
    deferred (hit -1, nothing counted), when an earlier request's pops
    evict one of its first touches (``_hit_evicted``); else charge its chunk
    (``_charge``), count its lookup and store its hit, and admit it
    (``start[i]``, ``_mark_admitted``) while its new blocks and first
    touches fit the ``num_free`` free blocks; past the first refused or
    deferred request, hit -1. With ``FULL``, each request looked up and not
    deferred also gets its full-attention hit in ``full[i]`` (its hit where
    it skips the cache); an earlier pop that takes one of its full-attention
    blocks past its hit defers it too (``_full_attention_evicted``). Returns (deferred, admitted, blocks used,
    the five lookup stats, new blocks popped, first touches of the requests
    charged: admitted or refused for room)."""
    used, new_total, admitted = tl.zeros((), tl.int64), tl.zeros((), tl.int64), tl.zeros((), tl.int64)
    looked_touches = tl.zeros((), tl.int64)
    deferred, doomed, budget_left = tl.zeros((), tl.int64), tl.zeros((), tl.int64), budget
    requests, queries, hits = tl.zeros((), tl.int64), tl.zeros((), tl.int64), tl.zeros((), tl.int64)
    qtok, htok = tl.zeros((), tl.int64), tl.zeros((), tl.int64)
    for i in range(0, K):
        if (budget >= 0) & (budget_left <= 0):
            go = zero_like(go)  # the budget is spent: vLLM's loop ends before this request
        if go != 0:
            skip = tl.load(skip_ptr + i)
            hit = _request_hit(cache_ptr, pend_ptr, next_ptr, ok_ptr, hit_ptr, comp_ptr, win_ptr, i, P,
                               tl.load(max_hit_ptr + i), skip, BS, G, TILE)
            touches, first_pos = _first_touches(cache_ptr, win_ptr, ref_ptr, touched_ptr, qpos_ptr, stamp, i, P,
                                                hit, tail, G, TILE)
            evicted, reach, doomed = _hit_evicted(ring_ptr, touched_ptr, stamp, reach, tail, doomed, new_total,
                                                  first_pos, CMASK, TILE)
            longest = hit
            if FULL:
                if skip == 0:
                    # (the full-attention groups' own hit: their windowed groups left out)
                    longest = _groups_bound(cache_ptr, pend_ptr, next_ptr, ok_ptr, hit_ptr, comp_ptr, win_ptr, i, P,
                                            tl.load(max_hit_ptr + i), 0, BS, G, TILE)
                if (longest > hit) & (new_total > 0):  # (past the hit, the earlier pops may take its blocks)
                    reach, doomed = _extend_reach(ring_ptr, touched_ptr, stamp, reach, tail, doomed, new_total,
                                                  CMASK, TILE)
                    evicted = evicted | _full_attention_evicted(cache_ptr, win_ptr, ref_ptr, touched_ptr, qpos_ptr,
                                                                stamp, i, P, hit, longest, reach, G, TILE)
            if evicted:  # an earlier request's pop evicts this hit: vLLM would look it up after
                go = zero_like(go)
                deferred += 1
                tl.store(hit_ptr + i, -1)
            else:
                if FULL:
                    tl.store(full_ptr + i, longest)
                new, n_new = _charge(comp_ptr, num_tokens_ptr, lookahead_ptr, i, hit, budget, budget_left, BS, G)
                looked_touches += touches
                requests, queries, hits, qtok, htok = _count_lookup(requests, queries, hits, qtok, htok,
                                                                    num_blocks_ptr, num_tokens_ptr, i, skip, hit, BS)
                tl.store(hit_ptr + i, hit)
                need = n_new + touches
                if used + need <= num_free:
                    tl.store(start_ptr + i, new_total.to(tl.int32))
                    used += need
                    new_total += n_new
                    budget_left -= new
                    admitted += 1
                    _mark_admitted(cache_ptr, pend_ptr, next_ptr, ok_ptr, hit_ptr, comp_ptr, win_ptr, resolved_ptr,
                                   touched_ptr, stamp, i, P, hit, BS, G, TILE)
                else:
                    go = zero_like(go)
                tl.debug_barrier()  # later requests read this request's hit (and touch marks)
        else:  # not considered (an earlier one was refused or deferred): no hit
            tl.store(hit_ptr + i, -1)
    return deferred, admitted, used, requests, queries, hits, qtok, htok, new_total, looked_touches


@triton.jit
def _store_status(status_ptr, deferred, admitted, used, requests, queries, hits, qtok, htok, new_total,
                  looked_touches):
    """The admission's counts into ``status`` (layout ``ST_*``)."""
    tl.store(status_ptr + _ST_DEFERRED, deferred)
    tl.store(status_ptr + _ST_ADMITTED, admitted)
    tl.store(status_ptr + _ST_USED, used)
    tl.store(status_ptr + _ST_REQUESTS, requests)
    tl.store(status_ptr + _ST_QUERIES, queries)
    tl.store(status_ptr + _ST_HITS, hits)
    tl.store(status_ptr + _ST_QUERY_TOKENS, qtok)
    tl.store(status_ptr + _ST_HIT_TOKENS, htok)
    tl.store(status_ptr + _ST_NEW_BLOCKS, new_total)
    tl.store(status_ptr + _ST_TOUCHES, looked_touches)


@triton.jit(do_not_specialize=["P", "CMASK"])
def _admit_kernel(
    cache_ptr,          # int32[K, P, G] verified cached hit block per (request, position, group), or -1
    pend_ptr,           # int32[K, P] the chain head entry (j * P + p) of each position, or -1 (``_pending``)
    next_ptr,           # int32[K * P] per entry, the next entry of its chain, or -1
    ok_ptr,             # int32[K * P] per entry, 1 where its inputs equal its chain head's
    resolved_ptr,       # int32[K, P] out (admitted requests): the earlier request a pending hit takes, or -1
    start_ptr,          # int32[K] out (admitted requests): its first new block in the step's pop order
    max_hit_ptr,        # int32[K] the longest hit each request may get (blocks)
    num_blocks_ptr,     # int32[K] each request's prompt blocks (stats)
    num_tokens_ptr,     # int32[K] each request's prompt tokens (stats)
    comp_ptr,           # int32[K] in: each request's chunk, the most tokens it computes beyond its hit;
                        # out (considered requests): the tokens it has computed after this step (hit included)
    lookahead_ptr,      # int32[K] each request's lookahead slots
    budget_ptr,         # int32[1] the step's token budget for new requests (vLLM's token_budget), < 0: none
    skip_ptr,           # int32[K] != 0: the request skips the prefix cache (no hit, not counted as asked)
    win_ptr,            # int32[G] each group's sliding window in blocks, -1 for full attention
    nreq_ptr,           # int32[1] the requests K (read on the device: the launch is replayable)
    P,                  # positions per request of cache/pend/resolved
    ref_ptr,            # int32[N] blocks' reference counts (a free cached hit is a first touch)
    touched_ptr,        # int64[N] per block, the stamp of the last admission that touched it (written)
    stamp_ptr,          # int64[1] this admission's stamp (read, then bumped)
    free_ptr,           # int32/int64[1] the free blocks
    blocked_ptr,        # int32/int64[1] != 0: a running update failed, admit nothing
    hit_ptr,            # int32[K] out: each considered request's hit (blocks), -1 past the first refused
    full_ptr,           # int32[K] out (``FULL``): each request's full-attention hit (blocks), where looked up
    status_ptr,         # int64[NUM_STATUS] out: the step's counts, ``ST_*``
    ring_ptr,           # int32[C] the free queue's ring (``free_queue``: -1 empty or tombstone)
    qpos_ptr,           # int64[N] each block's absolute position in the ring, -1 when not queued
    qctr_ptr,           # int64[>= 2] the free queue's counters (HEAD, TAIL read)
    CMASK,              # C - 1: absolute position q lives in slot q & CMASK
    BS,                 # block size (tokens)
    G: tl.constexpr,    # KV-cache groups
    TILE: tl.constexpr,  # positions per step (a power of two)
    FULL: tl.constexpr,  # report each request's full-attention hit (a model with both kinds of group)
):
    """Sequential admission: one program, so deterministic. vLLM's waiting
    loop over the step's requests in order (``_admit_requests``), each one's
    hit the first miss of every group (``cache[K, P, G]`` the verified
    cached hits, ``pend``/``next``/``ok`` the chains of the step's requests
    sharing a block, walked only where the cache misses), its first touches
    evicted or not by the earlier pops in the free queue's order (then
    ``status[ST_DEFERRED] = 1`` and the rest is looked up again after this
    admission's pops: ``DeviceManager._step``), admitted while its blocks fit.
    Writes ``hit`` (-1 past the first refused or deferred request, and for
    every request with ``blocked[0] != 0``, which admits and counts
    nothing), with ``FULL`` ``full`` (each request looked up and not
    deferred), ``comp``, ``resolved``, ``start``, ``touched`` and ``status``.
    ``nreq[0]`` (K) and ``stamp[0]`` (this launch's mark in ``touched``,
    bumped at the end) are read on the device, so the launch's arguments
    never change from step to step (it can be replayed). Cost: see the
    module docstring."""
    stamp = tl.load(stamp_ptr)
    deferred, admitted, used, requests, queries, hits, qtok, htok, new_total, touches = _admit_requests(
        cache_ptr, pend_ptr, next_ptr, ok_ptr, resolved_ptr, start_ptr, max_hit_ptr, num_blocks_ptr, num_tokens_ptr,
        comp_ptr, lookahead_ptr, skip_ptr, win_ptr, tl.load(nreq_ptr), P, ref_ptr, touched_ptr, stamp,
        tl.load(free_ptr).to(tl.int64), (tl.load(blocked_ptr) == 0).to(tl.int32), tl.load(budget_ptr).to(tl.int64),
        hit_ptr, full_ptr, ring_ptr, qpos_ptr, tl.load(qctr_ptr + HEAD), tl.load(qctr_ptr + TAIL), CMASK, BS, G, TILE,
        FULL)
    tl.store(stamp_ptr, stamp + 1)
    _store_status(status_ptr, deferred, admitted, used, requests, queries, hits, qtok, htok, new_total, touches)


def _direct_chains(pending: torch.Tensor, K: int, P: int, dev) -> tuple:
    """``admit``'s chains where ``pending[K, P]`` names the earlier request
    directly: a chain of one entry per position."""
    check_tensor(pending, "pending", dtypes=INT32, ndim=2)
    pos = torch.arange(P, dtype=torch.int32, device=dev)
    return (torch.where(pending >= 0, pending * P + pos, torch.full_like(pending, -1)).to(torch.int32),
            torch.full((K * P,), -1, dtype=torch.int32, device=dev),
            torch.ones(K * P, dtype=torch.int32, device=dev))


def _device_int(value, dtype, dev) -> torch.Tensor:
    """``value`` as a 1-element device tensor (a tensor is kept as given)."""
    if isinstance(value, torch.Tensor):
        return value
    return torch.full((1,), int(value), dtype=dtype, device=dev)


def _check_admit_tensors(int32: tuple, int64: tuple, num_free, blocked) -> None:
    """``admit``'s dtype checks, in its argument order: ``(tensor, name)``
    pairs of int32 and of int64 tensors, then the two counts."""
    for t, name in int32:
        check_tensor(t, name, dtypes=INT32)
    for t, name in int64:
        check_tensor(t, name, dtypes=INT64)
    check_tensor(num_free, "num_free", dtypes=INDEX_DTYPES)
    check_tensor(blocked, "blocked", dtypes=INDEX_DTYPES)


def _queue_tensors(free_queue, num_blocks: int, dev) -> tuple:
    """The free queue's ring, positions and counters; without a queue, an
    empty one: no block is queued, so no pop evicts a hit."""
    if free_queue is not None:
        return free_queue.ring, free_queue.pos, free_queue.counters
    return (torch.full((1,), -1, dtype=torch.int32, device=dev),
            torch.full((num_blocks,), -1, dtype=torch.int64, device=dev),
            torch.zeros(2, dtype=torch.int64, device=dev))


def admit(cache_hits, pending, max_hit, num_blocks, num_tokens, skip, *, ref_cnt, touched, stamp,
          num_free, blocked, block_size: int, hit_out, status, window_blocks=None, chains=None, resolved=None,
          start=None, compute=None, lookahead=None, num_requests=None, token_budget=None, free_queue=None,
          full_hit_out=None, tile: int = ADMIT_TILE) -> None:
    """Run the sequential admission (see ``_admit_kernel``) over the first
    ``num_requests`` (an int or an int32[1] device tensor; default: all K)
    requests; writes each considered
    request's hit (blocks) to ``hit_out`` and the step's counts to ``status``
    (layout ``ST_*``). All arguments are device tensors but the ints;
    ``num_free`` and ``blocked`` are 1-element tensors; ``window_blocks``
    int32[G] (-1 = full attention, the default for every group). ``chains``:
    (head int32[K, P], next int32[K * P], ok int32[K * P]), the chains of
    requests sharing a block (``gpukv.kernels.prefill``; ``pending`` is then
    unused); without it, ``pending[K, P]`` names the earlier request
    directly. ``compute``/``lookahead`` int32[K]: each request's chunk (the
    most tokens it computes beyond its hit; overwritten with the tokens it
    has computed) and lookahead slots; by default the whole prompt and none.
    ``token_budget``: the step's budget for new requests (an int or an
    int32[1] device tensor; None or < 0: none). ``resolved`` int32[K, P] and ``start`` int32[K] receive the
    pending hits' requests and each admitted request's first new block in the
    step's pop order. ``stamp``: an int64[1] device counter (or an int, for
    a one-off call) of admissions, bumped by this one. ``free_queue``: the
    pool's ``FreeQueue``, whose order decides which hits the admitted
    requests' pops evict (``ST_DEFERRED``); None: no cached hit is free, or
    nothing is evicted (a kernel test's pool without a queue).
    ``full_hit_out`` int32[K] receives each looked-up request's
    full-attention hit (``_groups_bound`` over those groups; a request whose
    full-attention blocks past its hit the earlier pops take is deferred);
    None: not computed."""
    check_tensor(cache_hits, "cache_hits", dtypes=INT32, ndim=3)
    K, P, G = cache_hits.shape
    dev = cache_hits.device
    if compute is None:
        compute = num_tokens.clone()  # (written: the tokens computed)
    token_budget = _device_int(-1 if token_budget is None else token_budget, torch.int32, dev)
    if lookahead is None:
        lookahead = torch.zeros_like(num_tokens)
    if window_blocks is None:
        window_blocks = torch.full((G,), -1, dtype=torch.int32, device=dev)
    head, nxt, ok = _direct_chains(pending, K, P, dev) if chains is None else chains
    if resolved is None:
        resolved = torch.empty((K, P), dtype=torch.int32, device=dev)
    if start is None:
        start = torch.empty(K, dtype=torch.int32, device=dev)
    stamp = _device_int(stamp, torch.int64, dev)
    num_requests = _device_int(K if num_requests is None else num_requests, torch.int32, dev)
    _check_admit_tensors(
        ((head, "chains[0]"), (nxt, "chains[1]"), (ok, "chains[2]"), (resolved, "resolved"), (start, "start"),
         (max_hit, "max_hit"), (num_blocks, "num_blocks"), (num_tokens, "num_tokens"), (compute, "compute"),
         (lookahead, "lookahead"), (token_budget, "token_budget"), (skip, "skip"), (window_blocks, "window_blocks"),
         (num_requests, "num_requests"), (ref_cnt, "ref_cnt"), (hit_out, "hit_out"),
         *(() if full_hit_out is None else ((full_hit_out, "full_hit_out"),))),
        ((touched, "touched"), (stamp, "stamp"), (status, "status")), num_free, blocked)
    ring, qpos, qctr = _queue_tensors(free_queue, ref_cnt.numel(), dev)
    _admit_kernel[(1,)](
        cache_hits, head, nxt, ok, resolved, start, max_hit, num_blocks, num_tokens, compute, lookahead, token_budget,
        skip, window_blocks, num_requests, P, ref_cnt, touched, stamp, num_free, blocked, hit_out,
        hit_out if full_hit_out is None else full_hit_out, status, ring, qpos, qctr, ring.numel() - 1, block_size, G=G,
        TILE=tile, FULL=full_hit_out is not None,
    )


from gpukv.kernels import capture  # noqa: E402

capture.count_launches(globals())
