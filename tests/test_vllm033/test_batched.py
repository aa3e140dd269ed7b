"""gpukv's batched path under vLLM 0.33: the running loop
(``gpukv.vllm.v0_33.pending``) and runs of the waiting loop
(``gpukv.vllm.v0_33.admissions``).

Inside ``schedule()`` the running requests' ``allocate_slots`` calls are
answered on the host and applied as one gpukv step, and a run of plain
waiting requests is admitted as one more, vLLM's calls answered from it.
Held to vLLM's own scheduler step by step on random streams, with KV
events (a step's events regrouped into vLLM's per-call order) and without,
with and without speculative decoding (n-gram drafts), with roomy and tight
pools (preemption inside the running loop, after some calls are pending;
runs refused part way); in sliding-window models the running calls that
release no block, the others one call each, as vLLM's release frees;
counted (one gpukv step per loop, flat in the requests);
and taken apart (the blocks handed back fill at the flush, a refusal keeps
nothing, every reader flushes first, a host count gpukv disagrees with
raises, a call the run did not expect raises, the batch built from the
adapter's records of gpukv's tokens and taken as checked, a stale record
refused).
"""

from __future__ import annotations

from array import array

import numpy as np
import pytest

from gpukv.core import manager_base as shared_api
from gpukv.errors import InvalidInputError

# (vLLM's and gpukv's 0.33 names through the harness, which skips this module where vLLM 0.33 is not importable)
from .harness import (
    Engine,
    RequestStatus,
    VllmAsyncScheduler,
    VllmKVCacheManager,
    VllmScheduler,
    gpukv033,
    is_async,
    make_requests,
    make_scheduler,
)
from .streams import StreamConfig, coverage, lora_adapter, run_stream

AdmittedRun = gpukv033.admissions.AdmittedRun
LoraSlots = gpukv033.admissions.LoraSlots
PendingGrowth = gpukv033.pending.PendingGrowth

SEEDS = [0, 1, 2, 3]
REFERENCE = [pytest.param(gpukv033.ReferenceScheduler, id="ref"),
             pytest.param(gpukv033.ReferenceAsyncScheduler, id="ref-async")]


