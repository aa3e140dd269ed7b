"""Random request streams on vLLM 0.33's schedulers, recorded step by step (``streams.py``).

Today they check that a stream is reproducible (the same seed, the same
records: what makes a step-by-step comparison meaningful), that it exercises
what it is for (hits, chunked prefill, preemption, speculative tokens, aborts,
KV events), and every step's block tables and budgets. A gpukv class is held
to vLLM by ``assert run_stream(gpukv_cls, config) == run_stream(VllmScheduler, config)``,
on full attention and on sliding-window and hybrid groups, synchronous and
with tokens in flight (``AsyncScheduler``, speculative drafts: window blocks
released behind vLLM's processed tokens).
"""

from __future__ import annotations

import pytest

# (vLLM's names through the harness, which skips this module where vLLM 0.33 is not importable)
from .harness import (
    EXTRA_SCHEDULERS,
    HIT_LIMIT,
    Request,
    RequestStatus,
    VllmAsyncScheduler,
    VllmKVCacheManager,
    VllmScheduler,
    gpukv033,
    is_async,
    scheduler_params,
    vllm_version,
)
from .streams import StreamConfig, coverage, run_stream

SEEDS = [0, 1, 2, 3]


@pytest.mark.parametrize("cls", scheduler_params())
@pytest.mark.parametrize("seed", SEEDS)
def test_stream_is_reproducible_and_within_the_budgets(cls, seed):
    config = StreamConfig(seed=seed)
    first = run_stream(cls, config)
    assert run_stream(cls, config, check_tables=False) == first
    for record in first:
        assert sum(record.num_scheduled_tokens.values()) <= config.max_num_batched_tokens
        assert len(record.num_scheduled_tokens) <= config.max_num_seqs
    everyone = {str(i) for i in range(config.num_requests)}
    finished = [rid for r in first for rid in r.finish_reasons]
    aborted = [rid for r in first for rid in r.aborted]
    assert len(finished) + len(aborted) == len(everyone)  # each request ends once
    assert set(finished) | set(aborted) == everyone
    admitted = {rid for r in first for rid, *_ in r.new}
    assert admitted | set(aborted) == everyone  # only an aborted request may never run


def test_streams_exercise_hits_chunks_preemption_drafts_aborts_and_events():
    totals: dict[str, int] = {}
    for seed in SEEDS:
        for name, count in coverage(run_stream(VllmScheduler, StreamConfig(seed=seed), check_tables=False)).items():
            totals[name] = totals.get(name, 0) + count
    assert all(count > 0 for count in totals.values()), totals


def test_different_seeds_make_different_streams():
    assert run_stream(VllmScheduler, StreamConfig(seed=0)) != run_stream(VllmScheduler, StreamConfig(seed=1))


# ---------------------------------------------------------------- gpukv held to vLLM, step by step

GPUKV = [pytest.param(cls, id=name) for name, cls in EXTRA_SCHEDULERS.items()]


@pytest.mark.parametrize("cls", GPUKV)
@pytest.mark.parametrize("seed", SEEDS)
def test_gpukv_stream_is_vllms_step_by_step(cls, seed):
    """Every step's ``SchedulerOutput``, tokens, stats, usage and KV events of
    a gpukv class equal those of vLLM's own class of the same kind (sync or
    async) on the same stream."""
    vllm_cls = VllmAsyncScheduler if is_async(cls) else VllmScheduler
    config = StreamConfig(seed=seed)
    expected = run_stream(vllm_cls, config, check_tables=False)
    got = run_stream(cls, config)
    for step, (want, have) in enumerate(zip(expected, got, strict=False)):
        assert have == want, f"step {step} differs"
    assert len(got) == len(expected)  # (after the steps: the first that differs says more)


