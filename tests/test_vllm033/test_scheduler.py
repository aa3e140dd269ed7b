"""vLLM 0.33's v1 scheduling behaviours, as a spec for a gpukv scheduler class.

The behaviours are those vLLM 0.33's ``tests/v1/core/test_scheduler.py``
checks for a text-only model on one full-attention group (admission, aborts,
chunked prefill and the token budget, ``max_num_seqs``, the long-prefill
threshold, stop conditions, preemption and resumption, speculative tokens,
prompt logprobs, stats and usage), written anew with exact expected values.
Each test runs on ``harness.scheduler_params()``: vLLM's ``Scheduler`` and,
where the behaviour is the same with batches in flight, ``AsyncScheduler``.
"""

from __future__ import annotations

import pytest

from .harness import (
    EOS_TOKEN_ID,
    HIT_LIMIT,
    SAMPLED_TOKEN_ID,
    BlockTables,
    Engine,
    KVView,
    RequestStatus,
    VllmScheduler,
    make_requests,
    make_scheduler,
    model_output,
    scheduler_params,
    stats_of,
)

SYNC = scheduler_params(async_=False)
BOTH = scheduler_params()


def new_ids(out):
    """(req_id, block_ids, num_computed_tokens) of each new request."""
    return [(n.req_id, n.block_ids, n.num_computed_tokens) for n in out.scheduled_new_reqs]


def cached_ids(out):
    """(req_id, new_block_ids, num_computed_tokens) of each running or resumed request."""
    c = out.scheduled_cached_reqs
    return list(zip(c.req_ids, c.new_block_ids, c.num_computed_tokens, strict=True))


# ---------------------------------------------------------------- admission and aborts

@pytest.mark.parametrize("cls", BOTH)
def test_added_requests_wait_in_order(cls):
    scheduler = make_scheduler(cls)
    for request in make_requests(5):
        scheduler.add_request(request)
    assert list(scheduler.requests) == ["0", "1", "2", "3", "4"]
    assert [r.request_id for r in scheduler.waiting] == ["0", "1", "2", "3", "4"]
    assert scheduler.get_request_counts() == (0, 5)
    assert scheduler.get_num_unfinished_requests() == 5


@pytest.mark.parametrize("cls", BOTH)
def test_admission_gives_each_request_its_blocks_in_order(cls):
    scheduler = make_scheduler(cls)
    for request in make_requests(10, 10):
        scheduler.add_request(request)
    out = scheduler.schedule()
    assert new_ids(out) == [(str(i), ([i + 1],), 0) for i in range(10)]
    assert out.num_scheduled_tokens == {str(i): 10 for i in range(10)}
    assert out.total_num_scheduled_tokens == 100
    assert [r.request_id for r in scheduler.running] == [str(i) for i in range(10)]
    assert scheduler.get_request_counts() == (10, 0)


@pytest.mark.parametrize("cls", BOTH)
def test_abort_frees_running_and_waiting_requests(cls):
    """finish_requests: the aborted requests leave their queues, their blocks
    are freed at once (the partial, uncached block to the free queue's front),
    and their ids reach the workers in the next output's finished_req_ids."""
    scheduler = make_scheduler(cls, max_num_seqs=2)
    requests = make_requests(3, 24)
    for request in requests:
        scheduler.add_request(request)
    scheduler.schedule()  # 0 -> [1, 2], 1 -> [3, 4]; 2 waits for a slot
    aborted = scheduler.finish_requests(["1", "2"], RequestStatus.FINISHED_ABORTED)
    assert {r.request_id for r in aborted} == {"1", "2"}  # in no set order: the ids go through a set
    assert requests[1].status == requests[2].status == RequestStatus.FINISHED_ABORTED
    assert [r.request_id for r in scheduler.running] == ["0"]
    assert list(scheduler.waiting) == []
    assert list(scheduler.requests) == ["0"]
    view = KVView(scheduler)
    assert view.block_ids("1") == ([],)
    # block 4 (tokens 16..23, not full) is uncached: reused first; block 3 is cached: kept longest
    assert view.free_queue()[0] == 4 and view.free_queue()[-1] == 3
    out = scheduler.schedule()
    assert out.finished_req_ids == {"1", "2"}
    assert scheduler.finish_requests("1", RequestStatus.FINISHED_ABORTED) == []  # already finished


