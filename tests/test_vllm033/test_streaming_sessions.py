"""Streaming-input sessions (a ``resumable`` request, vLLM 0.33 on): the
session stops after each input chunk keeping its blocks, the next chunk
(a request with the same id) drops its last sampled token, appends its
prompt and resumes from the computed tokens, and a non-resumable request
with that id ends it. gpukv holds such a request's blocks across the pause
and is told the replaced token never, so its decisions and its cache stay
vLLM's: step by step, and a request arriving with the session's tokens so
far hits what vLLM's cache holds (64 of its 73 tokens, hand-worked below)."""

from __future__ import annotations

import pytest

from .harness import (
    Engine,
    KVView,
    VllmAsyncScheduler,
    VllmScheduler,
    gpukv033,
    is_async,
    make_requests,
    make_scheduler,
)
from .streams import recorded_step

GPUKV = [pytest.param(cls, id=cls.__name__) for cls in (
    gpukv033.ReferenceScheduler, gpukv033.ReferenceAsyncScheduler, gpukv033.UnbatchedReferenceScheduler)]


def _chunk(scheduler, tokens, max_tokens, resumable=True):
    (request,) = make_requests(1, prompt=lambda _: tokens, first_id=0, max_tokens=max_tokens, ignore_eos=True,
                               scheduler=scheduler)
    request.request_id, request.resumable = "S", resumable
    return request


def _session(cls, num_speculative_tokens, kv_events):
    """The session's chunks (40, 25 and 30 prompt tokens; 5, 4 and 3
    outputs) and a request with its tokens after the second, recorded."""
    scheduler = make_scheduler(cls, num_blocks=40, max_num_batched_tokens=64, max_model_len=256,
                               num_speculative_tokens=num_speculative_tokens, enable_kv_cache_events=kv_events)
    engine = Engine(scheduler, drafts=(lambda _: [7] * num_speculative_tokens) if num_speculative_tokens else None)
    records: list = []

    def steps(n):  # (a step with nothing to schedule, the session paused, records nothing)
        for _ in range(n):
            recorded_step(engine, records)

    def pause():
        session = scheduler.requests["S"]
        records.append((session.status.name, session.num_computed_tokens, session.num_tokens))

    scheduler.add_request(_chunk(scheduler, list(range(1, 41)), 5))
    steps(8)
    pause()
    scheduler.add_request(_chunk(scheduler, list(range(100, 125)), 4))
    steps(8)
    pause()
    so_far = list(scheduler.requests["S"].all_token_ids)
    engine.add(make_requests(1, prompt=lambda _: so_far + [999] * 3, first_id=50, max_tokens=2, ignore_eos=True,
                             scheduler=scheduler))
    steps(3)
    scheduler.add_request(_chunk(scheduler, list(range(200, 230)), 3))
    steps(8)
    scheduler.add_request(_chunk(scheduler, [1], 1, resumable=False))  # (no more input: the session ends)
    steps(4)
    records.append("S" in scheduler.requests)
    return records, scheduler


@pytest.mark.parametrize("kv_events", [False, True], ids=["no-events", "events"])
@pytest.mark.parametrize("num_speculative_tokens", [None, 2], ids=["no-drafts", "drafts"])
@pytest.mark.parametrize("cls", GPUKV)
def test_a_streaming_session_is_vllms_step_by_step(cls, num_speculative_tokens, kv_events):
    vllm_cls = VllmAsyncScheduler if is_async(cls) else VllmScheduler
    expected, _ = _session(vllm_cls, num_speculative_tokens, kv_events)
    got, scheduler = _session(cls, num_speculative_tokens, kv_events)
    for step, (want, have) in enumerate(zip(expected, got, strict=True)):
        assert have == want, f"record {step} differs"
    KVView(scheduler).assert_empty()


def test_the_session_pauses_resumes_from_its_computed_tokens_and_its_cache_serves_a_hit():
    """The hand-worked values on vLLM's own scheduler and on gpukv's (so the
    comparison above compares what it is for): each pause keeps all but the
    last sampled token computed (40 + 5 - 1 = 44, then 44 + 1 + 25 + 4 - 1
    = 73 tokens, 72 computed), and the request with the 73 tokens (and 3 of
    its own) hits the 4 full blocks of 16 the session cached (64)."""
    for cls in (VllmScheduler, gpukv033.ReferenceScheduler):
        records, _ = _session(cls, None, False)
        pauses = [r for r in records if isinstance(r, tuple)]
        assert pauses == [("WAITING_FOR_STREAMING_REQ", 44, 45), ("WAITING_FOR_STREAMING_REQ", 72, 73)]
        admitted = [(rid, computed) for r in records if not isinstance(r, (tuple, bool)) for rid, _, computed in r.new]
        assert admitted == [("S", 0), ("S", 44), ("50", 64), ("S", 72)]
        assert records[-1] is False  # (the session ended)


def test_a_device_streaming_session_is_vllms_step_by_step():
    expected, _ = _session(VllmScheduler, 2, True)
    got, scheduler = _session(gpukv033.DeviceScheduler, 2, True)
    assert got == expected
    KVView(scheduler).assert_empty()
