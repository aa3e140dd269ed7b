"""vLLM's own block manager, which gpukv's schedulers replace right after
vLLM's scheduler builds it (both API generations).

vLLM's ``BlockPool`` keeps one ``KVCacheBlock`` per pool block on a doubly
linked free list (and, in 0.33, each block points back at its pool): every
link is a reference cycle, so once the manager is dropped its blocks wait
for a full cyclic collection, which then walks them all (a pause of hundreds
of milliseconds at production pool sizes, in whichever engine step it
falls). Unlinked, they are freed by reference counting the moment the
manager goes.
"""

from __future__ import annotations

from typing import Any


def unlink_free_list(kv_cache_manager: Any) -> None:
    """Break the free-list links of ``kv_cache_manager``'s block pool (its
    blocks and the queue's sentinels) and its blocks' links back to it;
    nothing else of it is touched, and a manager without a pool is left
    alone."""
    pool = getattr(kv_cache_manager, "block_pool", None)
    queue = getattr(pool, "free_block_queue", None)
    sentinels = [getattr(queue, name, None) for name in ("fake_free_list_head", "fake_free_list_tail")]
    for block in [*getattr(pool, "blocks", ()), *sentinels]:
        if block is not None:
            block.prev_free_block = block.next_free_block = None
            if getattr(block, "pool", None) is not None:  # (0.33's blocks point back at their pool)
                block.pool = None
