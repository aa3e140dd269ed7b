"""The batched decode step's one device decision: which running requests fit.

A decode step (``KVCacheManager.decode``) is planned on the host from what the
host knows exactly (each request's token count and window position) and
uploaded as one int32 buffer of fixed shape per batch bucket. What only the
device knows is the free count after this step's window releases, hence how
many requests, in order, get their new blocks. ``decode_fit`` decides that
and masks the plan accordingly, so every launch of the step has a shape fixed
by the bucket and no host-dependent branch (a CUDA graph can replay it).

Plan layout (int32, ``BP`` = bucket rows, ``PER_ROW`` = entries per row):

* ``rows[BP]`` request rows, -1 for padding; ``ntok[BP]`` their token counts
  before the step; ``cum[BP]`` the running total of blocks they need (padding
  holds ``BIG``, so it never fits); ``hash_count[BP]`` blocks each fills
  (to hash); ``alloc_want[BP * PER_ROW]`` / ``record_valid[BP * PER_ROW]``
  the allocation and caching entries the host asks for, request-major.

One program (the prefix of requests that fit is a scan over requests; the
bucket is at most a few thousand rows, a few tiles). Deterministic: no
atomics.
"""

from __future__ import annotations

from gpukv import _runtime  # noqa: F401  (sets TRITON_INTERPRET before triton loads)

import torch
import triton
import triton.language as tl

from gpukv.kernels import free_queue as fq_ops

#: Padding rows' cumulative need: more than any pool holds.
BIG = 1 << 30

#: ``status`` layout (int64): requests that fit (a prefix of the batch), free
#: blocks after the step's allocation, the free queue's sticky error word.
ST_FIT = 0
ST_FREE_AFTER = 1
ST_QUEUE_ERRORS = 2
NUM_STATUS = 4

_TILE = 1024

# What the kernel reads as constants must be constexpr globals: the real
# compiler rejects any other global (the interpreter accepts them).
_BIG: tl.constexpr = tl.constexpr(BIG)
_NUM_FREE: tl.constexpr = tl.constexpr(int(fq_ops.NUM_FREE))
_QUEUE_ERROR: tl.constexpr = tl.constexpr(int(fq_ops.ERROR))
_ST_FIT: tl.constexpr = tl.constexpr(ST_FIT)
_ST_FREE_AFTER: tl.constexpr = tl.constexpr(ST_FREE_AFTER)
_ST_QUEUE_ERRORS: tl.constexpr = tl.constexpr(ST_QUEUE_ERRORS)


# Bucket sizes are runtime arguments, not constexprs: a new bucket (another
# batch size or tokens per row) must not compile a new variant inside a step.
@triton.jit(do_not_specialize=["T", "BP", "K", "PER_ROW"])
def _decode_fit_kernel(
    rows_ptr,          # int32[BP] request rows (-1: padding)
    ntok_ptr,          # int32[BP] their token counts before the step
    cum_ptr,           # int32[BP] cumulative blocks needed, request by request
    hash_count_ptr,    # int32[BP] blocks each request fills; zeroed past the fit
    alloc_want_ptr,    # int32[BP * PER_ROW] allocation entries; masked past the fit
    record_valid_ptr,  # int32[BP * PER_ROW] caching entries; masked past the fit
    new_tok_ptr,       # int32[BP, K] the step's new tokens, row i's at i * K
    tokens_ptr, T,     # int32[R, T] request rows' tokens (written: the new ones)
    fq_counters_ptr,   # int64[8] free-queue counters (read: NUM_FREE, ERROR)
    count_ptr,         # int64[1] out: blocks to pop
    status_ptr,        # int64[NUM_STATUS] out
    BP, K, PER_ROW,    # bucket rows, tokens per row, plan entries per row
    TILE: tl.constexpr,
):
    free = tl.load(fq_counters_ptr + _NUM_FREE)
    n_fit = tl.zeros([], tl.int64)
    count = tl.zeros([], tl.int64)
    for start in range(0, BP, TILE):
        offs = start + tl.arange(0, TILE)
        cum = tl.load(cum_ptr + offs, mask=offs < BP, other=_BIG).to(tl.int64)
        fits = cum <= free  # cum never decreases: the requests that fit are a prefix
        n_fit += tl.sum(fits.to(tl.int64), 0)
        count = tl.maximum(count, tl.max(tl.where(fits, cum, 0), 0))
    for start in range(0, BP * PER_ROW, TILE):
        offs = start + tl.arange(0, TILE)
        m = offs < BP * PER_ROW
        ok = (offs // PER_ROW).to(tl.int64) < n_fit
        want = tl.load(alloc_want_ptr + offs, mask=m, other=0)
        tl.store(alloc_want_ptr + offs, tl.where(ok, want, 0), mask=m)
        valid = tl.load(record_valid_ptr + offs, mask=m, other=0)
        tl.store(record_valid_ptr + offs, tl.where(ok, valid, 0), mask=m)
    for start in range(0, BP, TILE):
        offs = start + tl.arange(0, TILE)
        m = offs < BP
        n = tl.load(hash_count_ptr + offs, mask=m, other=0)
        tl.store(hash_count_ptr + offs, tl.where(offs.to(tl.int64) < n_fit, n, 0), mask=m)
    for start in range(0, BP * K, TILE):
        offs = start + tl.arange(0, TILE)
        i = offs // K
        ok = (offs < BP * K) & (i.to(tl.int64) < n_fit)
        r = tl.load(rows_ptr + i, mask=ok, other=0).to(tl.int64)
        n = tl.load(ntok_ptr + i, mask=ok, other=0).to(tl.int64)
        ok = ok & (r >= 0)
        tok = tl.load(new_tok_ptr + offs, mask=ok, other=0)
        tl.store(tokens_ptr + r * T + n + (offs % K), tok, mask=ok)
    tl.store(count_ptr, count)
    tl.store(status_ptr + _ST_FIT, n_fit)
    tl.store(status_ptr + _ST_FREE_AFTER, free - count)
    tl.store(status_ptr + _ST_QUEUE_ERRORS, tl.load(fq_counters_ptr + _QUEUE_ERROR))


def decode_fit(rows, ntok, cum, hash_count, alloc_want, record_valid, new_tokens, *, tokens, fq_counters, count,
               status) -> None:
    """Decide how many requests of a decode plan fit (a prefix), mask the plan
    past them, write their new tokens into their rows, and set ``count`` (the
    blocks to pop) and ``status`` (``ST_*``). Shapes as the module docstring;
    one launch, no host sync."""
    BP = rows.shape[0]
    K = new_tokens.shape[1]
    per_row = alloc_want.shape[0] // BP
    for t, name in ((ntok, "ntok"), (cum, "cum"), (hash_count, "hash_count")):
        if t.shape != (BP,) or t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32[{BP}], got {t.dtype}{list(t.shape)}")
    if record_valid.shape != alloc_want.shape or new_tokens.shape[0] != BP or new_tokens.dtype != torch.int32:
        raise ValueError("decode plan: record_valid must match alloc_want, new_tokens be int32[BP, K]")
    _decode_fit_kernel[(1,)](rows, ntok, cum, hash_count, alloc_want, record_valid, new_tokens, tokens,
                             tokens.shape[1], fq_counters, count, status, BP, K, max(per_row, 1),
                             TILE=_TILE, num_warps=4)


from gpukv.kernels import _common  # noqa: E402

_common.count_launches(globals())