@pytest.mark.parametrize("cls", BOTH)
def test_abort_all_with_none(cls):
    scheduler = make_scheduler(cls)
    for request in make_requests(3):
        scheduler.add_request(request)
    scheduler.schedule()
    assert len(scheduler.finish_requests(None, RequestStatus.FINISHED_ABORTED)) == 3
    assert scheduler.get_num_unfinished_requests() == 0
    KVView(scheduler).assert_empty()


# ---------------------------------------------------------------- budgets

@pytest.mark.parametrize("cls", SYNC)
def test_chunked_prefill_fills_the_token_budget(cls):
    """A 64-token budget: the first step runs request 0 whole and the first 24
    tokens of request 1; the next step runs request 0's decode, the rest of
    request 1 and all of request 2 (47 tokens left, 40 needed)."""
    scheduler = make_scheduler(cls, max_num_batched_tokens=64, max_num_seqs=4, max_model_len=256)
    engine = Engine(scheduler, tables=BlockTables())
    engine.add(make_requests(3, 40))
    out = engine.step()
    assert out.num_scheduled_tokens == {"0": 40, "1": 24}
    assert new_ids(out) == [("0", ([1, 2, 3],), 0), ("1", ([4, 5],), 0)]
    results = engine.results[-1]
    assert [o.request_id for o in results[0].outputs] == ["0"]  # a partial prefill emits nothing
    out = engine.step()
    assert out.num_scheduled_tokens == {"0": 1, "1": 16, "2": 40}
    assert cached_ids(out) == [("0", None, 40), ("1", ([6],), 24)]
    assert new_ids(out) == [("2", ([7, 8, 9],), 0)]
    assert out.total_num_scheduled_tokens == 57


@pytest.mark.parametrize("cls", BOTH)
def test_max_num_seqs_caps_the_running_requests(cls):
    scheduler = make_scheduler(cls, max_num_seqs=2)
    for request in make_requests(3):
        scheduler.add_request(request)
    out = scheduler.schedule()
    assert list(out.num_scheduled_tokens) == ["0", "1"]
    assert [r.request_id for r in scheduler.waiting] == ["2"]


@pytest.mark.parametrize("cls", BOTH)
def test_long_prefill_threshold_splits_prefills_only_when_others_wait(cls):
    scheduler = make_scheduler(cls, long_prefill_token_threshold=16)
    for request in make_requests(2, 40):
        scheduler.add_request(request)
    assert scheduler.schedule().num_scheduled_tokens == {"0": 16, "1": 16}

    alone = make_scheduler(cls, long_prefill_token_threshold=16)
    alone.add_request(make_requests(1, 40)[0])
    assert alone.schedule().num_scheduled_tokens == {"0": 40}  # nobody to starve: the whole prompt


@pytest.mark.parametrize("cls", SYNC)
def test_max_model_len_caps_the_scheduled_tokens_and_stops(cls):
    """max_model_len 20 with a 16-token prompt: the request stops, length
    capped, when its tokens reach 20 (4 outputs), though max_tokens is 10."""
    scheduler = make_scheduler(cls, max_num_batched_tokens=64, max_model_len=20)
    engine = Engine(scheduler)
    engine.add(make_requests(1, 16, max_tokens=10, ignore_eos=True))
    engine.run_until_idle()
    assert engine.tokens("0") == [SAMPLED_TOKEN_ID] * 4
    assert engine.finished()["0"].finish_reason.name == "LENGTH"


# ---------------------------------------------------------------- stop conditions

@pytest.mark.parametrize("cls", SYNC)
def test_stop_on_eos_stop_token_and_max_tokens(cls):
    scheduler = make_scheduler(cls)
    eos, stop, capped = make_requests(3, 10, max_tokens=2, stop_token_ids=[42])
    engine = Engine(scheduler, tables=BlockTables())
    engine.add([eos, stop, capped])
    engine.step(sampled={"0": [EOS_TOKEN_ID], "1": [42], "2": [7]})
    finished = engine.finished()
    assert (finished["0"].finish_reason.name, finished["0"].stop_reason) == ("STOP", None)
    assert (finished["1"].finish_reason.name, finished["1"].stop_reason) == ("STOP", 42)
    assert "2" not in finished
    assert eos.status == RequestStatus.FINISHED_STOPPED
    engine.step()
    assert engine.finished()["2"].finish_reason.name == "LENGTH"
    assert engine.tokens("2") == [7, SAMPLED_TOKEN_ID]
    assert engine.outputs[-1].finished_req_ids == {"0", "1"}  # handed to the workers the next step