def _count_calls(monkeypatch: pytest.MonkeyPatch, manager: object, calls: dict[str, int]) -> None:
    """Count in ``calls`` each call of the manager's methods it names."""
    for name in calls:
        real = getattr(manager, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(manager, name, counted)


def _assert_same_steps(expected: list, got: list) -> None:
    for step, (want, have) in enumerate(zip(expected, got, strict=False)):
        assert have == want, f"step {step} differs"
    assert len(got) == len(expected)


class _Counting:
    """Every ``PendingGrowth`` and ``AdmittedRun`` made while it is on, for
    their counters."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.made: list = []  # PendingGrowth
        self.runs: list = []  # AdmittedRun
        for cls, into in ((PendingGrowth, self.made), (AdmittedRun, self.runs)):
            def counting_init(part: object, adapter: object, _init=cls.__init__, _into=into) -> None:
                _init(part, adapter)
                _into.append(part)

            monkeypatch.setattr(cls, "__init__", counting_init)

    def totals(self) -> tuple[int, int, int]:
        return (sum(p.num_calls for p in self.made), sum(p.num_steps for p in self.made),
                sum(p.num_reads for p in self.made))

    def admitted(self) -> tuple[int, int]:
        return sum(r.num_runs for r in self.runs), sum(r.num_admitted for r in self.runs)

    def chunked(self) -> int:
        return sum(r.num_chunked for r in self.runs)


@pytest.mark.parametrize("cls", REFERENCE)
@pytest.mark.parametrize("num_spec", [0, 2])
@pytest.mark.parametrize("num_blocks", [20, 13])
def test_batched_streams_are_vllms_step_by_step(cls, num_spec, num_blocks, monkeypatch):
    """Each step's ``SchedulerOutput``, tokens, stats and usage equal vLLM's
    on four seeds; the batched path answered most running calls, and the
    tight pool (13 blocks) made it read the device past its bound (the
    preemptions inside the running loop)."""
    counting = _Counting(monkeypatch)
    vllm_cls = VllmAsyncScheduler if is_async(cls) else VllmScheduler
    preempted = 0
    for seed in SEEDS:
        config = StreamConfig(seed=seed, kv_events=False, num_speculative_tokens=num_spec, num_blocks=num_blocks)
        expected = run_stream(vllm_cls, config, check_tables=False)
        _assert_same_steps(expected, run_stream(cls, config))
        preempted += coverage(expected)["preemptions"]
    calls, steps, reads = counting.totals()
    assert calls > steps > 0
    if num_blocks == 20:  # (max_num_seqs 6: several running requests a step, one gpukv step for them)
        assert calls > 3 * steps
    else:  # (a preemption flushes the calls before it: more steps)
        assert preempted > 0 and reads > 0


@pytest.mark.parametrize("cls", REFERENCE)
@pytest.mark.parametrize("num_blocks", [48, 24])
def test_admission_runs_are_vllms_step_by_step(cls, num_blocks, monkeypatch):
    """No speculative decoding and a budget that takes whole prompts: the
    waiting loop admits runs of several requests as one gpukv step, some
    refused part way in the tighter pool; every step equals vLLM's."""
    counting = _Counting(monkeypatch)
    vllm_cls = VllmAsyncScheduler if is_async(cls) else VllmScheduler
    for seed in SEEDS:
        config = StreamConfig(seed=seed, kv_events=False, num_speculative_tokens=0, num_blocks=num_blocks,
                              max_num_batched_tokens=512, max_num_seqs=12, num_requests=32)
        _assert_same_steps(run_stream(vllm_cls, config, check_tables=False), run_stream(cls, config))
    runs, admitted = counting.admitted()
    assert runs > 0 and admitted > 0, (runs, admitted)
    if num_blocks == 48:  # (roomy: runs of several; the tight pool refuses many a run's head)
        assert admitted > runs, (runs, admitted)


@pytest.mark.parametrize("cls", REFERENCE)
@pytest.mark.parametrize("options", [dict(priority=True), dict(lora=True, max_loras=1),
                                     dict(lora=True, max_loras=2, priority=True)],
                         ids=["priority", "lora-one-a-step", "lora-two-a-step-priority"])
def test_admission_runs_under_the_priority_policy_and_a_lora_config_are_vllms(cls, options, monkeypatch):
    """The priority policy only orders vLLM's waiting loop (a run follows
    the queue's priority order), and a LoRA config only adds the ``max_loras``
    skip of a LoRA request (a run takes LoRA requests while their adapters
    keep the step within it, and ends where vLLM skips one): runs are still
    admitted as one gpukv step, LoRA requests among them, and every step
    equals vLLM's."""
    counting = _Counting(monkeypatch)
    with_lora = []
    admission = AdmittedRun._admission

    def counted(run, request, *args, **kwargs):
        with_lora.append(request.lora_request is not None)
        return admission(run, request, *args, **kwargs)

    monkeypatch.setattr(AdmittedRun, "_admission", counted)
    vllm_cls = VllmAsyncScheduler if is_async(cls) else VllmScheduler
    for seed in SEEDS:
        config = StreamConfig(seed=seed, kv_events=False, num_speculative_tokens=0, num_blocks=48,
                              max_num_batched_tokens=512, max_num_seqs=12, num_requests=32, **options)
        _assert_same_steps(run_stream(vllm_cls, config, check_tables=False), run_stream(cls, config))
    runs, admitted = counting.admitted()
    assert admitted > runs > 0, (runs, admitted)
    assert with_lora.count(True) > 0 if options.get("lora") else not any(with_lora)


@pytest.mark.parametrize("cls", REFERENCE)
@pytest.mark.parametrize("options", [dict(bends=True), dict(prefill_interval=3)], ids=["throttled", "cadence"])
def test_admission_runs_on_throttled_and_cadence_steps_that_defer_nothing_are_vllms(cls, options, monkeypatch):
    """A throttled step (the DP engine core's prefill balancing) or one the
    prefill cadence holds defers prefills only while some running request
    decodes and the last admitting step was not capacity-bound
    (``defers_prefills``); on the other such steps vLLM's waiting loop is
    plain, and a run is admitted as one gpukv step. Every step equals
    vLLM's, the deferring ones included (admitted one by one)."""
    counting = _Counting(monkeypatch)
    predicted: list[int] = []  # the run's length on each step that throttled or had a cadence
    plain = gpukv033.scheduler.plain_run

    def recording(s, adapter, tokens, throttle_prefills, cap=0):
        run = plain(s, adapter, tokens, throttle_prefills, cap)
        if throttle_prefills or s.local_prefill_interval > 1:
            predicted.append(len(run.requests))
        return run

    monkeypatch.setattr(gpukv033.scheduler, "plain_run", recording)
    vllm_cls = VllmAsyncScheduler if is_async(cls) else VllmScheduler
    for seed in SEEDS:
        config = StreamConfig(seed=seed, kv_events=False, num_speculative_tokens=0, num_blocks=48,
                              max_num_batched_tokens=512, max_num_seqs=12, num_requests=32, **options)
        _assert_same_steps(run_stream(vllm_cls, config, check_tables=False), run_stream(cls, config))
    assert sum(1 for n in predicted if n) > 0, predicted
    runs, admitted = counting.admitted()
    assert admitted > runs > 0, (runs, admitted)


def test_prefills_are_deferred_as_vllm_defers_them():
    """``defers_prefills`` by hand, each condition turned in turn."""
    from types import SimpleNamespace

    def scheduler(**fields):
        base = dict(prefill_capacity_bound=False, local_prefill_interval=1, num_executed_steps=10,
                    last_prefill_step=9, running=[SimpleNamespace(is_prefill_chunk=False)])
        return SimpleNamespace(**(base | fields))

    defers = gpukv033.admissions.defers_prefills
    assert defers(scheduler(), throttle_prefills=True)
    assert not defers(scheduler(), throttle_prefills=False)  # (no throttle, no cadence)
    assert not defers(scheduler(prefill_capacity_bound=True), throttle_prefills=True)
    assert not defers(scheduler(running=[SimpleNamespace(is_prefill_chunk=True)]), throttle_prefills=True)
    assert not defers(scheduler(running=[]), throttle_prefills=True)
    # the cadence: step 11 is 2 after the last prefill (step 9), under an interval of 3; 12 is not
    assert defers(scheduler(local_prefill_interval=3), throttle_prefills=False)
    assert not defers(scheduler(local_prefill_interval=3, num_executed_steps=11), throttle_prefills=False)
    assert not defers(scheduler(local_prefill_interval=3, prefill_capacity_bound=True), throttle_prefills=False)


@pytest.mark.parametrize("cls", REFERENCE)
@pytest.mark.parametrize(("budget", "watermark"), [(48, 0.0), (512, 0.15), (48, 0.15)],
                         ids=["chunked", "watermark", "chunked-watermark"])
def test_chunked_and_watermarked_runs_are_vllms_step_by_step(cls, budget, watermark, monkeypatch):
    """A budget that chunks most prompts (runs end with a chunked admission)
    and a watermark (each request of a run proved on the host to pass it):
    every step equals vLLM's, and runs did form (with chunked last requests
    where the budget chunks)."""
    counting = _Counting(monkeypatch)
    vllm_cls = VllmAsyncScheduler if is_async(cls) else VllmScheduler
    for seed in SEEDS:
        config = StreamConfig(seed=seed, kv_events=False, num_speculative_tokens=0, num_blocks=48,
                              max_num_batched_tokens=budget, max_num_seqs=12, num_requests=32, watermark=watermark)
        _assert_same_steps(run_stream(vllm_cls, config, check_tables=False), run_stream(cls, config))
    runs, admitted = counting.admitted()
    assert runs > 0 and admitted > 0, (runs, admitted)
    assert (counting.chunked() > 0) == (budget == 48), counting.chunked()


@pytest.mark.parametrize("cls", REFERENCE)
@pytest.mark.parametrize(("budget", "watermark", "num_spec"), [(512, 0.0, 0), (48, 0.15, 0), (64, 0.0, 2)],
                         ids=["whole", "chunked-watermark", "drafts"])
def test_window_model_runs_are_vllms_step_by_step(cls, budget, watermark, num_spec, monkeypatch):
    """A window-only model (a 24-token window: a hit's blocks before it are
    the null block) admits runs of waiting requests as one step, whole or
    with a chunked last request, under a watermark and with speculative
    drafts; every step equals vLLM's, and runs formed."""
    counting = _Counting(monkeypatch)
    vllm_cls = VllmAsyncScheduler if is_async(cls) else VllmScheduler
    for seed in SEEDS[:2]:
        config = StreamConfig(seed=seed, kv_events=False, num_speculative_tokens=num_spec, num_blocks=48,
                              max_num_batched_tokens=budget, max_num_seqs=12, num_requests=32, watermark=watermark,
                              sliding_window=24)
        _assert_same_steps(run_stream(vllm_cls, config, check_tables=False), run_stream(cls, config))
    runs, admitted = counting.admitted()
    assert runs > 0 and admitted > 0, (runs, admitted)
    assert (counting.chunked() > 0) == (budget < 512), counting.chunked()  # (512 takes every prompt whole)


@pytest.mark.parametrize("cls", REFERENCE)
@pytest.mark.parametrize("groups", [dict(sliding_window=20, hybrid=True), dict(sliding_window=36, second_window=20)],
                         ids=["full-attention-led", "window-led"])
def test_a_hybrid_runs_boundaries_are_vllms_lookups(cls, groups, monkeypatch):
    """A model that caches with two lookup groups: a batched run answers
    each lookup with the shared-prefix boundary vLLM's own lookup gives at
    that point of its loop (the lone hit of vLLM's first lookup group: with
    full attention, gpukv's step's full-attention hit; with two window specs,
    read from the event index as it stood before the request's own events).
    Every step's boundaries equal vLLM's, and runs answered some above 0."""
    counting = _Counting(monkeypatch)
    answered: list[int] = []
    lookup = AdmittedRun.lookup

    def recorded(self, request):
        entry = lookup(self, request)
        if entry is not None:
            answered.append(entry.boundary)
        return entry

    monkeypatch.setattr(AdmittedRun, "lookup", recorded)
    vllm_cls = VllmAsyncScheduler if is_async(cls) else VllmScheduler
    for seed in SEEDS:
        config = StreamConfig(seed=seed, kv_events=False, num_speculative_tokens=0, num_blocks=40,
                              max_num_batched_tokens=256, max_num_seqs=12, num_requests=32, **groups)
        expected = run_stream(vllm_cls, config, check_tables=False)
        _assert_same_steps(expected, run_stream(cls, config))
    assert counting.admitted()[1] > 0
    assert any(b > 0 for b in answered), answered


def test_unbatched_classes_make_one_call_per_request(monkeypatch):
    counting = _Counting(monkeypatch)
    config = StreamConfig(seed=0, kv_events=False)
    expected = run_stream(VllmAsyncScheduler, config, check_tables=False)
    _assert_same_steps(expected, run_stream(gpukv033.UnbatchedReferenceAsyncScheduler, config))
    assert counting.totals() == (0, 0, 0) and counting.admitted() == (0, 0)


def _count_vllm_releases(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Patch vLLM's ``allocate_slots`` to count the running requests' calls
    whose window release dropped a block (freed, or still held by another
    request: either way the null block takes its place): ``cached`` when
    every block it dropped carried a hash, ``uncached`` when one did not."""
    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator

    counts, running = {"cached": 0, "uncached": 0}, [False]
    release, allocate = KVCacheCoordinator.remove_skipped_blocks, VllmKVCacheManager.allocate_slots

    def blocks_of(coordinator, request_id):
        return [list(m.req_to_blocks.get(request_id, ())) for m in coordinator.single_type_managers]

    def remove_skipped_blocks(self, request_id, *args, **kwargs):
        before = blocks_of(self, request_id)
        release(self, request_id, *args, **kwargs)
        after = blocks_of(self, request_id)
        dropped = [b for old, new in zip(before, after, strict=True) for b, now in zip(old, new, strict=False)
                   if not b.is_null and now.is_null]
        if running[0] and dropped:
            counts["cached" if all(b.block_hash is not None for b in dropped) else "uncached"] += 1

    def allocate_slots(self, request, *args, **kwargs):
        running[0] = request.status == RequestStatus.RUNNING
        try:
            return allocate(self, request, *args, **kwargs)
        finally:
            running[0] = False

    monkeypatch.setattr(KVCacheCoordinator, "remove_skipped_blocks", remove_skipped_blocks)
    monkeypatch.setattr(VllmKVCacheManager, "allocate_slots", allocate_slots)
    return counts


def _count_releasing_calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Patch ``PendingGrowth`` to count the running calls whose window
    release drops a block: ``batched`` (answered on the host, the release in
    the step) and ``per_request`` (left to the per-request path,
    ``RELEASES``); and ``unfit``, the calls left there that release nothing
    but need more blocks than were free before the step while a release is
    pending."""
    counts, add, keep = {"batched": 0, "per_request": 0, "unfit": 0}, PendingGrowth.add, PendingGrowth._keep_window
    processed_tokens = gpukv033.window_releases.processed_tokens

    def counted_add(self, request, held, *args, **kwargs):
        rid, processed = request.request_id, processed_tokens(request, self._max_model_len)
        releases = self._windows.stops_after(rid, processed, held[1]) is not None
        blocks = add(self, request, held, *args, **kwargs)
        if blocks is gpukv033.pending.RELEASES:
            counts["per_request" if releases else "unfit"] += 1
        return blocks

    def counted_keep(self, request_id, window):
        counts["batched"] += window[1] is not None and window[1] != self._windows.null_blocks[request_id]
        keep(self, request_id, window)

    monkeypatch.setattr(PendingGrowth, "add", counted_add)
    monkeypatch.setattr(PendingGrowth, "_keep_window", counted_keep)
    return counts


WINDOW_SHAPES = [pytest.param(dict(sliding_window=17, num_blocks=12), id="window"),
                 pytest.param(dict(sliding_window=20, hybrid=True, num_blocks=16), id="hybrid"),
                 pytest.param(dict(sliding_window=24, hybrid=True, num_blocks=12), id="hybrid-tight"),
                 pytest.param(dict(sliding_window=17, hybrid=True, num_blocks=16, prefix_caching=False),
                              id="hybrid-uncached"),
                 pytest.param(dict(sliding_window=17, second_window=33, num_blocks=16), id="two-windows")]


@pytest.mark.parametrize("cls", REFERENCE)
@pytest.mark.parametrize("kv_events", [False, True], ids=["no-events", "events"])
@pytest.mark.parametrize("shape", WINDOW_SHAPES)
def test_window_models_batch_what_vllms_order_allows(cls, kv_events, shape, monkeypatch):
    """Sliding-window and hybrid models, synchronous and async (tokens in
    flight: releases behind the processed tokens), with KV events and
    without, prefix caching on and off: every step equals vLLM's. The
    running loop's calls are batched, those whose release drops only cached
    blocks too; a release that may drop an uncached block, or a take past
    the blocks free before the step while a release is pending, takes the
    per-request path. Counted against vLLM's own calls: the releasing calls
    gpukv batched or left are exactly those where vLLM's release dropped a
    block, and every call whose release dropped an uncached one was left.
    Waiting runs are admitted as one step too."""
    counting = _Counting(monkeypatch)
    vllm_cls = VllmAsyncScheduler if is_async(cls) else VllmScheduler
    vllm_counts, gpukv_counts = _count_vllm_releases(monkeypatch), _count_releasing_calls(monkeypatch)
    batched = 0
    for seed in SEEDS[:2]:
        config = StreamConfig(**(dict(seed=seed, kv_events=kv_events, num_speculative_tokens=0,
                                      max_num_batched_tokens=32) | shape))
        for counts in (vllm_counts, gpukv_counts):
            counts.update(dict.fromkeys(counts, 0))
        expected = run_stream(vllm_cls, config, check_tables=False)
        _assert_same_steps(expected, run_stream(cls, config))
        assert gpukv_counts["batched"] + gpukv_counts["per_request"] == sum(vllm_counts.values()) > 0
        assert gpukv_counts["per_request"] >= vllm_counts["uncached"]
        if not config.prefix_caching:  # (every released block uncached: none batched)
            assert gpukv_counts["batched"] == 0 and vllm_counts["cached"] == 0
        batched += gpukv_counts["batched"]
    assert batched > 0 or not shape.get("prefix_caching", True)
    calls, steps, _ = counting.totals()
    assert calls > steps > 0, (calls, steps)
    runs, admitted = counting.admitted()
    assert runs > 0 and admitted > 0, (runs, admitted)


STREAM_SHAPES = [pytest.param(dict(num_blocks=20), id="running"),
                 pytest.param(dict(num_blocks=13), id="tight"),
                 pytest.param(dict(num_blocks=48, max_num_batched_tokens=512, max_num_seqs=12, num_requests=32),
                              id="runs"),
                 pytest.param(dict(num_blocks=48, max_num_batched_tokens=48, max_num_seqs=12, num_requests=32),
                              id="chunked-runs")]


@pytest.mark.parametrize("cls", REFERENCE)
@pytest.mark.parametrize("shape", STREAM_SHAPES)
def test_batched_streams_with_kv_events_are_vllms_step_by_step(cls, shape, monkeypatch):
    """KV events on, no drafts: each step's events (and all else) equal
    vLLM's, with the running loop and runs of admissions batched and blocks
    evicted inside a batched step (removals each given to the call whose
    pop evicted it)."""
    counting = _Counting(monkeypatch)
    vllm_cls = VllmAsyncScheduler if is_async(cls) else VllmScheduler
    removed = 0
    for seed in SEEDS:
        config = StreamConfig(seed=seed, kv_events=True, num_speculative_tokens=0, **shape)
        expected = run_stream(vllm_cls, config, check_tables=False)
        _assert_same_steps(expected, run_stream(cls, config))
        removed += coverage(expected)["removed_events"]
    calls, steps, _ = counting.totals()
    runs, admitted = counting.admitted()
    assert removed > 0 and calls > steps > 0 and runs > 0 and admitted > 0, (removed, calls, steps, runs, admitted)


@pytest.mark.parametrize("cls", REFERENCE)
@pytest.mark.parametrize("kv_events", [False, True], ids=["no-events", "events"])
@pytest.mark.parametrize("shape", STREAM_SHAPES[1:])
def test_speculative_admission_runs_are_vllms_step_by_step(cls, kv_events, shape, monkeypatch):
    """An n-gram speculative config (two drafts a step): runs of admissions
    (whole prompts, and a chunked last one where the budget chunks) as one
    gpukv step beside the running loop's, every step vLLM's; drafts were
    scheduled."""
    counting = _Counting(monkeypatch)
    vllm_cls = VllmAsyncScheduler if is_async(cls) else VllmScheduler
    spec_steps = 0
    for seed in SEEDS:
        config = StreamConfig(seed=seed, kv_events=kv_events, num_speculative_tokens=2, **shape)
        expected = run_stream(vllm_cls, config, check_tables=False)
        _assert_same_steps(expected, run_stream(cls, config))
        spec_steps += coverage(expected)["spec_steps"]
    runs, admitted = counting.admitted()
    assert spec_steps > 0 and runs > 0 and admitted > 0, (spec_steps, runs, admitted)
    budget = shape.get("max_num_batched_tokens", 64)
    if budget == 512:  # (roomy: runs of several; the tight pool refuses many a run's head)
        assert admitted > runs, (runs, admitted)
    assert (counting.chunked() > 0) == (budget < 512), counting.chunked()  # (64 and 48 chunk long prompts)


@pytest.mark.parametrize("cls", REFERENCE)
@pytest.mark.parametrize(("draft_slots", "lookahead"), [(1, 1), (3, 2)])
def test_speculative_runs_with_draft_slots_and_lookahead_are_vllms(cls, draft_slots, lookahead, monkeypatch):
    """A speculative method whose drafts take input rows and lookahead KV
    slots (n-gram takes neither; set on vLLM's own configs for both
    schedulers alike): each admission's budget less its draft slots, its
    lookahead slots allocated, every step vLLM's."""
    from vllm.config import SpeculativeConfig, VllmConfig

    monkeypatch.setattr(SpeculativeConfig, "max_num_new_slots_for_drafting", property(lambda _self: draft_slots))
    monkeypatch.setattr(VllmConfig, "num_lookahead_tokens",
                        property(lambda self: lookahead if self.speculative_config is not None else 0))
    counting = _Counting(monkeypatch)
    vllm_cls = VllmAsyncScheduler if is_async(cls) else VllmScheduler
    for seed in SEEDS:
        config = StreamConfig(seed=seed, num_speculative_tokens=2, num_blocks=48, max_num_batched_tokens=48,
                              max_num_seqs=12, num_requests=32)
        _assert_same_steps(run_stream(vllm_cls, config, check_tables=False), run_stream(cls, config))
    runs, admitted = counting.admitted()
    assert runs > 0 and admitted > 0 and counting.chunked() > 0, (runs, admitted, counting.chunked())


def test_a_prompt_vllm_may_pad_ends_a_speculative_run():
    """Under speculative decoding vLLM pads an admission that computes one
    token (a 17-token prompt whose first block hits, a 1-token prompt) to
    ``1 + num_spec_tokens`` tokens, by what the running loop scheduled: the
    run stops before such a prompt (length 1 mod the block size), and the
    ones before it join."""
    scheduler = make_scheduler(gpukv033.ReferenceScheduler, max_num_seqs=16, max_num_batched_tokens=1024,
                               max_model_len=256, num_blocks=100, num_speculative_tokens=2)
    lengths = [20, 40, 17, 20]
    for r in make_requests(4, prompt=lambda i: [i + 1] * lengths[i], scheduler=scheduler):
        scheduler.add_request(r)
    kv = scheduler.kv_cache_manager
    run = gpukv033.admissions.plain_run(scheduler, kv, 0, False)
    assert [r.request_id for r in run.requests] == ["0", "1"] and run.token_budget is None and run.lookahead == 0


# ---------------------------------------------------------------- counts

def _decoding(cls: type, n: int) -> tuple[object, Engine]:
    """A scheduler with ``n`` requests of 20 tokens decoding (prefilled)."""
    scheduler = make_scheduler(cls, max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=256, num_blocks=400)
    engine = Engine(scheduler)
    engine.add(make_requests(n, 20, max_tokens=200, ignore_eos=True, scheduler=scheduler))
    for _ in range(3):
        engine.step()
    return scheduler, engine


@pytest.mark.parametrize("n", [4, 24])
def test_a_decode_step_is_one_gpukv_step_whatever_the_requests(n, monkeypatch):
    """The reference, ``n`` running requests: ``schedule()`` makes one gpukv
    ``step`` and no per-request ``allocate_slots``, then one more ``step``
    when the decode fills a block (vLLM's block size 16: request tokens 20
    -> 32 across the steps)."""
    scheduler, engine = _decoding(gpukv033.ReferenceScheduler, n)
    manager = scheduler.kv_cache_manager.manager
    calls = {"step": 0, "allocate_slots": 0}
    _count_calls(monkeypatch, manager, calls)
    for _ in range(14):
        before = dict(calls)
        out = engine.step()
        assert len(out.num_scheduled_tokens) == n
        assert calls["step"] - before["step"] == 1
        assert calls["allocate_slots"] == before["allocate_slots"]


def test_a_run_of_admissions_is_one_gpukv_step(monkeypatch):
    """Seven waiting requests (two sharing a 32-token prefix with a running
    one) admitted in one ``schedule()`` beside its decode: one gpukv
    ``step`` and no per-request lookup or allocation on the manager; the
    block ids and hits are vLLM's."""
    def prompts(i: int) -> list[int]:
        return [7] * 32 + [i] * 8 if i < 3 else [100 + i] * 40

    outputs = {}
    for cls in (VllmScheduler, gpukv033.ReferenceScheduler):
        scheduler = make_scheduler(cls, max_num_seqs=16, max_num_batched_tokens=1024, max_model_len=256,
                                   num_blocks=100)
        engine = Engine(scheduler)
        engine.add(make_requests(1, prompt=prompts, max_tokens=4, scheduler=scheduler))
        engine.step()  # (the first request alone: its blocks cached)
        engine.add(make_requests(7, prompt=lambda i: prompts(i + 1), first_id=1, max_tokens=4, scheduler=scheduler))
        calls = {"step": 0, "allocate_slots": 0, "get_computed_blocks": 0}
        if cls is not VllmScheduler:
            _count_calls(monkeypatch, scheduler.kv_cache_manager.manager, calls)
        out = engine.step()
        outputs[cls] = ([(r.req_id, r.block_ids, r.num_computed_tokens) for r in out.scheduled_new_reqs],
                        out.scheduled_cached_reqs.new_block_ids)
        if cls is not VllmScheduler:  # (the running request's decode and the run: one step)
            assert calls == {"step": 1, "allocate_slots": 0, "get_computed_blocks": 0}
    assert outputs[gpukv033.ReferenceScheduler] == outputs[VllmScheduler]
    assert [hit for *_, hit in outputs[VllmScheduler][0]] == [32, 32, 0, 0, 0, 0, 0]



def _step_after_a_cached_prefix(monkeypatch: pytest.MonkeyPatch, prompts: dict[int, list[int]],
                                counted: tuple[str, ...], **options) -> tuple[tuple, dict[str, int]]:
    """vLLM's scheduler and gpukv's, each built with ``options``: ``prompts[0]``
    run to its end (its blocks cached), the other prompts added, then one
    step, whose new requests (ids, block ids, hits) and tokens scheduled must
    be equal. Returns vLLM's, and the calls of gpukv's manager named in
    ``counted`` that the step made."""
    outputs, calls = {}, dict.fromkeys(counted, 0)
    for cls in (VllmScheduler, gpukv033.ReferenceScheduler):
        scheduler = make_scheduler(cls, max_num_seqs=8, max_model_len=128, **options)
        engine = Engine(scheduler)
        engine.add(make_requests(1, prompt=lambda i: prompts[i], max_tokens=1, scheduler=scheduler))
        engine.run_until_idle()
        engine.add(make_requests(len(prompts) - 1, prompt=lambda i: prompts[i + 1], first_id=1, max_tokens=1,
                                 scheduler=scheduler))
        if cls is not VllmScheduler:
            _count_calls(monkeypatch, scheduler.kv_cache_manager.manager, calls)
        out = engine.step()
        outputs[cls] = ([(r.req_id, r.block_ids, r.num_computed_tokens) for r in out.scheduled_new_reqs],
                        dict(out.num_scheduled_tokens))
    assert outputs[gpukv033.ReferenceScheduler] == outputs[VllmScheduler]
    return outputs[VllmScheduler], calls


@pytest.mark.parametrize(("num_blocks", "batched_tail", "scheduled"),
                         [(100, True, {"1": 8, "2": 56}), (7, False, {"1": 8})])
def test_a_run_ends_with_a_chunked_admission_in_the_same_step(num_blocks, batched_tail, scheduled, monkeypatch):
    """A budget of 64 tokens, two waiting prompts of 40 (the first hits 32 of
    them) and 60: vLLM admits the first whole (8 tokens past its hit) and
    chunks the second at the 56 left. gpukv's run takes both, the second
    chunked by its step's budget, in one step. With 7 blocks (6 usable) the
    host cannot prove vLLM's whole-prompt check passes for the 60-token
    prompt (4 blocks, where 6 less the first's 3 are left): the second takes
    the per-request path, and vLLM's check refuses it there (the first's hit
    blocks were evictable: taken too); every decision is vLLM's."""
    prompts = {0: [7] * 32 + [1] * 8, 1: [7] * 32 + [2] * 8, 2: [9] * 60}
    out, calls = _step_after_a_cached_prefix(monkeypatch, prompts, ("get_computed_blocks", "allocate_slots"),
                                             max_num_batched_tokens=64, num_blocks=num_blocks)
    # (unbatched, the adapter's own whole-prompt check refuses before the manager allocates)
    assert calls == {"get_computed_blocks": 0 if batched_tail else 1, "allocate_slots": 0}
    assert out[1] == scheduled


@pytest.mark.parametrize(("budget", "threshold", "adaptive", "scheduled", "per_request"),
                         [(1024, 24, False, {"1": 8, "2": 24, "3": 20}, 0),
                          (1024, 8, True, {"1": 8, "2": 60, "3": 20}, 0),
                          (40, 24, False, {"1": 8, "2": 24, "3": 8}, 1)],
                         ids=["threshold", "adaptive", "threshold-and-budget"])
def test_a_run_chunks_each_admission_at_the_long_prefill_threshold(budget, threshold, adaptive, scheduled,
                                                                   per_request, monkeypatch):
    """Three waiting prompts: 40 tokens hitting 32 of them, 60, and 20. Under
    a long-prefill threshold of 24 vLLM computes 8 (past the hit), 24 (the
    threshold) and 20, and gpukv's run admits all three in one step, each
    chunked at the threshold. Adaptive, a threshold of 8 is floored at 1024
    // 3 (three requests waiting): nothing is chunked. With a budget of 40,
    counted without hits the first takes 24 (its prompt capped at the
    threshold) and the second's 24 do not fit the 16 left: the run ends with
    it, chunked by the threshold and by its step's budget (vLLM's 32 left),
    and vLLM's loop admits the third per request, chunked at the 8 left."""
    prompts = {0: [7] * 32 + [1] * 8, 1: [7] * 32 + [2] * 8, 2: [9] * 60, 3: [8] * 20}
    out, calls = _step_after_a_cached_prefix(monkeypatch, prompts, ("step", "get_computed_blocks", "allocate_slots"),
                                             max_num_batched_tokens=budget, num_blocks=100,
                                             long_prefill_token_threshold=threshold, adaptive_threshold=adaptive)
    assert calls == {"step": 1, "get_computed_blocks": per_request, "allocate_slots": per_request}
    assert out[1] == scheduled


def test_a_lookup_the_run_did_not_expect_raises():
    scheduler = make_scheduler(gpukv033.ReferenceScheduler, max_num_seqs=16, max_num_batched_tokens=1024,
                               max_model_len=256, num_blocks=100)
    requests = make_requests(3, 20, scheduler=scheduler)
    for r in requests:
        scheduler.add_request(r)
    kv = scheduler.kv_cache_manager
    kv.batching = True
    kv.waiting_run = lambda _tokens: (list(scheduler.waiting), None)
    kv.get_computed_blocks(requests[0])  # (the run of three admitted as one step)
    with pytest.raises(AssertionError, match="where gpukv's batched run admitted '0' next"):
        kv.get_computed_blocks(requests[2])


def test_the_device_reads_at_most_once_a_decode_step():
    """The device manager under the batched ``Scheduler``: at most one read
    a step (the new blocks' ids, when a block fills), for 4 and 12 running
    requests alike."""
    for n in (4, 12):
        scheduler, engine = _decoding(gpukv033.DeviceScheduler, n)
        manager = scheduler.kv_cache_manager.manager
        reads = []
        real = manager._read

        def counted(*args, _real=real, _reads=reads, **kwargs):
            _reads.append(1)
            return _real(*args, **kwargs)

        manager._read = counted
        per_step = []
        for _ in range(13):
            before = len(reads)
            engine.schedule()
            per_step.append(len(reads) - before)
            engine.complete()
        assert max(per_step) == 1 and min(per_step) == 0, (n, per_step)


# ---------------------------------------------------------------- the parts

def _adapter_with_running(n: int = 2, num_blocks: int = 400) -> tuple:
    scheduler = make_scheduler(gpukv033.ReferenceScheduler, max_num_seqs=8, max_num_batched_tokens=512,
                               max_model_len=256, num_blocks=num_blocks)
    engine = Engine(scheduler)
    requests = make_requests(n, 16, max_tokens=100, ignore_eos=True, scheduler=scheduler)
    engine.add(requests)
    engine.step()
    return scheduler.kv_cache_manager, engine, requests


def test_blocks_handed_back_fill_at_the_flush_and_match_one_call_each():
    kv, _, requests = _adapter_with_running()
    kv.batching = True
    for r in requests:
        r.num_computed_tokens = 16  # (vLLM's count after the prefill; one new token needs a second block)
    got = [kv.allocate_slots(r, 1) for r in requests]
    assert len(kv.pending) == 2 and all(g.filled is None for g in got)
    ids = [g.get_block_ids() for g in got]  # (reading one flushes all)
    assert len(kv.pending) == 0
    held = [kv.manager.get_block_ids(r.request_id) for r in requests]
    assert ids == [([h[0][1]],) for h in held]
    assert ids[0] != ids[1]
    kv.batching = False
    kv.check_invariants()


def test_a_call_that_does_not_fit_keeps_nothing():
    kv, _, requests = _adapter_with_running(num_blocks=4)  # null block + 2 prefills: one block free
    kv.batching = True
    for r in requests:
        r.num_computed_tokens = 16
    first = kv.allocate_slots(requests[0], 1)
    assert kv.allocate_slots(requests[1], 1) is None
    assert len(kv.pending) == 1
    assert first.get_block_ids() == ([3],)
    assert kv.manager.read_num_free_blocks() == 0
    kv.check_invariants()


def test_a_count_of_free_blocks_is_not_kept_past_a_call_made_outside_the_batch():
    """The host's count of free blocks (``PendingGrowth.spare``) holds only
    while the pending calls are all that changed the pool. Two blocks free: a
    call that needs three does not fit (nothing pending: the count, 2, is
    kept), then a call on the per-request path takes both, then a call that
    needs one does not fit either (the count is read anew, not taken as 2).
    Found by fuzzing: a window model's call on the per-request path, between
    two running calls, took the blocks a stale count still offered, and
    gpukv refused the step."""
    kv, _, requests = _adapter_with_running(num_blocks=5)  # null block + 2 prefills: two blocks free
    kv.batching = True
    for r in requests:
        r.num_computed_tokens = 16
    assert kv.allocate_slots(requests[0], 40) is None and len(kv.pending) == 0  # (3 blocks: 2 free)
    kv.batching = False  # (the per-request path, as a window model's releasing call takes)
    assert kv.allocate_slots(requests[0], 17).get_block_ids() == ([3, 4],)
    assert kv.manager.read_num_free_blocks() == 0
    kv.batching = True
    assert kv.allocate_slots(requests[1], 1) is None and len(kv.pending) == 0
    kv.flush()
    kv.batching = False
    kv.check_invariants()


def test_every_reader_flushes_first():
    kv, _, requests = _adapter_with_running()
    kv.batching = True
    for r in requests:
        r.num_computed_tokens = 16
    kv.allocate_slots(requests[0], 1)
    assert kv.manager.num_blocks_held(requests[0].request_id) == 1  # (pending)
    assert kv.get_block_ids(requests[0].request_id)[0][1] > 0  # a reader: applied first
    kv.allocate_slots(requests[1], 1)
    kv.free(requests[1])
    assert len(kv.pending) == 0 and requests[1].request_id not in kv.request_ids()


def test_a_host_count_gpukv_refuses_raises():
    kv, _, requests = _adapter_with_running(num_blocks=4)
    kv.batching = True
    for r in requests:
        r.num_computed_tokens = 16
    kv.pending.spare = 5  # (a wrong host count: one block is free)
    kv.allocate_slots(requests[0], 1)
    kv.allocate_slots(requests[1], 1)
    with pytest.raises(AssertionError, match="host's block arithmetic"):
        kv.flush()
    assert len(kv.pending) == 0


def test_the_running_batch_needs_no_count_from_gpukv_nor_a_second_check(monkeypatch):
    """The flush builds its ``RunningBatch`` from the adapter's records
    (gpukv's known tokens per request) and gpukv takes it as checked: no
    ``row_token_counts`` call, no second ``normalize_running``."""
    kv, _, requests = _adapter_with_running()
    kv.batching = True
    for r in requests:
        r.num_computed_tokens = 16

    def refused(*_args, **_kwargs):
        raise AssertionError("called on the batched path")

    rows = [kv.manager.row_of(r.request_id) for r in requests]
    with monkeypatch.context() as patch:
        patch.setattr(kv.manager, "row_token_counts", refused)
        patch.setattr(shared_api, "normalize_running", refused)
        for r in requests:
            kv.allocate_slots(r, 1)
        kv.flush()
    assert [r.num_tokens for r in requests] == [17, 17]
    assert kv.manager.row_token_counts(rows)[0].tolist() == [17, 17]
    assert [kv._held[r.request_id][2:] for r in requests] == [[17, 17], [17, 17]]
    kv.batching = False
    kv.check_invariants()


def test_a_stale_record_of_gpukvs_tokens_is_refused_and_read_back():
    kv, _, requests = _adapter_with_running()
    kv.batching = True
    for r in requests:
        r.num_computed_tokens = 16
    rows = [kv.manager.row_of(r.request_id) for r in requests]
    kv._held[requests[0].request_id][3] -= 1  # (a wrong record: gpukv knows one token more)
    for r in requests:
        kv.allocate_slots(r, 1)
    with pytest.raises(InvalidInputError, match="known tokens are not the manager's"):
        kv.flush()
    assert len(kv.pending) == 0
    assert kv.manager.row_token_counts(rows)[0].tolist() == [16, 16]  # (nothing appended)
    assert [kv._held[r.request_id][2:] for r in requests] == [[16, 16], [16, 16]]  # (read back)
    kv.batching = False
    kv.check_invariants()


def test_a_refused_window_step_releases_nothing_and_its_records_are_read_back():
    """A window model's batched calls, one releasing a cached block (noted
    on the host before the step), refused as a whole (a stale record):
    nothing released, the window records read back from the manager."""
    scheduler = make_scheduler(gpukv033.ReferenceScheduler, max_num_seqs=8, max_num_batched_tokens=512,
                               max_model_len=256, num_blocks=64, sliding_window=17)
    engine = Engine(scheduler)
    requests = make_requests(2, 40, max_tokens=100, ignore_eos=True, scheduler=scheduler)
    engine.add(requests)
    engine.step()
    kv = scheduler.kv_cache_manager
    kv.batching = True
    for r in requests:
        r.num_computed_tokens = 40  # (a 17-token window behind 40 tokens: block 0 out of reach, and cached)
    held = [kv.manager.get_block_ids(r.request_id) for r in requests]
    kv._held[requests[1].request_id][3] -= 1  # (a wrong record: gpukv knows one token more)
    for r in requests:
        kv.allocate_slots(r, 1)
    assert [kv.windows.null_blocks[r.request_id] for r in requests] == [[1], [1]]  # (noted, not yet applied)
    with pytest.raises(InvalidInputError, match="known tokens are not the manager's"):
        kv.flush()
    assert [kv.manager.get_block_ids(r.request_id) for r in requests] == held  # (no block released)
    assert [kv.windows.null_blocks[r.request_id] for r in requests] == [[0], [0]]  # (read back)
    kv.batching = False
    kv.check_invariants()


def test_the_new_tokens_are_each_requests_slice_flat_whatever_its_buffer():
    """vLLM 0.34's int32 ``TokenBuffer`` (an ``array``), 0.33's list, and a
    mix of the two: the same flat tokens, in order, none for an empty span."""

    class Held:
        def __init__(self, tokens):
            self._all_token_ids = tokens

    arrays = [Held(array("i", range(100 * i, 100 * i + 20))) for i in range(3)]
    lists = [Held(list(range(100 * i, 100 * i + 20))) for i in range(3)]
    want = [17, 18, 19, 119, 215, 216]
    for requests in (arrays, lists, [arrays[0], lists[1], arrays[2]]):
        got = gpukv033.views.new_tokens(requests, [17, 19, 15], [20, 20, 17])
        assert got.dtype == np.int64 and got.tolist() == want
        assert gpukv033.views.new_tokens(requests, [20, 20, 20], [20, 20, 20]).tolist() == []
        decoded = gpukv033.views.decode_tokens(requests, [17, 19, 15])  # (one token each: read in one pass)
        assert decoded.dtype == np.int64 and decoded.tolist() == [17, 119, 215]


def test_a_running_calls_record_follows_growths_rule():
    """``PendingGrowth.add`` computes ``growth``'s rule inline (it runs once
    per running request per step): the target and slots it records, and the
    adapter's record it moves, are ``growth``'s, for every mix of counts
    around the caps (known tokens, gpukv's computed ones, max_model_len)."""
    fields = gpukv033.pending._FIELDS

    class Manager:
        def free_blocks_lower_bound(self):
            return 1 << 20

    class Adapter:
        blocks_class, block_size, max_model_len, empty_kv_cache_blocks = tuple, 4, 40, ()
        ids_on_device, num_kv_cache_groups, manager, windows = True, 1, Manager(), None

    class Request:
        def __init__(self, num_computed_tokens):
            self.num_computed_tokens = num_computed_tokens

    checked = 0
    for vllm_computed in (0, 5, 30, 39, 40, 41, 45):
        for known in (6, 31, 40):
            for computed in (0, 6, 31, 40):
                for new, lookahead in ((1, 0), (3, 2), (9, 0), (1, 7)):
                    pending = PendingGrowth(Adapter())
                    for num_held in (0, 10):  # (10 blocks of 4: no call takes one; 0: every call with slots does)
                        held = [7, num_held, computed, 5]
                        pending.add(Request(vllm_computed), held, known, new, lookahead)
                        record = dict(zip(fields, pending.counts[-len(fields):], strict=True))
                        _, slots, target = gpukv033.pending.growth(vllm_computed, known, computed, new, lookahead,
                                                                   Adapter.max_model_len)
                        assert (record["target"], record["slots"]) == (target, slots)
                        assert (record["row"], record["before"], record["known"], record["computed"]) == (
                            7, 5, known, computed)
                        assert held == [7, max(num_held, -(-slots // 4)), target, known]
                        checked += 1
    assert checked == 7 * 3 * 4 * 4 * 2


def test_a_call_that_takes_no_block_hands_back_blocks_that_answer_as_vllms_without_its_loop():
    """The empty blocks a running call that takes no new block gets: the
    answers and equality of vLLM's empty ``KVCacheBlocks``, and vLLM's
    ``get_block_ids(allow_none=True)`` (asked of every running request each
    step) made with no call inside it (vLLM's runs a generator over the
    groups)."""
    import sys

    from vllm.v1.core.kv_cache_manager import KVCacheBlocks

    kv, _, requests = _adapter_with_running()
    kv.batching = True
    requests[0].num_computed_tokens = 15  # (one new token fits the block it holds)
    got = kv.allocate_slots(requests[0], 1)
    kv.batching = False
    kv.flush()
    vllms = KVCacheBlocks(((),))
    assert got is kv.empty_kv_cache_blocks and got == vllms and vllms == got
    assert (got != vllms) is False and (vllms != got) is False
    assert got != KVCacheBlocks(([7],)) and KVCacheBlocks(([7],)) != got
    for kwargs in ({}, {"allow_none": True}, {"allow_none": False}, {"group_ids": [0]},
                   {"allow_none": True, "group_ids": [0]}):
        assert got.get_block_ids(**kwargs) == vllms.get_block_ids(**kwargs)
    first, second = got.get_block_ids(), got.get_block_ids()
    assert first == ([],) and first[0] is not second[0]  # (fresh lists: vLLM's caller may extend them)
    calls = []

    def count(frame, event, arg):  # noqa: ARG001  (sys.setprofile's signature)
        if event in ("call", "c_call"):
            calls.append(frame.f_code.co_name if event == "call" else arg.__name__)

    sys.setprofile(count)
    try:
        got.get_block_ids(allow_none=True)
    finally:
        sys.setprofile(None)
    assert calls == ["get_block_ids", "setprofile"]  # (the method itself, then the profiler's own removal)


def test_lora_slots_follow_vllms_max_loras_skip():
    """vLLM's rule, hand-worked with ``max_loras=2`` and running requests on
    adapter 1 and the base model (every running one counts, scheduled this
    step or not): adapter 2 joins (two now), adapter 3 would be a third
    (vLLM skips it: the run ends there), adapter 1 or 2 and the base model
    always pass; without a LoRA config nothing is counted."""
    from types import SimpleNamespace

    def request(int_id):
        lora = None if int_id is None else SimpleNamespace(lora_int_id=int_id)
        return SimpleNamespace(lora_request=lora)

    running = [request(1), request(None), request(1)]
    slots = LoraSlots(SimpleNamespace(max_loras=2), running)
    assert [slots.admit(request(i)) for i in (2, 3, 1, None, 2, 3)] == [True, False, True, True, True, False]
    unbounded = LoraSlots(None, running)
    assert all(unbounded.admit(request(i)) for i in (2, 3, 4, 5))
    assert LoraSlots(SimpleNamespace(max_loras=1), [request(None)]).admit(request(7))  # (the step's first adapter)
    assert not LoraSlots(SimpleNamespace(max_loras=1), [request(4)]).admit(request(7))


def test_a_run_goes_past_a_lora_request_vllm_skips(monkeypatch):
    """``max_loras=1``, a request decoding on adapter 1, and three waiting:
    one on the base model, one on adapter 2, one on adapter 1. vLLM admits
    the first, skips the second (a second adapter in the step) before
    looking it up, and admits the third; gpukv's run leaves the second out
    and admits the other two in the same gpukv step as the decode, with no
    call of their own; the skipped request waits on."""
    sql, chat = lora_adapter("sql", 1, "/adapters/sql"), lora_adapter("chat", 2, "/adapters/chat")
    outputs = {}
    for cls in (VllmScheduler, gpukv033.ReferenceScheduler):
        scheduler = make_scheduler(cls, max_num_seqs=8, max_num_batched_tokens=1024, max_model_len=128,
                                   num_blocks=100, max_loras=1)
        engine = Engine(scheduler)
        engine.add(make_requests(1, prompt=lambda _: [5] * 20, max_tokens=8, scheduler=scheduler, lora_request=sql))
        engine.step()
        for first_id, lora in ((1, None), (2, chat), (3, sql)):
            engine.add(make_requests(1, prompt=lambda _, k=first_id: [10 + k] * 20, first_id=first_id, max_tokens=8,
                                     scheduler=scheduler, lora_request=lora))
        calls = {"step": 0, "get_computed_blocks": 0, "allocate_slots": 0}
        if cls is not VllmScheduler:
            _count_calls(monkeypatch, scheduler.kv_cache_manager.manager, calls)
        out = engine.step()
        outputs[cls] = ([(r.req_id, r.block_ids) for r in out.scheduled_new_reqs], dict(out.num_scheduled_tokens),
                        [r.request_id for r in scheduler.waiting])
        if cls is not VllmScheduler:
            assert calls == {"step": 1, "get_computed_blocks": 0, "allocate_slots": 0}
    assert outputs[gpukv033.ReferenceScheduler] == outputs[VllmScheduler]
    assert outputs[VllmScheduler][1:] == ({"0": 1, "1": 20, "3": 20}, ["2"])


@pytest.mark.parametrize("cls", REFERENCE)
def test_a_lora_run_counts_every_running_requests_adapter(cls):
    """A stream where a running request waits unscheduled (its output in
    flight, prefills throttled) on a third adapter: vLLM counts its adapter
    toward ``max_loras`` all the same and skips a waiting LoRA request that
    a count of the scheduled requests alone would admit. Found by fuzzing."""
    config = StreamConfig(seed=8525, num_requests=40, num_blocks=14, max_num_batched_tokens=128, max_num_seqs=12,
                          num_speculative_tokens=0, kv_events=False, cache_aware_window=4, max_output_tokens=8,
                          abort_rate=0.02, priority=True, lora=True, max_loras=2, bends=True)
    vllm_cls = VllmAsyncScheduler if is_async(cls) else VllmScheduler
    _assert_same_steps(run_stream(vllm_cls, config, check_tables=False), run_stream(cls, config))
