"""gpukv's vLLM 0.33 adapter itself: what ``gpukv.vllm`` exports under 0.33,
what it refuses, and bad input. (Its behaviour is held to vLLM's by every
other module here: ``harness.EXTRA_SCHEDULERS``.)"""

from __future__ import annotations

import pytest
import torch

from gpukv.errors import InvalidInputError

from .harness import Engine, KVView, VllmScheduler, gpukv033, is_async, make_requests, make_scheduler
from .streams import StreamConfig, run_stream


@pytest.mark.parametrize("options", [dict(sliding_window=32), dict(sliding_window=32, hybrid=True)])
@pytest.mark.parametrize("cls", [gpukv033.ReferenceAsyncScheduler, gpukv033.ReferenceScheduler])
def test_sliding_windows_with_tokens_in_flight_are_accepted(cls, options):
    """Async scheduling and drafts put tokens in flight; window blocks are
    then released behind vLLM's processed tokens (``num_processed_tokens``)."""
    spec = {} if is_async(cls) else dict(num_speculative_tokens=2)
    scheduler = make_scheduler(cls, **options, **spec)
    assert scheduler.kv_cache_manager.manager.sliding_windows == [None] * options.get("hybrid", False) + [32]


def test_window_configurations_gpukv_does_not_follow_are_refused():
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec

    def config(**window):
        spec = SlidingWindowSpec(block_size=16, num_kv_heads=1, head_size=1, dtype=torch.float32, **window)
        return KVCacheConfig(num_blocks=10, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["w"], spec)])

    with pytest.raises(gpukv033.UnsupportedConfigError, match="sliding window of 1 token"):
        gpukv033.KVCacheManager(config(sliding_window=1), 64)
    with pytest.raises(gpukv033.UnsupportedConfigError, match="extra retained tokens"):
        gpukv033.KVCacheManager(config(sliding_window=32, extra_retained_tokens=1), 64)
    sparse = config(sliding_window=32)
    sparse.prefix_cache_retention_interval = 16
    with pytest.raises(gpukv033.UnsupportedConfigError, match="prefix_cache_retention_interval"):
        gpukv033.KVCacheManager(sparse, 64)


@pytest.mark.parametrize("cls", [VllmScheduler, gpukv033.ReferenceScheduler, gpukv033.DeviceScheduler])
def test_a_window_release_with_tokens_in_flight_is_behind_the_processed_tokens(cls):
    """vLLM's numbers, worked by hand: a running window request with tokens in
    flight releases behind ``num_computed_tokens - num_in_flight_tokens``,
    at ``allocate_slots`` only (``cache_blocks`` releases nothing), and a
    later call catches up, tail first."""
    scheduler = make_scheduler(cls, sliding_window=32)
    kvm, view = scheduler.kv_cache_manager, KVView(scheduler)
    engine = Engine(scheduler)
    engine.add(make_requests(1, 64, max_tokens=8, ignore_eos=True))
    engine.step()
    request = scheduler.requests["0"]
    assert (request.num_computed_tokens, request.num_tokens) == (64, 65)
    assert view.block_ids("0") == ([1, 2, 3, 4],)
    request.num_in_flight_tokens = 17  # as if the prefill's last 17 tokens were still running
    # 47 processed: (47 - 31) // 16 = 1 block behind the window (64 computed: 2).
    assert kvm.allocate_slots(request, 1).get_block_ids() == ([5],)
    assert view.block_ids("0") == ([0, 2, 3, 4, 5],)
    assert view.free_queue()[-1] == 1
    kvm.cache_blocks(request, 64)  # a caching call releases nothing
    assert view.block_ids("0") == ([0, 2, 3, 4, 5],)
    request.num_in_flight_tokens = 0  # the 64 processed: the lagging release catches up
    assert kvm.allocate_slots(request, 1).get_block_ids() == ([],)
    assert view.block_ids("0") == ([0, 0, 3, 4, 5],)
    assert view.free_queue()[-2:] == [1, 2]
    if cls is not VllmScheduler:
        kvm.manager.check_invariants()


def test_the_engine_core_reads_the_coordinator_stand_in():
    scheduler = make_scheduler(gpukv033.ReferenceAsyncScheduler)
    (manager,) = scheduler.kv_cache_manager.coordinator.single_type_managers
    assert manager.block_size == 16 and type(manager.kv_cache_spec).__name__ == "FullAttentionSpec"
    assert scheduler.kv_cache_manager.manager.__class__.__name__ == "ReferenceManager"


def test_connector_paths_say_they_are_refused():
    scheduler = make_scheduler(gpukv033.ReferenceScheduler)
    with pytest.raises(gpukv033.UnsupportedConfigError, match="KV-connector"):
        scheduler.kv_cache_manager.evict_blocks({1})
    with pytest.raises(gpukv033.UnsupportedConfigError, match="block_pool.free_blocks"):
        scheduler.kv_cache_manager.block_pool.free_blocks([])


def test_bad_allocations_are_refused_and_change_nothing():
    scheduler = make_scheduler(gpukv033.ReferenceScheduler)
    kvm = scheduler.kv_cache_manager
    engine = Engine(scheduler)
    engine.add(make_requests(1, 40, max_tokens=2, ignore_eos=True))
    engine.run_until_idle()
    (request,) = make_requests(1, 40, first_id=0)  # the same prompt: hits 2 blocks
    blocks, hit, _ = kvm.get_computed_blocks(request)
    assert hit == 32
    free = kvm.num_free_blocks()
    with pytest.raises(InvalidInputError, match="num_new_tokens must be an int >= 1"):
        kvm.allocate_slots(request, 0)
    with pytest.raises(InvalidInputError, match="not the hit's 32 tokens"):
        kvm.allocate_slots(request, 8, 16, blocks)
    (other,) = make_requests(1, 40, first_id=7)
    with pytest.raises(InvalidInputError, match="not the hit of request '7'"):
        kvm.allocate_slots(other, 8, 32, blocks)
    with pytest.raises(gpukv033.UnsupportedConfigError, match="external"):
        kvm.allocate_slots(request, 8, 32, blocks, num_external_computed_tokens=16)
    assert kvm.num_free_blocks() == free and kvm.request_ids() == []
    # the uncached block was freed first, so it is reused first
    assert kvm.allocate_slots(request, 8, 32, blocks).get_block_ids() == ([3],)
    kvm.check_invariants()


