"""What a sliding-window model's running calls release, followed on the host
for the 0.33 batched path (``gpukv.vllm.v0_33.pending``).

vLLM's ``allocate_slots`` for a running request first releases the blocks
its window no longer reaches, behind the request's processed tokens (its
computed tokens less those in flight), then checks its fit and takes its new
blocks from the free queue's front. A released block that carries a hash
joins the queue's tail (vLLM 0.33's free order, gpukv's ``uncached_first``);
one that carries none joins its front, where the next take finds it.

gpukv's step releases every row's blocks first, then takes each row's in
order. The two take the same blocks when no released block joins the front
and no take reaches the tail: every block a batched call releases is cached
(caching on, and the block full of tokens gpukv has computed, which gpukv
caches as vLLM does), and every take fits in the free blocks there were
before the step (``PendingGrowth``'s count, which never counts a release).
``WindowReleases`` says, per call, whether its release frees nothing, frees
only cached blocks (with where each group's null blocks then end), or may
free an uncached one (the call is then made on the per-request path, in its
turn).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gpukv.core.windows import Policy, first_release_at


class WindowReleases:
    """The null blocks each held request of a window model leads with, per
    group, and the fewest processed tokens at which its next call releases
    a block (``release_at``). ``group_policies``: gpukv's policy per group
    (``gpukv.core.windows``); ``caching``: whether blocks are cached at all."""

    def __init__(self, group_policies: Sequence[Policy], block_size: int, caching: bool) -> None:
        self._policies = list(group_policies)
        self._windowed = [g for g, p in enumerate(self._policies) if p.window is not None]
        self._block_size = block_size
        self._caching = caching
        self.release_at: dict[str, int] = {}
        self.null_blocks: dict[str, list[int]] = {}

    def note(self, request_id: str, num_null: Sequence[int]) -> None:
        """Request ``request_id`` holds ``num_null`` leading null blocks per
        group (read from the manager)."""
        self.null_blocks[request_id] = list(num_null)
        self.release_at[request_id] = first_release_at(self._policies, num_null)

    def forget(self, request_id: str) -> None:
        self.release_at.pop(request_id, None)
        self.null_blocks.pop(request_id, None)

    def stops_after(self, request_id: str, processed: int, num_held: int) -> list[int] | None:
        """Where each group's null blocks end after a release behind
        ``processed`` tokens in a request holding ``num_held`` block
        positions per group; None when the release drops no block."""
        nulls = self.null_blocks[request_id]
        stops = list(nulls)
        for g in self._windowed:
            stop = int(self._policies[g].released_until(processed, num_held))
            if stop > stops[g]:
                stops[g] = stop
        return None if stops == nulls else stops

    def all_cached(self, stops: list[int], computed: int) -> bool:
        """Whether every block a release up to ``stops`` drops is cached:
        caching is on and each is full of the ``computed`` tokens (gpukv
        caches exactly those, as vLLM does)."""
        return self._caching and max(stops) * self._block_size <= computed

    def check(self, request_id: str, num_null: Sequence[int]) -> None:
        """``AssertionError`` unless this record of ``request_id`` is the
        manager's (``num_null``: its null blocks per group)."""
        want = first_release_at(self._policies, num_null)
        have = (self.null_blocks.get(request_id), self.release_at.get(request_id))
        if have != (list(num_null), want):
            raise AssertionError(f"request {request_id!r}: the adapter's null blocks and next release {have} are "
                                 f"not the manager's {(list(num_null), want)}")


def processed_tokens(request: Any, max_model_len: int) -> int:
    """The tokens vLLM's call for a running ``request`` releases behind: its
    computed tokens (at most ``max_model_len``) less those in flight."""
    total = request.num_computed_tokens
    if total > max_model_len:
        total = max_model_len
    processed = total - request.num_in_flight_tokens
    return processed if processed > 0 else 0
