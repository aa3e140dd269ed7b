"""What vLLM 0.33 does differently with batches in flight, draft padding and more groups.

* ``AsyncScheduler``: a step is scheduled before the previous step's output
  arrives; in-flight tokens are output placeholders, never cached until their
  output is in (``update_from_output``'s ``cache_blocks`` and the next
  ``allocate_slots``); a request's last step is not scheduled twice.
* Uniform draft padding: a waiting request admitted with one token to compute
  (a hit ending one token short of its prompt) is scheduled as a decode of
  ``1 + num_speculative_tokens`` tokens with ``-1`` drafts, and gets the blocks
  for them.
* KV events of a hybrid config: one ``BlockStored`` per group, tagged with the
  group's index and kind.
"""

from __future__ import annotations

import pytest

from .harness import (
    BlockStored,
    Engine,
    KVView,
    VllmAsyncScheduler,
    VllmScheduler,
    make_requests,
    make_scheduler,
    scheduler_params,
)


def test_async_in_flight_tokens_are_cached_only_once_their_output_is_in():
    """A 15-token prompt: its first sampled token fills block 1. The block is
    not cached while that token is in flight, nor when its output arrives
    (computed 16, one token still in flight: cache_blocks(16 - 1)), but at the
    next schedule(), whose allocate_slots caches up to num_tokens = 16."""
    scheduler = make_scheduler(VllmAsyncScheduler)
    engine = Engine(scheduler)
    engine.add(make_requests(1, 15, max_tokens=5, ignore_eos=True))
    view = KVView(scheduler)
    engine.schedule()
    engine.schedule()
    assert view.cached_block_ids() == set()
    engine.complete()
    assert scheduler.requests["0"].num_tokens == 16
    assert view.cached_block_ids() == set()
    out = engine.schedule()
    assert out.scheduled_cached_reqs.new_block_ids == [([2],)]
    assert view.cached_block_ids() == {1}


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5])
def test_async_schedules_exactly_the_tokens_a_request_needs(max_tokens):
    """With the output one step behind, the scheduler still stops at
    max_tokens: prompt + max_tokens - 1 tokens scheduled in all."""
    scheduler = make_scheduler(VllmAsyncScheduler)
    engine = Engine(scheduler)
    engine.add(make_requests(2, 10, max_tokens=max_tokens, ignore_eos=True))
    engine.run_until_idle()
    assert sum(out.total_num_scheduled_tokens for out in engine.outputs) == 2 * (10 + max_tokens - 1)
    assert [len(engine.tokens(rid)) for rid in ("0", "1")] == [max_tokens, max_tokens]
    KVView(scheduler).assert_empty()


def test_async_spec_decode_schedules_placeholder_drafts():
    """An AsyncScheduler never sees the drafts (they stay on the worker): it
    schedules num_speculative_tokens placeholders (-1) per decode."""
    scheduler = make_scheduler(VllmAsyncScheduler, num_speculative_tokens=2)
    engine = Engine(scheduler)
    engine.add(make_requests(1, 10, max_tokens=8, ignore_eos=True))
    engine.step()
    out = engine.step()
    assert out.num_scheduled_tokens == {"0": 3}
    assert out.scheduled_spec_decode_tokens == {"0": [-1, -1]}
    assert out.num_spec_tokens_to_schedule == 2


@pytest.mark.parametrize("cls", scheduler_params(async_=False))
def test_an_admission_one_token_short_is_padded_to_a_uniform_spec_decode(cls):
    """Request 1's 33-token prompt hits request 0's 32 cached tokens: one
    token left, so it is scheduled as 1 + 2 tokens with drafts [-1, -1] and
    gets a third block for them."""
    scheduler = make_scheduler(cls, num_speculative_tokens=2)
    engine = Engine(scheduler, drafts=lambda r: [7, 8])  # noqa: ARG005
    engine.add(make_requests(1, prompt=lambda i: list(range(32)), max_tokens=1))  # noqa: ARG005
    engine.run_until_idle()
    engine.add(make_requests(1, prompt=lambda i: list(range(33)), first_id=1, max_tokens=3))  # noqa: ARG005
    out = engine.step()
    assert [(n.req_id, n.block_ids, n.num_computed_tokens) for n in out.scheduled_new_reqs] == [
        ("1", ([1, 2, 3],), 32)]
    assert out.num_scheduled_tokens == {"1": 3}
    assert out.scheduled_spec_decode_tokens == {"1": [-1, -1]}


def test_no_padding_without_speculative_decoding():
    scheduler = make_scheduler(VllmScheduler)
    engine = Engine(scheduler)
    engine.add(make_requests(1, prompt=lambda i: list(range(32)), max_tokens=1))  # noqa: ARG005
    engine.run_until_idle()
    engine.add(make_requests(1, prompt=lambda i: list(range(33)), first_id=1, max_tokens=3))  # noqa: ARG005
    out = engine.step()
    assert out.num_scheduled_tokens == {"1": 1}
    assert out.scheduled_new_reqs[0].block_ids == ([1, 2, 3],)


@pytest.mark.parametrize("cls", scheduler_params())
def test_hybrid_events_are_one_per_group_with_the_group_kind(cls):
    scheduler = make_scheduler(cls, sliding_window=32, hybrid=True, enable_kv_cache_events=True)
    engine = Engine(scheduler)
    engine.add(make_requests(1, 32, max_tokens=1))
    engine.run_until_idle()
    stored = [e for e in scheduler.kv_event_publisher.take() if isinstance(e, BlockStored)]
    assert [(e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window, len(e.block_hashes))
            for e in stored] == [(0, "full_attention", None, 2), (1, "sliding_window", 32, 2)]
    assert stored[0].block_hashes == stored[1].block_hashes  # one hash chain; the group is the event's tag
