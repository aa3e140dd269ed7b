"""The host plan of an admission step and its fixed device buffers.

A step admitting K new requests is planned on the host from their lengths
alone (numpy, no Python per block): per request its row, prompt length, full
blocks, longest possible hit, chunk and lookahead, packed with the prompts
into one int32 array that is uploaded once (layout:
``gpukv.kernels.prefill``). Every later entry of the step (touches,
allocations, cache records, hits into block tables) is derived on the device
from that plan and the hits, into buffers sized by the step's bucket and
kept between steps, so the step allocates nothing on the device.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from gpukv.core.limits import MAX_TOKEN_BUDGET
from gpukv.core.requests import NewRequest
from gpukv.kernels import lookup as lookup_ops
from gpukv.kernels.prefill import PLAN_ARRAYS
from gpukv.kernels.toolkit import pow2_at_least

#: ``plan_admission``'s source of host arrays: (bucket, int32 elements) -> the array, or None.
HostArray = Callable[[tuple, int], np.ndarray]

#: int32 slots before the plan's columns: ``num_requests``, ``token_budget``
#: (< 0: none), then padding (the columns stay 32-byte aligned, as Triton
#: specialises pointers on it).
HEADER = 8


@dataclass
class AdmissionPlan:
    """An admission step as the host plans it. ``bucket`` = (KP, P, TP, A, C):
    requests padded to a power of two, positions a lookup covers, prompt
    tokens, new blocks and caching entries per request and group (each a
    power of two)."""

    rows: np.ndarray  # int64[K]
    num_tokens: np.ndarray  # int64[K] prompt tokens
    chunk: np.ndarray  # int64[K] the most tokens computed beyond the hit
    lookahead: np.ndarray  # int64[K]
    max_new_blocks: int  # the most blocks the step can pop, per group
    max_cached_blocks: int  # the most blocks the step can cache, per group
    bucket: tuple
    packed: np.ndarray  # int32: the header, PLAN_ARRAYS, each [KP], then the prompts (their ids only: <= TP)
    device_tokens: list  # (offset, CUDA tensor): prompts already on the device, copied in after the upload


def hit_limit(request: NewRequest, block_size: int) -> int:
    """The most blocks a lookup of ``request`` can hit: ``longest_hit`` of
    its prompt, none when it skips the prefix cache."""
    return 0 if request.skip_prefix_cache else longest_hit(len(request.token_ids), block_size)


def longest_hit(num_tokens: int, block_size: int) -> int:
    """The most blocks a prompt of ``num_tokens`` can hit: its full blocks
    before its last token (a hit never covers the last token, which the
    step computes)."""
    return (num_tokens - 1) // block_size


def plan_admission(new: list[NewRequest], rows: list[int], block_size: int, hit_caps=None,
                   host_array: HostArray | None = None, token_budget: int | None = None,
                   dry: bool = False, max_chunk: int | None = None) -> AdmissionPlan:
    """The plan of admitting ``new`` into ``rows`` (``hit_caps``: per request
    the most blocks it may hit; None: no cap; ``token_budget``: the step's
    budget for new requests, None: none). ``host_array(bucket, size)``
    gives the int32 host array to write the bucket's plan into (the
    staging's, kept per bucket and sent as it is: the step then allocates
    and copies nothing more on the host, so a plan ``Admission`` launches
    is always written there); without it, a new array (a plan only read).
    ``dry``: a lookup only, which takes and caches
    no block, so its bucket's new-block and caching sizes are 1.

    The bucket follows the prompts' lengths (and lookaheads) alone, never
    the hit caps, the chunks or the budget: sized for the most a prompt can
    hit, take and cache, whatever part of it this step computes, where
    ``max_chunk`` (the engine's most tokens a step computes; None: no
    bound) caps what a longer prompt can take and cache in one step. Sizes that
    followed the capped hit and the chunk made a bucket for nearly every
    admission of real traffic (each with its launches prepared and its
    buffers zeroed anew); by the prompt, the admissions of one power-of-two
    length class share one and replay its launches. The extra positions
    and entries are masked off on the device (idle programs)."""
    bs, K = block_size, len(new)
    # A request computes at most ``most_new`` tokens past its hit, so it takes
    # at most ceil((most_new + lookahead) / bs) new blocks per group and
    # caches at most most_new // bs blocks past its hit.
    budget = None if token_budget is None else max(token_budget, 1)
    table = []  # per request, the PLAN_ARRAYS columns (plain ints: a few requests, no numpy call per column)
    most_blocks, most_cached = [], []
    size_hit = size_new = size_cached = 0  # the bucket's, by the prompts alone
    off = 0
    for i, r in enumerate(new):
        n = len(r.token_ids)
        chunk = n if r.num_tokens_to_compute is None else r.num_tokens_to_compute
        lookahead = r.num_lookahead_tokens
        limit = hit_limit(r, bs)
        hit = limit if hit_caps is None else min(limit, int(hit_caps[i]))
        most_new = chunk if budget is None else min(chunk, budget)
        most_blocks.append(-(-(most_new + lookahead) // bs))
        most_cached.append(most_new // bs)
        size_hit = max(size_hit, limit)
        sized = _entries_sized(n, most_new, max_chunk)
        size_new = max(size_new, -(-(sized + lookahead) // bs))
        size_cached = max(size_cached, sized // bs)
        table.append((rows[i], n, n // bs, -(-n // bs), hit, chunk, lookahead, int(r.skip_prefix_cache), off))
        off += n
    bucket = bucket_of(K, size_hit, off, size_new, size_cached, dry)
    KP = bucket[0]
    size = HEADER + len(PLAN_ARRAYS) * KP + bucket[2]
    packed = np.zeros(size, dtype=np.int32) if host_array is None else host_array(bucket, size)
    packed[0] = K
    packed[1] = -1 if token_budget is None else min(token_budget, MAX_TOKEN_BUDGET)
    base = HEADER + len(PLAN_ARRAYS) * KP
    cols = packed[HEADER: base].reshape(len(PLAN_ARRAYS), KP)
    columns = np.array(table, dtype=np.int64).T
    cols[:, :K] = columns
    cols[:, K:] = 0  # padding: no row's blocks (a bucket's arrays are reused)
    device_tokens = _place_prompts(new, packed[base:], columns[-1].tolist())
    # (only the prompts' ids are sent: the bucket's tail, up to twice as long,
    # is read by no request, so the device buffer keeps what it held)
    return AdmissionPlan(columns[0], columns[1], columns[5], columns[6], sum(most_blocks), sum(most_cached), bucket,
                         packed[: base + off], device_tokens)


def empty_plan(bucket: tuple, host_array: HostArray | None = None) -> AdmissionPlan:
    """A plan of ``bucket`` admitting no request (``Admission.prepare``):
    the header and the columns, zero requests, no token budget."""
    KP = bucket[0]
    base = HEADER + len(PLAN_ARRAYS) * KP
    packed = np.zeros(base, dtype=np.int32) if host_array is None else host_array(bucket, base + bucket[2])
    packed[:base] = 0
    packed[1] = -1
    none = np.zeros(0, dtype=np.int64)
    return AdmissionPlan(none, none, none, none, 0, 0, bucket, packed[:base], [])


def bucket_of(num_requests: int, size_hit: int, num_tokens: int, size_new: int, size_cached: int,
              dry: bool) -> tuple:
    """The bucket (KP, P, TP, A, C) of a plan of ``num_requests`` prompts of
    ``num_tokens`` tokens in all, whose longest possible hit is ``size_hit``
    blocks and whose most new blocks and caching entries per request are
    ``size_new`` and ``size_cached`` (a dry lookup's are 1)."""
    return (pow2_at_least(max(num_requests, 8)), pow2_at_least(size_hit), pow2_at_least(num_tokens),
            1 if dry else pow2_at_least(size_new), 1 if dry else pow2_at_least(size_cached))


def _entries_sized(num_tokens: int, most_new: int, max_chunk: int | None) -> int:
    """The tokens a prompt's new-block and caching entries are sized for:
    the whole prompt, or the engine's step where the prompt is longer
    (never below what this step computes)."""
    return num_tokens if max_chunk is None else max(min(num_tokens, max_chunk), most_new)


def single_prompt_buckets(max_prompt_len: int, block_size: int, max_chunk: int | None = None,
                          num_lookahead_tokens: int = 0) -> list[tuple[tuple, bool]]:
    """Every (bucket, dry) one prompt of 1 to ``max_prompt_len`` tokens can
    meet: its dry lookup's and its admission's, prefix caching on, any hit,
    its chunks at most ``max_chunk`` tokens (the engine's step; None: no
    bound) and ``num_lookahead_tokens`` reserved. What an engine prepares
    before serving (``DeviceManager.prepare_admissions``), smallest first.
    A prompt that skips the prefix cache, a larger lookahead, or a step
    admitting several prompts at once can meet others."""
    bs = block_size

    def buckets_at(n: int) -> tuple[tuple, tuple]:  # (the dry lookup's, the admission's)
        limit = longest_hit(n, bs)
        sized = _entries_sized(n, n if max_chunk is None else min(n, max_chunk), max_chunk)
        new, cached = -(-(sized + num_lookahead_tokens) // bs), sized // bs
        return bucket_of(1, limit, n, new, cached, True), bucket_of(1, limit, n, new, cached, False)

    # Every size grows with n, so the lengths that share a pair of buckets are
    # one interval: its end is found by bisection (a few dozen intervals).
    out: dict[tuple[tuple, bool], None] = {}
    n = 1
    while n <= max_prompt_len:
        pair = buckets_at(n)
        lo, hi = n, max_prompt_len
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if buckets_at(mid) == pair else (lo, mid - 1)
        out.setdefault((pair[0], True), None)
        out.setdefault((pair[1], False), None)
        n = lo + 1
    return list(out)


def _place_prompts(new: list[NewRequest], region: np.ndarray, starts: list[int]) -> list[tuple[int, torch.Tensor]]:
    """Each host prompt's ids (normalised: int64 in ``[0, 2**32)``) cast
    straight into ``region`` (int32) at its start as uint32, the int32 bit
    pattern the device stores: one pass. Returns the prompts already on the
    device, (start, tensor), to copy into place after the upload, unread."""
    ids = region.view(np.uint32)
    device_tokens: list[tuple[int, torch.Tensor]] = []
    for r, start in zip(new, starts, strict=True):
        tokens = r.token_ids
        if isinstance(tokens, torch.Tensor):
            device_tokens.append((start, tokens))
        else:
            np.copyto(ids[start: start + len(tokens)], tokens, casting="unsafe")
    return device_tokens


@dataclass
class AdmissionBuffers:
    """Fixed device buffers of one admission bucket (``gpukv.kernels.prefill``
    says what each holds)."""

    plan: torch.Tensor
    views: dict  # the plan's named int32 views (PLAN_ARRAYS, "num_requests" and "tokens")
    zeros: torch.Tensor  # int32[KP]: every prompt is hashed from block 0
    cache: torch.Tensor  # int32[KP, P, G]
    head: torch.Tensor  # int32[KP, P]
    next: torch.Tensor  # int32[KP * P]
    same: torch.Tensor  # int32[KP * P]
    resolved: torch.Tensor  # int32[KP, P]
    hit: torch.Tensor  # int32[KP]
    full_hit: torch.Tensor  # int32[KP]: each request's full-attention hit (a hybrid model's)
    start: torch.Tensor  # int32[KP]
    status: torch.Tensor  # int64[NUM_STATUS]
    alloc: torch.Tensor  # int32[5, KP * G * A]
    record: torch.Tensor  # int32[4, KP * G * C]
    popped: torch.Tensor  # int32[KP * G * A]
    record_scratch: torch.Tensor  # int64[4, KP * G * C]
    record_seq: torch.Tensor  # int64[KP * G * C]
    prepared: dict = field(default_factory=dict)  # part -> (rows generation, replayable launches)

    @classmethod
    def create(cls, bucket: tuple, num_groups: int, device: torch.device) -> AdmissionBuffers:
        """The bucket's buffers, zeroed: views into one int32 and one int64
        allocation (two operations where one per buffer took 19), each view
        starting 64-byte aligned, as Triton specialises pointers on it."""
        KP, P, TP, A, C = bucket
        G = num_groups
        EA, EC = KP * G * A, KP * G * C
        i32 = _carve(torch.int32, device, plan=(HEADER + len(PLAN_ARRAYS) * KP + TP,), zeros=(KP,),
                     cache=(KP, P, G), head=(KP, P), next=(KP * P,), same=(KP * P,), resolved=(KP, P), hit=(KP,),
                     full_hit=(KP,), start=(KP,), alloc=(5, EA), record=(4, EC), popped=(EA,))
        i64 = _carve(torch.int64, device, status=(lookup_ops.NUM_STATUS,), record_scratch=(4, EC),
                     record_seq=(EC,))
        plan = i32["plan"]
        views = {name: plan[HEADER + i * KP: HEADER + (i + 1) * KP] for i, name in enumerate(PLAN_ARRAYS)}
        views["num_requests"] = plan[:1]
        views["token_budget"] = plan[1:2]
        views["tokens"] = plan[HEADER + len(PLAN_ARRAYS) * KP:]
        buffers: dict[str, Any] = {**i32, **i64}
        return cls(views=views, **buffers)


def _carve(dtype: torch.dtype, device: torch.device, **shapes: tuple) -> dict[str, torch.Tensor]:
    """Zeroed contiguous tensors of these shapes, by name: views into one
    allocation of ``dtype``, each at a 64-byte aligned offset."""
    align = 64 // dtype.itemsize
    offsets, end = {}, 0
    for name, shape in shapes.items():
        offsets[name] = end
        end += -(-math.prod(shape) // align) * align
    flat = torch.zeros(end, dtype=dtype, device=device)
    return {name: flat[o: o + math.prod(shape)].view(shape) for (name, shape), o in zip(shapes.items(),
                                                                                      offsets.values(), strict=True)}
