"""The batched decode step's device planning: which running requests fit, and
the entries every later kernel of the step reads.

A decode step (``DeviceManager.decode``) gives each of B running requests
up to ``K`` new tokens (``nnew`` of them for row i; K may be 0: the rows only
continue a chunked prefill) and computes some of their known tokens. The
host knows each request's counts exactly and uploads int32 arrays of the
bucket's fixed length ``BP`` (rows padded to a power of two): ``rows`` (-1
for padding), ``ntok`` (known tokens before the step), ``nnew`` (new tokens,
at most K), ``comp0``/``comp1`` (computed tokens before and after),
``held`` (block positions held per group before), ``need`` (new blocks per
group) and ``cum`` (the running total of blocks the requests need, all
groups; padding holds ``BIG``, so it never fits). What only the device knows
is the free count after this step's window releases, hence how many
requests, in order, get their blocks. ``decode_fit`` decides that and writes
every entry array of the step, masked past the fit, so every launch of the
step has a shape fixed by the bucket and no host-dependent branch (a CUDA
graph can replay it):

* per row (``[BP]``): ``hash_start`` = its first known block that becomes
  full, ``hash_count`` = how many do (0 past the fit);
* per (row, group, a < A) entry, row-major (``[BP * G * A]``, A = the most
  new blocks a row needs per group, a bucket size): allocation entries
  ``alloc_group/row/pos/want/rank`` at positions ``held + a`` (``rank`` =
  wanted entries before it: ``cum[i] - need[i] * G + g * need[i] + a``, no
  scan needed);
* per (row, group, c < C) entry (``[BP * G * C]``, C = the most blocks a row
  fills with computed tokens, a bucket size): caching entries
  ``record_group/row/pos/valid`` at positions ``comp0 // BS + c``;
* the new tokens into the rows of the requests that fit, after their known
  tokens (row i's first ``nnew[i]`` of its K slots);
* ``blocked`` (int32[1]): 1 when a real row did not fit, else 0 (a step's
  admission reads it: nothing is admitted after a running request that did
  not fit).

The new tokens arrive as int64 (the host's, checked already, or a model
runner's tensor copied in on the device, never read by the host), so the
kernel checks their range itself: an id outside ``[0, 2**32)`` (a negative
one, or one past uint32) in a real row sets ``ERR_BAD_TOKEN`` in the free
queue's sticky error word (which the step's read, and every later step's,
carries: the manager raises there), and where such a row fits, the extra-key
digest of the block each bad id lands in becomes ``POISON``: that block's
digest, and every later one of the row (each chains from its parent), is
one no lookup computes, so the wrapped id (stored as its low 32 bits) can
never give a hit, even before any read.

One program (the fit is a scan over requests; a bucket is a few thousand rows
at most, a few tiles). Deterministic: no atomics.
"""

from __future__ import annotations

from gpukv import _runtime  # noqa: F401  (sets TRITON_INTERPRET before triton loads)

import triton
import triton.language as tl

from gpukv.kernels import capture, toolkit
from gpukv.kernels import free_queue as fq_ops
from gpukv.kernels.toolkit import DEFAULT_WARPS, INT32, INT64, SCAN_TILE, check_tensor, num_warps

#: Padding rows' cumulative need: more than any pool holds (``toolkit.BIG``).
BIG = toolkit.BIG

#: ``status`` layout (int64): requests that fit (a prefix of the batch), free
#: blocks after the step's allocation, the free queue's sticky error word
#: (``ERR_BAD_TOKEN`` included), new token ids out of range.
ST_FIT = 0
ST_FREE_AFTER = 1
ST_QUEUE_ERRORS = 2
ST_BAD_TOKENS = 3
NUM_STATUS = 4

#: Error bit OR-ed into the free queue's sticky error word (``free_queue.ERR_*``
#: use the low bits) when a step was handed a token id outside ``[0, 2**32)``
#: on the device.
ERR_BAD_TOKEN = 1 << 8
#: The extra-key digest (both int64 lanes) of a block that holds such an id:
#: no request's extra keys hash to it (a keyed BLAKE3 output, or zeros).
POISON = -1

#: Lanes per step of the one program (``toolkit.SCAN_TILE``).
_TILE = SCAN_TILE

