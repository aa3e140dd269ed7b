"""vLLM 0.33/0.34's own block manager, replaced by gpukv's: its blocks are
freed by reference counting when gpukv's scheduler is built, not left to a
full cyclic collection (``gpukv.vllm.discarded``)."""

from __future__ import annotations

import gc

import pytest

from .harness import make_scheduler, scheduler_params


def _live_blocks() -> int:
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    return sum(1 for o in gc.get_objects() if type(o) is KVCacheBlock)


@pytest.mark.parametrize("cls", scheduler_params())
def test_only_vllms_own_scheduler_keeps_a_block_object_per_pool_block(cls):
    gc.collect()
    gc.disable()
    try:
        before = _live_blocks()
        scheduler = make_scheduler(cls, num_blocks=300)
        gpukv = type(scheduler).__module__.startswith("gpukv")
        assert _live_blocks() - before == (0 if gpukv else 300 + 2)  # (vLLM's: its pool's, and 2 sentinels)
    finally:
        gc.enable()