@pytest.mark.parametrize("cls", SYNC)
def test_stop_inside_accepted_drafts_trims_the_tokens(cls):
    """A stop token among the tokens of one step: the tokens after it are
    dropped, and num_computed_tokens counts up to it."""
    scheduler = make_scheduler(cls, num_speculative_tokens=3)
    (request,) = make_requests(1, 10, max_tokens=10, stop_token_ids=[42])
    engine = Engine(scheduler, drafts=lambda r: [5, 6, 7])  # noqa: ARG005
    engine.add([request])
    engine.step()  # prefill; drafts 5, 6, 7 come back
    out = engine.step(sampled={"0": [5, 42, 8]})
    assert out.scheduled_spec_decode_tokens == {"0": [5, 6, 7]}
    assert engine.tokens("0") == [SAMPLED_TOKEN_ID, 5, 42]
    assert engine.finished()["0"].stop_reason == 42


# ---------------------------------------------------------------- preemption

def _preemption_scheduler(cls, v2: bool):
    """6 usable blocks, three 32-token prompts: all admitted (2 blocks each),
    then the first decode needs a third block for each."""
    scheduler = make_scheduler(cls, num_blocks=7, model_runner_v2=v2)
    engine = Engine(scheduler, tables=BlockTables())
    engine.add(make_requests(3, 32, max_tokens=3, ignore_eos=True))
    return scheduler, engine


@pytest.mark.parametrize("cls", SYNC)
@pytest.mark.parametrize("v2", [True, False], ids=["mrv2", "mrv1"])
def test_preemption_takes_the_last_request_and_reuses_its_tail_block_first(cls, v2):
    scheduler, engine = _preemption_scheduler(cls, v2)
    out = engine.step()
    assert new_ids(out) == [("0", ([1, 2],), 0), ("1", ([3, 4],), 0), ("2", ([5, 6],), 0)]
    out = engine.step()
    # request 0 finds no free block: request 2, the last running, is preempted; its blocks are freed
    # last first (6 then 5, both cached: to the queue's tail in that order), so 0 gets 6 and 1 gets 5
    assert out.preempted_req_ids == {"2"}
    assert cached_ids(out) == [("0", ([6],), 32), ("1", ([5],), 32)]
    assert [r.request_id for r in scheduler.waiting] == ["2"]
    request = scheduler.requests["2"]
    assert (request.status, request.num_computed_tokens, request.num_preemptions) == (
        RequestStatus.PREEMPTED, 0, 1)
    assert list(request.output_token_ids) == [SAMPLED_TOKEN_ID]  # its prefill's token was kept


@pytest.mark.parametrize("cls", SYNC)
@pytest.mark.parametrize("v2", [True, False], ids=["mrv2", "mrv1"])
def test_resumed_request_recomputes_from_scratch(cls, v2):
    """Requests 0 and 1 finish (max_tokens 3), freeing [6, 2, 1] and [5, 4, 3]
    (uncached tail blocks 6 and 5 to the front); request 2, whose own cached
    blocks 5 and 6 were evicted when 0 and 1 took them, resumes with no hit
    and its 33 tokens in blocks 5, 6 and 2. Model runner V2 gets it as a new
    request; V1 as a cached one in resumed_req_ids with its whole block list."""
    scheduler, engine = _preemption_scheduler(cls, v2)
    for _ in range(3):
        engine.step()
    assert set(engine.finished()) == {"0", "1"}
    assert KVView(scheduler).free_queue() == [5, 6, 2, 1, 4, 3]
    out = engine.step()
    assert out.finished_req_ids == {"0", "1"}
    assert out.num_scheduled_tokens == {"2": 33}
    if v2:
        assert new_ids(out) == [("2", ([5, 6, 2],), 0)]
        assert out.scheduled_cached_reqs.req_ids == []
    else:
        assert new_ids(out) == []
        assert cached_ids(out) == [("2", ([5, 6, 2],), 0)]
        assert out.scheduled_cached_reqs.resumed_req_ids == {"2"}
        assert out.scheduled_cached_reqs.all_token_ids["2"] == [2] * 32 + [SAMPLED_TOKEN_ID]
    stats = stats_of(engine.results[-1])
    assert (stats.prefix_cache_stats.preempted_requests, stats.prefix_cache_stats.preempted_queries,
            stats.prefix_cache_stats.preempted_hits) == (1, 33, 0)
    engine.run_until_idle()
    assert engine.tokens("2") == [SAMPLED_TOKEN_ID] * 3
    KVView(scheduler).assert_empty()


