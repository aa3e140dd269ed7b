"""What the reference manager holds for its parts, typed: each part
(``admission``, ``running``, ``releases``) takes a ``ReferenceState`` in its
constructor, never the manager, so mypy checks what each reads and changes.

The manager builds it once and keeps it; the containers in it (the requests,
the rows, the pool, the digests) are the manager's own, never copied.
``stats`` and ``event_log`` are rebound (the stats handed out, the event log
moved to the queue) on the state, so every part sees the current ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpukv.core.metrics import PrefixCacheStats
from gpukv.core.windows import Policy
from gpukv.events.schema import BlockRemoved, KVCacheEvent
from gpukv.reference.digests import CachedBlockInfo, Digests, RequestState
from gpukv.reference.pool import NULL_BLOCK, BlockPool
from gpukv.reference.rows import ReferenceRows


@dataclass
class ReferenceState:
    """A reference manager's state, as its parts share it."""

    block_size: int
    num_groups: int
    enable_caching: bool
    #: one per KV-cache group (``gpukv.core.windows``)
    policies: list[Policy]
    pool: BlockPool
    digests: Digests
    rows: ReferenceRows
    #: the running requests, in admission order
    requests: dict[str, RequestState] = field(default_factory=dict)
    #: the lookups counted since the stats were last handed out
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    #: the KV-cache events of the call under way; None: events are off
    event_log: list[KVCacheEvent] | None = None

    def log_eviction(self, info: CachedBlockInfo) -> None:
        """The pool's ``on_evict`` with events on: a removed-block event."""
        assert self.event_log is not None  # kept: take_events only swaps the list
        self.event_log.append(BlockRemoved([info.digest], info.group))

    def check_invariants(self) -> None:
        """Pool invariants, plus: each block's count equals the number of
        request block lists that hold it; each row holds its request."""
        self.pool.check_invariants()
        held = [0] * self.pool.num_blocks
        for st in self.requests.values():
            for blocks in st.blocks:
                for b in blocks:
                    if b != NULL_BLOCK:
                        held[b] += 1
        assert held[1:] == self.pool.ref_cnt[1:], "reference counts disagree with the requests' block lists"
        self.rows.check(self.requests.values())