# What the kernel reads as constants must be constexpr globals: the real
# compiler rejects any other global (the interpreter accepts them).
_BIG: tl.constexpr = tl.constexpr(BIG)
_NUM_FREE: tl.constexpr = tl.constexpr(int(fq_ops.NUM_FREE))
_QUEUE_ERROR: tl.constexpr = tl.constexpr(int(fq_ops.ERROR))
_ST_FIT: tl.constexpr = tl.constexpr(ST_FIT)
_ST_FREE_AFTER: tl.constexpr = tl.constexpr(ST_FREE_AFTER)
_ST_QUEUE_ERRORS: tl.constexpr = tl.constexpr(ST_QUEUE_ERRORS)
_ST_BAD_TOKENS: tl.constexpr = tl.constexpr(ST_BAD_TOKENS)
_ERR_BAD_TOKEN: tl.constexpr = tl.constexpr(ERR_BAD_TOKEN)
_POISON: tl.constexpr = tl.constexpr(POISON)
_MAX_TOKEN: tl.constexpr = tl.constexpr(2**32 - 1)


@triton.jit
def _entries(e, BP, G, W, rows_ptr, n_fit):
    """Entries ``e`` of a row-major [BP, G, W] layout: in range, their row
    index, group and slot, request row (-1 for padding), and whether their
    request fits (a real row among the first ``n_fit``)."""
    m = e < BP * G * W
    i = e // (G * W)
    r = tl.load(rows_ptr + i, mask=m, other=-1)
    ok = m & (i.to(tl.int64) < n_fit) & (r >= 0)
    return m, i, (e // W) % G, e % W, r, ok


@triton.jit
def _fit_prefix(cum_ptr, rows_ptr, free, BP, TILE: tl.constexpr):
    """How many requests fit the ``free`` blocks (a prefix: ``cum`` never
    decreases), how many rows are real, and the blocks the fitting ones pop."""
    n_fit = tl.zeros([], tl.int64)
    n_real = tl.zeros([], tl.int64)
    count = tl.zeros([], tl.int64)
    for start in range(0, BP, TILE):
        offs = start + tl.arange(0, TILE)
        cum = tl.load(cum_ptr + offs, mask=offs < BP, other=_BIG).to(tl.int64)
        fits = cum <= free  # cum never decreases: the requests that fit are a prefix
        n_fit += tl.sum(fits.to(tl.int64), 0)
        n_real += tl.sum((tl.load(rows_ptr + offs, mask=offs < BP, other=-1) >= 0).to(tl.int64), 0)
        count = tl.maximum(count, tl.max(tl.where(fits, cum, 0), 0))
    return n_fit, n_real, count


@triton.jit
def _write_alloc(alloc_ptr, rows_ptr, held_ptr, need_ptr, cum_ptr, n_fit, BP, G, A, TILE: tl.constexpr):
    """The allocation's entries (group, row, pos, want, rank; rows of
    ``alloc[5, BP * G * A]``), ``want`` 0 past the fit."""
    E = BP * G * A
    for start in range(0, E, TILE):
        e = start + tl.arange(0, TILE)
        m, i, g, a, r, ok = _entries(e, BP, G, A, rows_ptr, n_fit)
        held = tl.load(held_ptr + i, mask=m, other=0)
        need = tl.load(need_ptr + i, mask=m, other=0)
        c = tl.load(cum_ptr + i, mask=m, other=0)
        tl.store(alloc_ptr + e, g, mask=m)
        tl.store(alloc_ptr + E + e, tl.maximum(r, 0), mask=m)
        tl.store(alloc_ptr + 2 * E + e, held + a, mask=m)
        tl.store(alloc_ptr + 3 * E + e, (ok & (a < need)).to(tl.int32), mask=m)
        tl.store(alloc_ptr + 4 * E + e, c - need * G + g * need + a, mask=m)


@triton.jit
def _write_record(record_ptr, rows_ptr, comp0_ptr, comp1_ptr, n_fit, BP, G, C, BS: tl.constexpr,
                  TILE: tl.constexpr):
    """The caching entries (group, row, pos, valid; rows of ``record[4, BP *
    G * C]``): the blocks the step's computed tokens fill, ``valid`` 0 past
    the fit."""
    EC = BP * G * C
    for start in range(0, EC, TILE):
        e = start + tl.arange(0, TILE)
        m, i, g, j, r, ok = _entries(e, BP, G, C, rows_ptr, n_fit)
        first = tl.load(comp0_ptr + i, mask=m, other=0) // BS
        filled = tl.load(comp1_ptr + i, mask=m, other=0) // BS - first
        tl.store(record_ptr + e, g, mask=m)
        tl.store(record_ptr + EC + e, tl.maximum(r, 0), mask=m)
        tl.store(record_ptr + 2 * EC + e, first + j, mask=m)
        tl.store(record_ptr + 3 * EC + e, (ok & (j < filled)).to(tl.int32), mask=m)


@triton.jit
def _write_hash_ranges(hash_start_ptr, hash_count_ptr, rows_ptr, ntok_ptr, nnew_ptr, n_fit, BP, BS: tl.constexpr,
                       TILE: tl.constexpr):
    """Per row, the first known block that becomes full and how many do (0
    past the fit)."""
    for start in range(0, BP, TILE):
        offs = start + tl.arange(0, TILE)
        m = offs < BP
        n = tl.load(ntok_ptr + offs, mask=m, other=0)
        k = tl.load(nnew_ptr + offs, mask=m, other=0)
        fit = m & (offs.to(tl.int64) < n_fit) & (tl.load(rows_ptr + offs, mask=m, other=-1) >= 0)
        tl.store(hash_start_ptr + offs, n // BS, mask=m)
        tl.store(hash_count_ptr + offs, tl.where(fit, (n + k) // BS - n // BS, 0), mask=m)


@triton.jit
def _write_new_tokens(tokens_ptr, T, extras_ptr, M, new_tok_ptr, rows_ptr, ntok_ptr, nnew_ptr, n_fit, BP, K,
                      BS: tl.constexpr, TILE: tl.constexpr):
    """The fitting rows' new tokens into their rows (low 32 bits), ``POISON``
    in the extra digest of a block an out-of-range id lands in; returns the
    out-of-range ids of real rows (fitting or not)."""
    n_bad = tl.zeros([], tl.int64)
    for start in range(0, BP * K, TILE):
        offs = start + tl.arange(0, TILE)
        i = offs // K
        real = offs < BP * K
        r = tl.load(rows_ptr + i, mask=real, other=-1).to(tl.int64)
        real = real & (r >= 0) & ((offs % K) < tl.load(nnew_ptr + i, mask=real, other=0))
        ok = real & (i.to(tl.int64) < n_fit)
        n = tl.load(ntok_ptr + i, mask=ok, other=0).to(tl.int64)
        tok = tl.load(new_tok_ptr + offs, mask=real, other=0)
        bad = real & ((tok < 0) | (tok > _MAX_TOKEN))
        n_bad += tl.sum(bad.to(tl.int64), 0)
        at = n + (offs % K)
        tl.store(tokens_ptr + r * T + at, tok.to(tl.int32), mask=ok)
        ext = extras_ptr + (r * M + at // BS) * 2  # the extra digest of the block the id lands in
        tl.store(ext, tl.full([TILE], _POISON, tl.int64), mask=ok & bad)
        tl.store(ext + 1, tl.full([TILE], _POISON, tl.int64), mask=ok & bad)
    return n_bad


# Bucket sizes are runtime arguments, not constexprs: a new bucket (another
# batch size or tokens per row) must not compile a new variant inside a step.
@triton.jit(do_not_specialize=["T", "M", "BP", "K", "G", "A", "C"])
def _decode_fit_kernel(
    rows_ptr,          # int32[BP] request rows (-1: padding)
    ntok_ptr,          # int32[BP] their known tokens before the step
    nnew_ptr,          # int32[BP] their new tokens (at most K; row i's are new_tok[i, :nnew[i]])
    comp0_ptr,         # int32[BP] their computed tokens before the step
    comp1_ptr,         # int32[BP] ... and after it
    held_ptr,          # int32[BP] block positions each group holds before the step
    need_ptr,          # int32[BP] new blocks per group
    cum_ptr,           # int32[BP] cumulative blocks needed (all groups), request by request
    hash_start_ptr,    # int32[BP] out: first known block that becomes full
    hash_count_ptr,    # int32[BP] out: known blocks that become full (0 past the fit)
    alloc_ptr,         # int32[5, BP * G * A] out: group, row, pos, want, rank
    record_ptr,        # int32[4, BP * G * C] out: group, row, pos, valid
    new_tok_ptr,       # int64[BP, K] the step's new tokens, row i's at i * K (range-checked here)
    tokens_ptr, T,     # int32[R, T] request rows' tokens (written: the new ones, as their low 32 bits)
    extras_ptr, M,     # int64[R, M, 2] request rows' extra-key digests (written: POISON where a bad id lands)
    fq_counters_ptr,   # int64[8] free-queue counters (read: NUM_FREE, ERROR; ERROR |= ERR_BAD_TOKEN)
    count_ptr,         # int64[1] out: blocks to pop
    status_ptr,        # int64[NUM_STATUS] out
    blocked_ptr,       # int32[1] out: 1 when a real row did not fit
    BP, K, G, A, C,    # bucket rows, tokens per row, groups, alloc and record entries per row and group
    BS: tl.constexpr,  # block size
    TILE: tl.constexpr,
):
    """``decode_fit`` (one program, deterministic): the requests that fit
    the free count, a prefix (``_fit_prefix``); the step's allocation and
    caching entries and the blocks to hash, masked past them; their new
    tokens, range-checked (``ERR_BAD_TOKEN`` in the queue's error word,
    ``POISON`` extras). ``count``: the blocks to pop; ``status``: ``ST_*``."""
    free = tl.load(fq_counters_ptr + _NUM_FREE)
    n_fit, n_real, count = _fit_prefix(cum_ptr, rows_ptr, free, BP, TILE)
    _write_alloc(alloc_ptr, rows_ptr, held_ptr, need_ptr, cum_ptr, n_fit, BP, G, A, TILE)
    _write_record(record_ptr, rows_ptr, comp0_ptr, comp1_ptr, n_fit, BP, G, C, BS, TILE)
    _write_hash_ranges(hash_start_ptr, hash_count_ptr, rows_ptr, ntok_ptr, nnew_ptr, n_fit, BP, BS, TILE)
    n_bad = _write_new_tokens(tokens_ptr, T, extras_ptr, M, new_tok_ptr, rows_ptr, ntok_ptr, nnew_ptr, n_fit, BP, K,
                              BS, TILE)
    err = tl.load(fq_counters_ptr + _QUEUE_ERROR)
    err = tl.where(n_bad > 0, err | _ERR_BAD_TOKEN, err)
    tl.store(fq_counters_ptr + _QUEUE_ERROR, err)
    tl.store(count_ptr, count)
    tl.store(status_ptr + _ST_FIT, n_fit)
    tl.store(status_ptr + _ST_FREE_AFTER, free - count)
    tl.store(status_ptr + _ST_QUEUE_ERRORS, err)
    tl.store(status_ptr + _ST_BAD_TOKENS, n_bad)
    tl.store(blocked_ptr, (n_fit < n_real).to(tl.int32))


def decode_fit(rows, ntok, nnew, comp0, comp1, held, need, cum, hash_start, hash_count, alloc, record, new_tokens, *,
               tokens, extras, fq_counters, count, status, blocked, num_groups: int, block_size: int) -> None:
    """Decide how many requests of a decode plan fit (a prefix), write the
    step's entries (``alloc`` int32[5, BP*G*A], ``record`` int32[4, BP*G*C],
    ``hash_start``/``hash_count`` int32[BP]) masked past them, write their
    new tokens (int64[BP, K], the first ``nnew[i]`` of row i; range-checked:
    ``ERR_BAD_TOKEN``, ``POISON`` in ``extras`` int64[R, M, 2]) into their
    rows, and set ``count`` (the blocks to pop), ``status`` (``ST_*``) and
    ``blocked`` (int32[1]: a real row did not fit). ``A`` and ``C`` are read from
    the entry arrays' shapes. One launch, no host sync."""
    BP = rows.shape[0]
    K = new_tokens.shape[1]
    G = num_groups
    A, C = alloc.shape[1] // max(BP * G, 1), record.shape[1] // max(BP * G, 1)
    for t, name in ((rows, "rows"), (ntok, "ntok"), (nnew, "nnew"), (comp0, "comp0"), (comp1, "comp1"), (held, "held"),
                    (need, "need"), (cum, "cum"), (hash_start, "hash_start"), (hash_count, "hash_count")):
        check_tensor(t, name, dtypes=INT32, shape=(BP,))
    # alloc and record: a whole number of entries per (row, group) (A and C are read from them)
    check_tensor(alloc, "alloc", dtypes=INT32, shape=(5, BP * G * A))
    check_tensor(record, "record", dtypes=INT32, shape=(4, BP * G * C))
    check_tensor(new_tokens, "new_tokens", dtypes=INT64, shape=(BP, None))
    check_tensor(extras, "extras", dtypes=INT64, shape=(tokens.shape[0], None, 2), contiguous=True)
    check_tensor(blocked, "blocked", dtypes=INT32, shape=(1,))
    _decode_fit_kernel[(1,)](rows, ntok, nnew, comp0, comp1, held, need, cum, hash_start, hash_count, alloc, record,
                             new_tokens, tokens, tokens.shape[1], extras, extras.shape[1], fq_counters, count,
                             status, blocked, BP, K, G, A, C,
                             BS=block_size, TILE=_TILE, num_warps=num_warps(_TILE, max_warps=DEFAULT_WARPS))


capture.count_launches(globals())
