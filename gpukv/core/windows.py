"""What an attention type asks of its KV-cache group, in one place: vLLM's
``SpecializedManager`` (``FullAttentionManager``, ``SlidingWindowManager``),
as rules both managers apply.

A group's policy answers three questions, in blocks of the pool's block size:

* ``hit(available)``: the longest prefix hit the group can serve, given which
  of the request's first blocks it has verified copies of;
* ``first_real(hit)``: where, in a hit of that length, the group starts to
  hold real blocks (before it: the null block, block 0);
* ``skipped(num_computed)``: how many leading blocks no token computed from
  now on can see (released, the null block held in their place);
  ``released_until(num_processed, held)``: where a release behind
  ``num_processed`` tokens stops in a request holding ``held`` blocks
  (vLLM's ``remove_skipped_blocks``: the skipped blocks, at most those held);
  ``release_at(num_null)``: the fewest processed tokens whose release frees
  a block past ``num_null`` leading null ones.

``boundary_blocks`` is the same rule as a number for the device kernels: the
blocks a group must see at a hit boundary, -1 for full attention
(``kernels/lookup.py: _group_hit`` reads it per group). The reference
(``gpukv/reference/manager.py``), the device manager's host plan (``gpukv/device/decode.py``)
and the admission bound (``gpukv/core/blocks.py: min_blocks_to_admit``) all use
these; ``tests/kernels/test_lookup.py`` holds ``hit`` and the admission
kernel to one table.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class FullAttention:
    """Every position's block, every hit length; nothing is ever skipped."""

    boundary_blocks = -1
    window = None

    def hit(self, available: Sequence[bool]) -> int:
        """The first miss."""
        for i, there in enumerate(available):
            if not there:
                return i
        return len(available)

    def first_real(self, hit: int) -> int:  # noqa: ARG002  (the policies share one signature)
        return 0

    def skipped(self, num_computed: int | np.ndarray) -> int | np.ndarray:
        return 0 * num_computed

    def released_until(self, num_processed: int | np.ndarray, held: int | np.ndarray) -> int | np.ndarray:  # noqa: ARG002
        return 0 * num_processed

    def release_at(self, num_null: int) -> int | None:  # noqa: ARG002
        """Never: full attention releases nothing."""
        return None

    def blocks_held(self, hits: np.ndarray, num_alloc: np.ndarray) -> np.ndarray:
        """Pool blocks a request holds after a hit of ``hits`` blocks with
        ``num_alloc`` block positions in all: one per position."""
        return num_alloc + 0 * hits


class SlidingWindow:
    """A window of ``window`` tokens: a token sees the ``window - 1`` before
    it, so a hit boundary needs the last ``ceil((window - 1) / block_size)``
    blocks, and blocks behind the window of every later token are skipped."""

    def __init__(self, window: int, block_size: int) -> None:
        self.window = window
        self.block_size = block_size
        self.boundary_blocks = -(-(window - 1) // block_size)

    def hit(self, available: Sequence[bool]) -> int:
        return _window_hit(available, self.boundary_blocks)

    def first_real(self, hit: int) -> int:
        return max(0, hit - self.boundary_blocks)

    def skipped(self, num_computed: int | np.ndarray) -> int | np.ndarray:
        """vLLM: the tokens before ``num_computed - window + 1`` are out of reach."""
        return np.maximum(0, num_computed - self.window + 1) // self.block_size

    def released_until(self, num_processed: int | np.ndarray, held: int | np.ndarray) -> int | np.ndarray:
        """vLLM's ``remove_skipped_blocks(request, num_processed)``: the
        blocks skipped behind ``num_processed`` tokens, at most the ``held``
        ones (a processed count ahead of the computed one can skip blocks not
        allocated yet; a later release catches up, tail first)."""
        return np.minimum(self.skipped(num_processed), held)

    def release_at(self, num_null: int) -> int | None:
        """The fewest processed tokens whose release reaches past the first
        ``num_null`` blocks (``skipped`` above ``num_null``): a release behind
        fewer frees nothing in a request whose first ``num_null`` blocks are
        null already."""
        return (num_null + 1) * self.block_size + self.window - 1

    def blocks_held(self, hits: np.ndarray, num_alloc: np.ndarray) -> np.ndarray:
        """The hit's last ``boundary_blocks`` real blocks (null before them)
        and every block after the hit."""
        return np.minimum(self.boundary_blocks, hits) + num_alloc - hits


Policy = FullAttention | SlidingWindow


def policies(windows: Sequence[int | None], block_size: int) -> list[Policy]:
    """One policy per KV-cache group (None: full attention)."""
    return [FullAttention() if w is None else SlidingWindow(w, block_size) for w in windows]


def is_hybrid(windows: Sequence[int | None]) -> bool:
    """Whether groups of these windows (None: full attention) have both
    kinds: the model's lookups then report the full-attention groups' own
    hit beside the hit (``ComputedBlocks.full_attention_hit_tokens``)."""
    return None in windows and any(w is not None for w in windows)


def first_release_at(group_policies: Sequence[Policy], num_null: Sequence[int]) -> int:
    """The fewest processed tokens whose release frees a block in some group
    of a request holding ``num_null`` leading null blocks per group (a model
    with a window group: else ``ValueError``). A running call whose processed
    tokens are fewer frees nothing, so the free queue it takes from is the
    one before it."""
    ats = [a for p, n in zip(group_policies, num_null, strict=True) if (a := p.release_at(n)) is not None]
    if not ats:
        raise ValueError("no group has a sliding window: nothing is ever released")
    return min(ats)


def group_hit(available: Sequence[bool], boundary_blocks: int) -> int:
    """``hit`` of the policy whose ``boundary_blocks`` is given (-1: full
    attention), for callers that hold the number, not the policy."""
    if boundary_blocks < 0:
        return FullAttention().hit(available)
    return _window_hit(available, boundary_blocks)


def _window_hit(available: Sequence[bool], need: int) -> int:
    """The end of the rightmost run of ``need`` available blocks, or the
    leading run when none is that long (it reaches block 0, before which the
    window needs nothing)."""
    if need == 0:
        return len(available)
    run = 0
    for i in range(len(available) - 1, -1, -1):
        if not available[i]:
            run = 0
            continue
        run += 1
        if run >= need:
            return i + need
    return run
