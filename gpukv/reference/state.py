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
from gpukv.events.schema import KVCacheEvent
from gpukv.reference.digests import Digests, RequestState
from gpukv.reference.pool import BlockPool
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