FEATURE_STREAMS = [pytest.param(dict(bounded_hits=True), id="bounded-hits"),
                   pytest.param(dict(cache_aware_window=4), id="cache-aware"),
                   pytest.param(dict(bounded_hits=True, cache_aware_window=8, kv_events=False,
                                     num_speculative_tokens=0), id="both-batched"),
                   pytest.param(dict(priority=True), id="priority"),
                   pytest.param(dict(priority=True, kv_events=False, num_speculative_tokens=0), id="priority-batched"),
                   pytest.param(dict(lora=True), id="lora"),
                   pytest.param(dict(lora=True, kv_events=False, num_speculative_tokens=0), id="lora-batched"),
                   pytest.param(dict(lora=True, max_loras=1), id="lora-one-a-step"),
                   pytest.param(dict(prefill_interval=3), id="prefill-cadence"),
                   pytest.param(dict(bends=True), id="paused-and-throttled"),
                   pytest.param(dict(bends=True, kv_events=False, num_speculative_tokens=0),
                                id="paused-and-throttled-batched"),
                   pytest.param(dict(reset_rate=0.05), id="cache-resets"),
                   pytest.param(dict(mm=True), id="multimodal"),
                   pytest.param(dict(mm=True, kv_events=False, num_speculative_tokens=0), id="multimodal-batched"),
                   pytest.param(dict(long_prefill_threshold=24), id="long-prefill-threshold"),
                   pytest.param(dict(long_prefill_threshold=24, kv_events=False, num_speculative_tokens=0),
                                id="long-prefill-threshold-batched"),
                   pytest.param(dict(long_prefill_threshold=8, adaptive_threshold=True, kv_events=False,
                                     num_speculative_tokens=0), id="adaptive-threshold-batched")]


@pytest.mark.parametrize("cls", GPUKV)
@pytest.mark.parametrize("seed", SEEDS[:2])
@pytest.mark.parametrize("options", FEATURE_STREAMS)
def test_gpukv_feature_streams_are_vllms(cls, seed, options):
    """The same step by step with what else vLLM's loop follows: 0.34's
    prompt-logprob requests whose hits stop at their first scored token (skipped
    on 0.33) and its waiting queue reordered by cached prefix (a window over
    the first waiting requests, from any usage); the priority policy; LoRA
    adapters (keyed as vLLM keys them), one a step or unconstrained; the
    prefill cadence; pauses and throttled prefills; prefix-cache resets that
    preempt every running request (after a weight update); images; the
    long-prefill threshold, fixed and adaptive."""
    if options.get("bounded_hits") and not HIT_LIMIT:
        pytest.skip(f"vLLM {vllm_version()} has no prefix-cache hit limit")
    vllm_cls = VllmAsyncScheduler if is_async(cls) else VllmScheduler
    config = StreamConfig(seed=seed, **options)
    expected = run_stream(vllm_cls, config, check_tables=False)
    got = run_stream(cls, config)
    for step, (want, have) in enumerate(zip(expected, got, strict=False)):
        assert have == want, f"step {step} differs"
    assert len(got) == len(expected)