@pytest.mark.parametrize(("num_blocks", "reads"), [(400, False), (40, True)], ids=["roomy", "tight"])
def test_a_watermarked_admission_reads_its_hits_unheld_blocks_only_where_the_fit_turns_on_them(
        num_blocks, reads, monkeypatch):
    """vLLM's watermark counts a hit's blocks no request holds as blocks to
    take. Where the blocks to take plus every block of the hit fit under the
    watermark by the host's free count, the adapter reads nothing more (the
    fit holds whatever the read gives); in a tight pool it reads the count,
    and every step equals vLLM's either way."""
    from gpukv.core import manager_base

    calls = [0]
    real = manager_base.SharedManagerAPI.read_num_unheld

    def counted(self, block_ids):
        calls[0] += 1
        return real(self, block_ids)

    monkeypatch.setattr(manager_base.SharedManagerAPI, "read_num_unheld", counted)
    hits = 0
    for seed in (0, 1):
        config = StreamConfig(seed=seed, kv_events=False, num_speculative_tokens=0, num_blocks=num_blocks,
                              max_num_batched_tokens=512, max_num_seqs=12, num_requests=32, watermark=0.15)
        expected = run_stream(VllmScheduler, config, check_tables=False)
        got = run_stream(gpukv033.UnbatchedReferenceScheduler, config, check_tables=False)
        assert got == expected
        hits += sum(1 for step in expected for *_, hit in step.new if hit)
    assert hits > 0
    assert (calls[0] > 0) == reads, (calls[0], hits)


def test_the_device_manager_sizes_an_admission_by_vllms_token_budget():
    """A prompt longer than the step's token budget is admitted a chunk at a
    time: the device manager's admission bucket sizes its new and cached
    entries by vLLM's budget (``max_num_scheduled_tokens``), not by the
    whole prompt; its lookup positions and token slots by the prompt."""
    scheduler = make_scheduler(gpukv033.DeviceScheduler, max_num_batched_tokens=256, max_model_len=4096)
    engine = Engine(scheduler)
    engine.add(make_requests(1, 2000, max_tokens=1))
    engine.step()
    assert scheduler.requests["0"].num_computed_tokens == 256
    manager = scheduler.kv_cache_manager.manager
    steps = [b for b in manager._admission.buffers if b[3:] != (1, 1)]  # (a dry lookup's are (1, 1))
    assert steps == [(8, 128, 2048, 16, 16)]  # 124 hit positions, 2,000 tokens; 256 tokens: 16 blocks
    manager.check_invariants()


def _decided(out) -> tuple | None:
    """What a ``SchedulerOutput`` decides: tokens per request, and each new
    request's hit and block ids."""
    if out is None:
        return None
    return (dict(out.num_scheduled_tokens),
            [(r.req_id, r.num_computed_tokens, r.block_ids) for r in out.scheduled_new_reqs])


class _PreparedUnbatched(gpukv033.UnbatchedDeviceScheduler):
    prepare_admissions_at_start = True


def test_a_scheduler_that_prepares_admissions_at_start_replays_them_and_decides_alike():
    """Built with ``prepare_admissions_at_start`` (the default on CUDA), the
    device manager has a row for every running request and every admission
    bucket a prompt up to ``max_model_len`` can meet (chunks up to vLLM's
    budget) prepared before the first request; each admission then replays
    kept launches, and every step's decisions are those of a scheduler
    that prepares nothing (the default under the interpreter)."""
    from gpukv.device.admission_plan import single_prompt_buckets

    options = dict(max_num_batched_tokens=96, max_model_len=160, num_blocks=200, max_num_seqs=80)
    prepared, plain = make_scheduler(_PreparedUnbatched, **options), make_scheduler(
        gpukv033.UnbatchedDeviceScheduler, **options)
    adm = prepared.kv_cache_manager.manager._admission
    assert plain.kv_cache_manager.manager._admission.buffers == {}
    # Rows for every running request when preparing (a growth would drop the kept launches); else 64 at first.
    assert [s.kv_cache_manager.manager.block_table.shape[1] for s in (prepared, plain)] == [80, 64]
    listed = single_prompt_buckets(160, 16, 96)
    assert set(adm.buffers) == {b for b, _ in listed} and all(adm.prepared(b, dry) for b, dry in listed)
    kept = {b: dict(bufs.prepared) for b, bufs in adm.buffers.items()}

    def prompt(i: int) -> list[int]:  # (a shared prefix of 2 blocks, then 1 to 120 own tokens)
        return list(range(32)) + [1000 + i] * (1 + 13 * i % 120)

    engines = [Engine(s) for s in (prepared, plain)]
    for e in engines:
        e.add(make_requests(9, prompt=prompt, max_tokens=3))
    for _ in range(40):
        first, second = (_decided(e.step()) for e in engines)
        assert first == second
    assert all(e.finished().keys() == {str(i) for i in range(9)} for e in engines)
    assert {b: dict(bufs.prepared) for b, bufs in adm.buffers.items()} == kept  # nothing made or prepared anew
