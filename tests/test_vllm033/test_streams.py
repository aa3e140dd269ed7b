"""Random request streams on vLLM 0.33's schedulers, recorded step by step (``streams.py``).

Today they check that a stream is reproducible (the same seed, the same
records: what makes a step-by-step comparison meaningful), that it exercises
what it is for (hits, chunked prefill, preemption, speculative tokens, aborts,
KV events), and every step's block tables and budgets. A gpukv class is held
to vLLM by ``assert run_stream(gpukv_cls, config) == run_stream(VllmScheduler, config)``.
"""

from __future__ import annotations

import pytest

from .harness import EXTRA_SCHEDULERS, VllmAsyncScheduler, VllmScheduler, gpukv033, is_async, scheduler_params
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


DEVICE = [pytest.param(gpukv033.DeviceScheduler, id="gpukv-device"),
          pytest.param(gpukv033.DeviceAsyncScheduler, id="gpukv-device-async")]


@pytest.mark.parametrize("cls", DEVICE)
def test_gpukv_device_stream_is_vllms_step_by_step(cls):
    """The device backend on one stream of half the requests, sync and async
    (the whole stream costs about 45 s under Triton's interpreter, hence not
    the whole suite: the reference runs that)."""
    vllm_cls = VllmAsyncScheduler if is_async(cls) else VllmScheduler
    config = StreamConfig(seed=SEEDS[0], num_requests=12, arrival_steps=6)
    expected = run_stream(vllm_cls, config, check_tables=False)
    got = run_stream(cls, config)
    assert all(count > 0 for count in coverage(expected).values())  # the shorter stream still has them all
    for step, (want, have) in enumerate(zip(expected, got, strict=False)):
        assert have == want, f"step {step} differs"
    assert len(got) == len(expected)