def test_the_feature_streams_exercise_bounded_hits_and_reordering(monkeypatch):
    """On vLLM's own scheduler: the cache-aware window changes some decision
    (the stream differs from plain FCFS), and so do the priority policy (a
    preempted request is not always the last running one) and the LoRA
    adapters (they split the cache: fewer hits; one adapter a step holds
    requests back), the prefill cadence and the pauses and throttled steps
    (they hold prefills back), the long-prefill threshold (it chunks
    prompts; adaptive, its floor lifts a low one), the cache resets (each
    preempts every running request), the images (encoder inputs scheduled,
    hits made), and the hit
    bounds (the stream differs from one whose requests' own limits are
    ignored)."""
    plain = run_stream(VllmScheduler, StreamConfig(seed=SEEDS[0]), check_tables=False)
    reordered = run_stream(VllmScheduler, StreamConfig(seed=SEEDS[0], cache_aware_window=4), check_tables=False)
    assert reordered != plain
    by_priority = run_stream(VllmScheduler, StreamConfig(seed=SEEDS[0], priority=True), check_tables=False)
    assert by_priority != plain and any(r.preempted for r in by_priority)
    hits = [sum(r.prefix_cache[2] for r in stream if r.prefix_cache) for stream in (
        plain, run_stream(VllmScheduler, StreamConfig(seed=SEEDS[0], lora=True), check_tables=False))]
    assert 0 < hits[1] < hits[0]
    for options in (dict(prefill_interval=3), dict(bends=True), dict(long_prefill_threshold=24)):
        assert run_stream(VllmScheduler, StreamConfig(seed=SEEDS[0], **options), check_tables=False) != plain
    floored = run_stream(VllmScheduler, StreamConfig(seed=SEEDS[0], long_prefill_threshold=8, adaptive_threshold=True),
                         check_tables=False)  # (the floor, 64 over the requests, lifts the threshold of 8)
    assert floored != run_stream(VllmScheduler, StreamConfig(seed=SEEDS[0], long_prefill_threshold=8),
                                 check_tables=False)
    reset = run_stream(VllmScheduler, StreamConfig(seed=SEEDS[0], reset_rate=0.05), check_tables=False)
    assert [r.reset for r in reset if r.reset is not None].count(True) >= 2 and any(r.preempted for r in reset)
    images = run_stream(VllmScheduler, StreamConfig(seed=SEEDS[0], mm=True), check_tables=False)
    assert sum(len(r.encoder_inputs) for r in images) >= 3 and coverage(images)["hits"] > 0

    one_a_step = run_stream(VllmScheduler, StreamConfig(seed=SEEDS[0], lora=True, max_loras=1), check_tables=False)
    assert one_a_step != run_stream(VllmScheduler, StreamConfig(seed=SEEDS[0], lora=True), check_tables=False)
    if not HIT_LIMIT:
        pytest.skip(f"vLLM {vllm_version()} has no prefix-cache hit limit")
    configs = [StreamConfig(seed=seed, bounded_hits=True) for seed in SEEDS]
    bounded = [run_stream(VllmScheduler, config, check_tables=False) for config in configs]
    monkeypatch.setattr(Request, "get_max_cache_hit_length",  # (the request's own limit ignored)
                        lambda self, bound=None: min(self.num_tokens - 1, self.num_tokens if bound is None else bound))
    unbounded = [run_stream(VllmScheduler, config, check_tables=False) for config in configs]
    assert sum(b != u for b, u in zip(bounded, unbounded, strict=True)) >= 2


def test_gpukv_keys_the_streams_images(monkeypatch):
    """The multimodal streams hold gpukv to vLLM's image keys: with the
    images left out of gpukv's keys, its decisions part from vLLM's (hits on
    the same placeholders of another image)."""
    monkeypatch.setattr(gpukv033.manager, "mm_items", lambda *_: ())
    config = StreamConfig(seed=SEEDS[0], mm=True)
    assert run_stream(gpukv033.ReferenceScheduler, config) != run_stream(VllmScheduler, config, check_tables=False)


DEVICE = [pytest.param(gpukv033.DeviceScheduler, {}, id="gpukv-device"),
          pytest.param(gpukv033.DeviceScheduler, dict(mm=True), id="gpukv-device-multimodal"),
          pytest.param(gpukv033.DeviceAsyncScheduler, dict(max_num_batched_tokens=96, num_blocks=20),
                       id="gpukv-device-async-runs")]


@pytest.mark.parametrize(("cls", "shape"), DEVICE)
def test_gpukv_device_stream_is_vllms_step_by_step(cls, shape, monkeypatch):
    """The device backend on one stream of half the requests, sync and async
    (the whole stream costs about 45 s under Triton's interpreter, hence not
    the whole suite: the reference runs that), with KV events and drafts, on
    the batched path: the running loop as one gpukv step, and (the larger
    budget) runs of admissions (``test_batched.py``)."""
    made: list = []
    init = gpukv033.admissions.AdmittedRun.__init__

    def counting_init(run: object, adapter: object) -> None:
        init(run, adapter)
        made.append(run)

    monkeypatch.setattr(gpukv033.admissions.AdmittedRun, "__init__", counting_init)
    vllm_cls = VllmAsyncScheduler if is_async(cls) else VllmScheduler
    config = StreamConfig(seed=SEEDS[3], num_requests=12, arrival_steps=6, **shape)
    expected = run_stream(vllm_cls, config, check_tables=False)
    got = run_stream(cls, config)
    exercised = coverage(expected)
    assert all(count > 0 for count in exercised.values()), exercised  # the shorter stream still has them all
    for step, (want, have) in enumerate(zip(expected, got, strict=False)):
        assert have == want, f"step {step} differs"
    assert len(got) == len(expected)
    assert sum(run.num_admitted for run in made) > 0


