"""The reference's releases: a finished request's blocks given back (tail
first, one free call per group; its digests remembered, for a preempted
request that comes back with the same prefix), and the blocks a sliding
window no longer reaches (vLLM's ``remove_skipped_blocks``)."""

from __future__ import annotations

from gpukv.reference.digests import RequestState
from gpukv.reference.pool import NULL_BLOCK
from gpukv.reference.state import ReferenceState


class ReferenceReleases:
    """The releases of one reference manager, on its shared ``state`` (the
    pool, requests, rows, digests and policies)."""

    def __init__(self, state: ReferenceState) -> None:
        self._s = state

    def request(self, request_id: str) -> None:
        """Free a whole request and forget it."""
        s = self._s
        st = s.requests.pop(request_id)
        s.rows.give_back(st)
        s.digests.remember(st)  # a preempted request comes back with the same prefix
        for g in range(s.num_groups):
            s.pool.free(list(reversed(st.blocks[g])))

    def skipped(self, st: RequestState, num_processed: int | None = None) -> None:
        """Sliding-window groups give back the blocks no token computed from now
        on can see: freed tail first, one free call per group, replaced by the
        null block. Done before the fit check, as vLLM does; the blocks are
        useless to the request either way. ``num_processed``: release behind
        these tokens (vLLM's processed count, ``RunningUpdate``), None behind
        the computed ones; never past the blocks held
        (``gpukv.core.windows``: ``released_until``)."""
        s = self._s
        n = st.num_computed_tokens if num_processed is None else num_processed
        for g, policy in enumerate(s.policies):
            skip = int(policy.released_until(n, len(st.blocks[g])))  # (vLLM: tokens before n - window + 1)
            released = [b for b in st.blocks[g][:skip] if b != NULL_BLOCK]
            if released:
                s.pool.free(list(reversed(released)))
                for i in range(skip):
                    st.blocks[g][i] = NULL_BLOCK