@pytest.mark.parametrize("cls", SYNC)
def test_resumed_request_hits_its_own_cached_blocks(cls):
    """With room to spare, a preempted request's computed blocks stay cached
    and its resumption hits them: the lookup runs on the request's block hashes
    (prompt and output), capped at num_tokens - 1."""
    scheduler = make_scheduler(cls, num_blocks=100)
    engine = Engine(scheduler)
    engine.add(make_requests(1, 32, max_tokens=5, ignore_eos=True))
    engine.step()
    request = scheduler.running.pop()
    scheduler._preempt_request(request, 0.0)  # what schedule() does to the victim
    out = engine.step()
    assert new_ids(out) == [("0", ([1, 2, 3],), 32)]
    assert out.num_scheduled_tokens == {"0": 1}


# ---------------------------------------------------------------- speculative decoding

@pytest.mark.parametrize("cls", SYNC)
def test_rejected_drafts_roll_back_the_computed_tokens(cls):
    scheduler = make_scheduler(cls, num_speculative_tokens=3)
    (request,) = make_requests(1, 20, max_tokens=20, ignore_eos=True)
    engine = Engine(scheduler, drafts=lambda r: [11, 12, 13])  # noqa: ARG005
    engine.add([request])
    engine.step()
    assert request.spec_token_ids == [11, 12, 13]
    out = engine.step(sampled={"0": [11, 99]})  # one draft accepted, then the bonus token
    assert out.num_scheduled_tokens == {"0": 4}
    assert out.scheduled_spec_decode_tokens == {"0": [11, 12, 13]}
    assert request.num_computed_tokens == 22  # 21 + 4 scheduled, less the 2 rejected drafts
    assert request.num_tokens == 23
    spec = stats_of(engine.results[-1]).spec_decoding_stats
    assert (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens) == (1, 3, 1)
    assert spec.num_accepted_tokens_per_pos == [1, 0, 0]


@pytest.mark.parametrize("cls", SYNC)
def test_no_drafts_are_scheduled_for_a_prefill_chunk(cls):
    """Drafts handed back for a request still prefilling are dropped."""
    scheduler = make_scheduler(cls, num_speculative_tokens=2, max_num_batched_tokens=32, max_num_seqs=4,
                               max_model_len=256)
    engine = Engine(scheduler, drafts=lambda r: [11, 12])  # noqa: ARG005
    engine.add(make_requests(1, 40))
    engine.step()  # 32 of 40
    assert scheduler.requests["0"].spec_token_ids == []
    out = engine.step()
    assert out.num_scheduled_tokens == {"0": 8}
    assert out.scheduled_spec_decode_tokens == {}


@pytest.mark.parametrize("cls", SYNC)
def test_drafts_are_cut_to_the_token_budget(cls):
    scheduler = make_scheduler(cls, num_speculative_tokens=3, max_num_batched_tokens=16, max_num_seqs=4,
                               max_model_len=256)
    engine = Engine(scheduler, drafts=lambda r: [11, 12, 13])  # noqa: ARG005
    engine.add(make_requests(1, 14, max_tokens=20, ignore_eos=True))
    engine.step()
    engine.add(make_requests(1, 14, first_id=1, max_tokens=20, ignore_eos=True))
    out = engine.step(sampled={"0": [11, 12, 13, 99]})
    assert out.num_scheduled_tokens == {"0": 4, "1": 12}
    out = engine.step()
    # drafts of 0 ride within the budget first; request 1 gets the rest of its prompt
    assert out.num_scheduled_tokens == {"0": 4, "1": 2}


# ---------------------------------------------------------------- prompt logprobs, stats, usage

