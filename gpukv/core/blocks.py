"""Block arithmetic both managers and their checks share: what a manager's
limits are (``ManagerLimits``), the tokens a new request computes at its
admission and the blocks it then holds, the fewest blocks any hit leaves it,
the computed length a block table holds, and the common prefix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpukv.core.limits import MAX_COUNT
from gpukv.core.windows import policies
from gpukv.errors import CapacityError, check_int


def common_prefix_length(ref_counts: Sequence[int], count: int) -> int:
    """vLLM's common prefix (cascade attention): how many leading blocks are
    held by exactly ``count`` requests (every running one), up to the first
    that is not (``get_num_common_prefix_blocks``, on both managers)."""
    n = 0
    for c in ref_counts:
        if c != count:
            break
        n += 1
    return n


@dataclass(frozen=True)
class ManagerLimits:
    """What the step checks need to know of a manager (fixed at construction)."""

    block_size: int
    num_blocks: int
    sliding_windows: tuple[int | None, ...]
    max_model_len: int | None = None
    caching: bool = True


def check_computed_length(computed: int, lookahead: int, limits: ManagerLimits, argument: str, rid: str,
                          *, with_best_hit: bool = False) -> None:
    """Refuse computed tokens plus lookahead slots past ``max_model_len``
    (a request's block table holds no more). ``with_best_hit``: ``computed``
    is what a new request computes with the longest hit it could get (its
    real hit is known only in the step)."""
    if limits.max_model_len is not None and computed + lookahead > limits.max_model_len:
        what = f"up to {computed} computed (with the longest cache hit it could get)" if with_best_hit \
            else f"{computed} computed"
        raise CapacityError(f"request {rid!r} would need slots for {what} and {lookahead} lookahead tokens, more "
                            f"than max_model_len {limits.max_model_len}", argument=argument,
                            fix="reserve fewer lookahead tokens, or raise max_model_len")


def new_tokens_at_admission(hit: int, num_tokens: int, chunk: int | None, block_size: int,
                            budget_left: int | None = None) -> int:
    """The tokens a new request computes in its admission step beyond its
    hit of ``hit`` blocks: vLLM's ``num_new_tokens = min(num_tokens - hit,
    chunk, budget_left)`` (None: no cap). The one statement of the rule; the
    device's ``_admit_kernel`` applies the same per request."""
    new = num_tokens - hit * block_size
    if chunk is not None:
        new = min(new, chunk)
    if budget_left is not None:
        new = min(new, budget_left)
    return new


def blocks_after_admission(hit: int, num_tokens: int, chunk: int | None, lookahead: int, block_size: int,
                           budget_left: int | None = None) -> int:
    """Blocks (per group, hit included) a new request of ``num_tokens``
    tokens holds once admitted with a hit of ``hit`` blocks, computing its
    hit plus ``new_tokens_at_admission`` tokens, plus ``lookahead`` slots."""
    computed = hit * block_size + new_tokens_at_admission(hit, num_tokens, chunk, block_size, budget_left)
    return -(-(computed + lookahead) // block_size)


def min_blocks_to_admit(num_tokens: int, limits: ManagerLimits, can_hit: bool, chunk: int | None = None,
                        lookahead: int = 0) -> int:
    """The fewest pool blocks a request of ``num_tokens`` tokens holds once
    admitted, over every cache hit it could get: a full-attention group holds
    a block per position; a sliding-window group holds the window's run of
    the hit (null before it) and the blocks after the hit."""
    bs = limits.block_size
    max_hit = (num_tokens - 1) // bs if can_hit else 0
    if chunk is None and lookahead == 0:  # the longest hit is the cheapest
        hits = np.array([max_hit], dtype=np.int64)
    else:  # a longer hit can hold more blocks (the chunk counts beyond it): try every length
        hits = np.arange(max_hit + 1, dtype=np.int64)
    computed = np.minimum(num_tokens, hits * bs + (num_tokens if chunk is None else chunk))
    n_alloc = -(-(computed + lookahead) // bs)
    total = np.zeros_like(hits)
    for policy in policies(limits.sliding_windows, bs):
        total += policy.blocks_held(hits, n_alloc)
    return int(total.min())


def check_count(value: Any, argument: str) -> int:
    """A count (an int in ``[0, MAX_COUNT]``): ``get_num_common_prefix_blocks``'
    number of running requests."""
    return check_int(value, argument, minimum=0, maximum=MAX_COUNT,
                     fix=f"pass how many requests are running (an int from 0 to {MAX_COUNT})")