# ---------------------------------------------------------------- sliding windows and hybrid groups

def window_streams(seed: int, **overrides) -> list:
    """Two window-only and two hybrid (full + window) streams, no speculative
    decoding unless ``overrides`` say so: a 32-token budget, so a 17-token
    window's admission cap (5 blocks: cdiv(16 + 32, 16) + 1) is below long
    prompts' blocks and decides admissions; the hybrid ones preempt and see
    shared-prefix boundaries. A 17-token window's skip boundary (``w - 1``
    tokens) falls on a block boundary; 20 and 24 do not, where a release
    behind the processed tokens parts from one behind the computed ones."""
    shapes = [dict(sliding_window=17, num_blocks=12), dict(sliding_window=17, hybrid=True, num_blocks=20),
              dict(sliding_window=20, hybrid=True, num_blocks=16), dict(sliding_window=24, num_blocks=12)]
    return [StreamConfig(**(dict(seed=seed, num_speculative_tokens=0, max_num_batched_tokens=32) | shape
                            | overrides)) for shape in shapes]


WINDOW_SEEDS = [0, 1]


def test_window_streams_exercise_hits_chunks_preemption_boundaries_and_events():
    totals: dict[str, int] = {}
    for seed in WINDOW_SEEDS:
        for config in window_streams(seed):
            records = run_stream(VllmScheduler, config, check_tables=False)
            for name, count in coverage(records).items():
                totals[name] = totals.get(name, 0) + count
            totals["boundaries"] = totals.get("boundaries", 0) + sum(1 for r in records for b in r.boundaries.values()
                                                                     if b)
    del totals["spec_steps"]  # (none: gpukv follows windows without speculative decoding)
    assert all(count > 0 for count in totals.values()), totals


@pytest.mark.parametrize("seed", WINDOW_SEEDS)
def test_gpukv_window_streams_are_vllms_step_by_step(seed):
    """Window-only and hybrid streams on the reference backend: every step's
    output, tokens, stats, usage, KV events (with their group's kind and
    window) and shared-prefix boundaries equal vLLM's ``Scheduler``'s."""
    for config in window_streams(seed):
        expected = run_stream(VllmScheduler, config, check_tables=False)
        got = run_stream(gpukv033.ReferenceScheduler, config)
        for step, (want, have) in enumerate(zip(expected, got, strict=False)):
            assert have == want, f"{config}: step {step} differs"
        assert len(got) == len(expected)


def test_gpukv_device_window_stream_is_vllms_step_by_step():
    """The device backend on one short hybrid stream (6 requests of at most
    12 output tokens: Triton's interpreter is slow, and two groups cost
    twice the launches), which still hits (window blocks as the null block),
    chunks, preempts, evicts and meets a shared-prefix boundary."""
    config = window_streams(1, num_requests=6, arrival_steps=3, max_output_tokens=12)[1]
    expected = run_stream(VllmScheduler, config, check_tables=False)
    got = run_stream(gpukv033.DeviceScheduler, config)
    counts = coverage(expected)
    assert all(counts[name] > 0 for name in ("hits", "chunks", "preemptions", "stored_events", "removed_events"))
    assert any(b for r in expected for b in r.boundaries.values())
    assert any(b == 0 for r in expected for _, groups, _ in r.new for group in groups for b in group)
    for step, (want, have) in enumerate(zip(expected, got, strict=False)):
        assert have == want, f"step {step} differs"
    assert len(got) == len(expected)


