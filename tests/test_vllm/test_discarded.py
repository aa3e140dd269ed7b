"""vLLM 0.8.5's own block manager, replaced by gpukv's: its blocks are freed
by reference counting when gpukv's scheduler is built, not left to a full
cyclic collection (``gpukv.vllm.discarded``)."""

from __future__ import annotations

import gc

from tests.test_vllm.harness import make_scheduler, scheduler_params  # first: it skips the module without vLLM


def _live_blocks() -> int:
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    return sum(1 for o in gc.get_objects() if type(o) is KVCacheBlock)


def test_vllms_replaced_blocks_are_freed_without_a_cyclic_collection():
    [vllm_cls, gpukv_cls] = [p.values[0] for p in scheduler_params("vllm", "reference")]
    gc.collect()
    gc.disable()
    try:
        before = _live_blocks()
        own = make_scheduler(vllm_cls, num_blocks=300)
        assert _live_blocks() - before >= 300  # (vLLM's own keeps its pool's blocks: the count sees them)
        del own
        gc.collect()
        before = _live_blocks()
        scheduler = make_scheduler(gpukv_cls, num_blocks=300)
        assert _live_blocks() - before == 0
        assert scheduler.kv_cache_manager is not None
    finally:
        gc.enable()
