"""One schedule() / update_from_output() round trip on vLLM 0.33's own schedulers, without a model.

What the lead's adapter must reproduce at the smallest scale: the
``SchedulerOutput`` of an admission (``NewRequestData`` with one block-id list
per KV-cache group), the next step's batched ``CachedRequestData``, the
``EngineCoreOutputs`` an update returns, and the same on ``AsyncScheduler``
(two batches in flight) and on a hybrid full + sliding-window config.
"""

from __future__ import annotations

import pytest

from .harness import (
    HAS_COMMON_PREFIX_BLOCKS,
    SAMPLED_TOKEN_ID,
    Engine,
    KVView,
    VllmAsyncScheduler,
    VllmScheduler,
    coordinator_name,
    is_async,
    make_requests,
    make_scheduler,
    model_output,
    scheduler_params,
    stats_of,
)


def test_sync_round_trip_admission_then_decode():
    scheduler = make_scheduler(VllmScheduler)
    (request,) = make_requests(1, 40, max_tokens=3)
    scheduler.add_request(request)

    out = scheduler.schedule()
    (new,) = out.scheduled_new_reqs
    assert (new.req_id, new.block_ids, new.num_computed_tokens) == ("0", ([1, 2, 3],), 0)
    assert new.prompt_token_ids == [0] * 40
    assert out.num_scheduled_tokens == {"0": 40}
    assert out.total_num_scheduled_tokens == 40
    assert out.scheduled_cached_reqs.req_ids == []
    if HAS_COMMON_PREFIX_BLOCKS:
        assert out.num_common_prefix_blocks == []  # the scheduler never fills it in 0.33 (0.34 removed it)
    assert request.num_computed_tokens == 40  # advanced by schedule() itself

    results = scheduler.update_from_output(out, model_output(scheduler, out))
    (eco_output,) = results[0].outputs
    assert (eco_output.request_id, eco_output.new_token_ids, eco_output.finish_reason) == ("0", [SAMPLED_TOKEN_ID],
                                                                                         None)
    stats = stats_of(results)
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (1, 0)
    assert (stats.prefix_cache_stats.requests, stats.prefix_cache_stats.queries,
            stats.prefix_cache_stats.hits) == (1, 40, 0)

    out = scheduler.schedule()
    cached = out.scheduled_cached_reqs
    assert out.scheduled_new_reqs == []
    assert (cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, cached.num_output_tokens) == (
        ["0"], [None], [40], [1])
    assert getattr(cached, "resumed_req_ids", set()) == set()  # (0.34 re-sends a resumed request as new)
    assert out.num_scheduled_tokens == {"0": 1}


def test_async_round_trip_schedules_ahead_of_the_output():
    """An AsyncScheduler schedules the next step before the previous output
    arrives: the decode step counts the in-flight token as a placeholder."""
    scheduler = make_scheduler(VllmAsyncScheduler)
    assert scheduler.scheduler_config.async_scheduling is True
    (request,) = make_requests(1, 40, max_tokens=3)
    scheduler.add_request(request)

    first = scheduler.schedule()
    first_answer = model_output(scheduler, first)
    assert first.num_scheduled_tokens == {"0": 40}
    assert request.num_output_placeholders == 1

    second = scheduler.schedule()  # before update_from_output(first)
    assert second.num_scheduled_tokens == {"0": 1}
    assert second.scheduled_cached_reqs.num_computed_tokens == [40]
    assert second.scheduled_cached_reqs.num_output_tokens == [1]  # the placeholder
    assert request.num_output_placeholders == 2
    assert request.num_computed_tokens == 41

    scheduler.update_from_output(first, first_answer)
    assert list(request.output_token_ids) == [SAMPLED_TOKEN_ID]
    assert request.num_output_placeholders == 1


@pytest.mark.parametrize("cls", scheduler_params())
def test_engine_loop_finishes_every_request_and_frees_every_block(cls):
    scheduler = make_scheduler(cls)
    engine = Engine(scheduler)
    engine.add(make_requests(3, 40, max_tokens=4, ignore_eos=True))
    steps = engine.run_until_idle()
    assert {rid: len(engine.tokens(rid)) for rid in ("0", "1", "2")} == {"0": 4, "1": 4, "2": 4}
    assert {rid: o.finish_reason.name for rid, o in engine.finished().items()} == {
        "0": "LENGTH", "1": "LENGTH", "2": "LENGTH"}
    # sync: 1 prefill + 3 decodes, then the step that hands the finished ids to the workers (has_requests()
    # holds while finished_req_ids is not empty); async: 4 batches, one empty schedule while the last
    # decode is in flight, the finished ids' step, and the two empty batches drained
    assert steps == (7 if is_async(cls) else 5)
    KVView(scheduler).assert_empty()


@pytest.mark.parametrize("cls", scheduler_params())
def test_hybrid_round_trip_gives_one_block_list_per_group(cls):
    """Full attention (group 0) and a 32-token sliding window (group 1): a new
    request gets blocks in both groups from one pool; the window group's
    blocks behind the window become the null block (0) as decoding goes on,
    behind the processed tokens (async scheduling: one step later)."""
    scheduler = make_scheduler(cls, sliding_window=32, hybrid=True, num_blocks=100)
    assert coordinator_name(scheduler) == "HybridKVCacheCoordinator"
    (request,) = make_requests(1, 64, max_tokens=20, ignore_eos=True)
    engine = Engine(scheduler)
    engine.add([request])
    out = engine.step()
    assert out.scheduled_new_reqs[0].block_ids == ([1, 2, 3, 4], [5, 6, 7, 8])
    engine.step()
    if is_async(cls):
        # The first decode is scheduled with the prefill in flight (64 computed, 64 in flight): 0 processed
        # tokens, nothing released; the next one, with 64 processed, releases what the sync one did here.
        assert KVView(scheduler).block_ids("0") == ([1, 2, 3, 4, 9], [5, 6, 7, 8, 10])
        engine.step()
    # The decode step computes token 64, whose window is tokens 33..64: tokens 0..32 are skipped
    # (get_num_skipped_tokens(64) = 64 - 32 + 1), so the window group's two whole blocks before token 33
    # become the null block, released before the new blocks are taken (allocate_slots)
    assert KVView(scheduler).block_ids("0") == ([1, 2, 3, 4, 9], [0, 0, 7, 8, 10])
    # released last block first; both are cached (full, computed), so they go to the queue's tail, where
    # the prefix cache keeps them longest (an uncached one would go to its front)
    assert KVView(scheduler).free_queue()[-2:] == [6, 5]
    assert {5, 6} <= KVView(scheduler).cached_block_ids()
    if HAS_COMMON_PREFIX_BLOCKS:
        assert scheduler.kv_cache_manager.get_num_common_prefix_blocks("0") == [0, 0]