@pytest.mark.parametrize("cls", SYNC)
def test_prompt_logprobs_skip_the_prefix_cache(cls):
    """A request asking for prompt logprobs neither reads the prefix cache
    (skip_reading_prefix_cache) nor counts in the prefix-cache stats; its
    computed blocks are still cached for others."""
    scheduler = make_scheduler(cls)
    engine = Engine(scheduler)
    engine.add(make_requests(1, 40, prompt=lambda i: [7] * 40, max_tokens=1))  # noqa: ARG005
    engine.run_until_idle()
    (logprobs,) = make_requests(1, 40, prompt=lambda i: [7] * 40, first_id=1, max_tokens=1,  # noqa: ARG005
                                prompt_logprobs=1)
    if HIT_LIMIT:
        assert logprobs.prefix_cache_hit_limit == 0  # (0.34: no prompt_logprob_start, so nothing may be read)
    else:
        assert logprobs.skip_reading_prefix_cache is True
    engine.add([logprobs])
    out = engine.step()
    # request 0's blocks [1, 2, 3] freed: block 3 (tokens 32..40, not full, uncached) is reused first
    assert new_ids(out) == [("1", ([3, 4, 5],), 0)]
    stats = stats_of(engine.results[-1]).prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (0, 0, 0)


@pytest.mark.parametrize("cls", SYNC)
def test_usage_counts_held_blocks_over_the_usable_pool(cls):
    """kv_cache_usage = 1 - free / (num_blocks - 1): the null block is not counted."""
    scheduler = make_scheduler(cls, num_blocks=11)
    engine = Engine(scheduler)
    engine.add(make_requests(1, 40, max_tokens=5, ignore_eos=True))
    engine.step()
    stats = stats_of(engine.results[-1])
    assert stats.kv_cache_usage == pytest.approx(0.3)
    assert scheduler.get_kv_cache_usage() == pytest.approx(0.3)


@pytest.mark.parametrize("cls", SYNC)
def test_prefix_cache_stats_are_recorded_at_admission_and_reset_per_step(cls):
    scheduler = make_scheduler(cls)
    engine = Engine(scheduler)
    shared = list(range(32))
    engine.add(make_requests(1, prompt=lambda i: shared + [500] * 8, max_tokens=2))  # noqa: ARG005
    engine.step()
    engine.add(make_requests(2, prompt=lambda i: shared + [600 + i] * 8, first_id=1, max_tokens=2))
    engine.step()
    stats = stats_of(engine.results[-1]).prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (2, 80, 64)
    engine.step()
    stats = stats_of(engine.results[-1]).prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (0, 0, 0)


@pytest.mark.parametrize("cls", SYNC)
def test_refused_admission_is_not_counted_in_the_stats(cls):
    """A request the pool cannot take now is looked up every step but counted
    once, when it is admitted (record_prefix_cache_stats after allocate_slots)."""
    scheduler = make_scheduler(cls, num_blocks=5)
    engine = Engine(scheduler)
    engine.add(make_requests(2, 48, max_tokens=1))
    engine.step()
    stats = stats_of(engine.results[-1]).prefix_cache_stats
    assert (stats.requests, stats.queries) == (1, 48)  # request 1 (3 blocks) does not fit beside 0
    engine.step()
    stats = stats_of(engine.results[-1]).prefix_cache_stats
    assert (stats.requests, stats.queries) == (1, 48)


def test_finished_set_reaches_the_client_outputs():
    scheduler = make_scheduler(VllmScheduler, include_finished_set=True)
    engine = Engine(scheduler)
    engine.add(make_requests(1, 10, max_tokens=1))
    engine.step()
    assert engine.results[-1][0].finished_requests == {"0"}
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {}
    assert model_output(scheduler, out).req_ids == []


@pytest.mark.parametrize("cls", BOTH)
def test_admission_needs_room_for_the_whole_prompt_not_just_its_chunk(cls):
    """scheduler_reserve_full_isl (on by default): allocate_slots(...,
    full_sequence_must_fit=True) admits a waiting request only if its whole
    prompt fits. 5 usable blocks; request 0 takes 3 (48 tokens); request 1's
    first 16-token chunk would fit in the 2 left, its 48-token prompt does not."""
    scheduler = make_scheduler(cls, num_blocks=6, max_num_batched_tokens=64, max_num_seqs=4, max_model_len=256)
    assert scheduler.scheduler_reserve_full_isl is True
    for request in make_requests(2, 48, max_tokens=2, ignore_eos=True):
        scheduler.add_request(request)
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"0": 48}
    assert [r.request_id for r in scheduler.waiting] == ["1"]
    assert KVView(scheduler).num_free_blocks() == 2