# ------------------------------------------- windows with tokens in flight (async scheduling, drafts)

IN_FLIGHT = [pytest.param(gpukv033.ReferenceAsyncScheduler, VllmAsyncScheduler, 0, id="async"),
             pytest.param(gpukv033.ReferenceAsyncScheduler, VllmAsyncScheduler, 2, id="async-drafts"),
             pytest.param(gpukv033.ReferenceScheduler, VllmScheduler, 2, id="drafts")]


def _count_parted_releases(monkeypatch) -> list[int]:
    """Patch vLLM's ``allocate_slots`` to count the running requests' calls
    where a window group's release behind the processed tokens
    (``total_computed - num_in_flight_tokens``) stops elsewhere than one
    behind the computed tokens would."""
    parted = [0]
    original = VllmKVCacheManager.allocate_slots

    def allocate_slots(self, request, *args, **kwargs):
        if request.status == RequestStatus.RUNNING:
            computed = min(request.num_computed_tokens, self.max_model_len)
            processed = max(0, computed - request.num_in_flight_tokens)
            for manager in self.coordinator.single_type_managers:
                bs = manager.block_size
                if manager.get_num_skipped_tokens(processed) // bs != manager.get_num_skipped_tokens(computed) // bs:
                    parted[0] += 1
        return original(self, request, *args, **kwargs)

    monkeypatch.setattr(VllmKVCacheManager, "allocate_slots", allocate_slots)
    return parted


@pytest.mark.parametrize("cls, vllm_cls, num_spec", IN_FLIGHT)
@pytest.mark.parametrize("seed", WINDOW_SEEDS)
def test_gpukv_window_streams_with_tokens_in_flight_are_vllms_step_by_step(cls, vllm_cls, num_spec, seed,
                                                                          monkeypatch):
    """Window-only and hybrid streams on the reference backend with tokens in
    flight: async scheduling (the batch before still in flight), speculative
    drafts (accepted ones put vLLM's computed tokens ahead of gpukv's until
    they are appended), or both. Every step equals vLLM's; the async streams
    make releases where the processed and the computed tokens part, and the
    drafts streams accept drafts."""
    parted = _count_parted_releases(monkeypatch)
    accepted = 0
    for config in window_streams(seed, num_speculative_tokens=num_spec):
        expected = run_stream(vllm_cls, config, check_tables=False)
        accepted += sum(r.spec[2] for r in expected if r.spec)
        got = run_stream(cls, config)
        for step, (want, have) in enumerate(zip(expected, got, strict=False)):
            assert have == want, f"{config}: step {step} differs"
        assert len(got) == len(expected)
    assert parted[0] > 0 or vllm_cls is VllmScheduler  # (synchronous: nothing in flight at allocate_slots)
    assert accepted > 0 or not num_spec


DEVICE_IN_FLIGHT = [pytest.param(gpukv033.DeviceAsyncScheduler, VllmAsyncScheduler, 0, id="device-async"),
                    pytest.param(gpukv033.DeviceScheduler, VllmScheduler, 2, id="device-drafts")]


@pytest.mark.parametrize("cls, vllm_cls, num_spec", DEVICE_IN_FLIGHT)
def test_gpukv_device_window_stream_with_tokens_in_flight_is_vllms_step_by_step(cls, vllm_cls, num_spec):
    """The device backend's host plan releasing behind the processed tokens:
    one short hybrid stream (a 20-token window) under async scheduling, and
    one with drafts."""
    config = window_streams(1, num_requests=6, arrival_steps=3, max_output_tokens=12,
                            num_speculative_tokens=num_spec)[2]
    expected = run_stream(vllm_cls, config, check_tables=False)
    got = run_stream(cls, config)
    for step, (want, have) in enumerate(zip(expected, got, strict=False)):
        assert have == want, f"step {step} differs"
    assert len(got) == len(expected)
