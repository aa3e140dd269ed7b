"""vLLM 0.8.5's v1 ``Scheduler`` behaviours, on vLLM's own KV-cache manager and on gpukv's.

Each test runs four times: on vLLM's ``Scheduler`` (``vllm``: the test's
expectations are vLLM's own), on ``gpukv.vllm.ReferenceScheduler``
(``reference``: vLLM's loop), on ``gpukv.vllm.BatchedReferenceScheduler``
(``batched``: the batched ``schedule()``) and on
``gpukv.vllm.DeviceScheduler`` (``device``, batched; on a machine
without CUDA its Triton kernels run under the interpreter, so these runs stay
small: the tests that admit many requests admit fewer there,
``harness.small_on_interpreter``). The behaviours are those vLLM 0.8.5's ``tests/v1/core/test_scheduler.py``
checks, written anew here; where vLLM's test reads its manager's internals, the
same facts are read through ``harness.KVView``, and every step also checks that
the block tables a model runner would rebuild from the ``SchedulerOutput``\\ s
equal the blocks the manager holds (``harness.BlockTables``).

Adapted, not skipped:

* the multimodal tests need llava-1.5's processor only for one number, the
  576 tokens an image takes; a stand-in model config and multimodal registry
  report it (``make_scheduler(mm_tokens_per_item=...)``);
* the KV-connector tests use vLLM's real ``SharedStorageConnector`` on a fresh
  temporary folder, its remote hit count fixed by the test as vLLM's test does;
* the stop tests run real schedule / update steps (the requests hold blocks)
  instead of placing requests in ``running`` by hand, so a stop also frees
  blocks; each request's first output token is the one its prefill sampled.

Run with vLLM 0.8.5 importable (``harness.INSTALL_HINT``)::

    PYTHONPATH=. DIR/venv/bin/python -m pytest -q tests/test_vllm/test_scheduler.py
"""

from __future__ import annotations

from typing import Any

import pytest

from .harness import (
    EOS_TOKEN_ID,
    LLAVA_IMAGE_TOKENS,
    SAMPLED_TOKEN_ID,
    BlockTables,
    KVView,
    PlaceholderRange,
    RequestStatus,
    SchedulerOutput,
    make_requests,
    make_scheduler,
    model_output,
    run_until_idle,
    scheduler_params,
    small_on_interpreter,
    step,
)

ALL = scheduler_params()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _schedule(scheduler: Any, tables: BlockTables) -> SchedulerOutput:
    """``schedule()``, then the block tables from the outputs checked against the manager."""
    out = scheduler.schedule()
    tables.update(out)
    tables.check(scheduler)
    return out


# ---------------------------------------------------------------- the request queues

@pytest.mark.parametrize("scheduler_cls", ALL)
def test_add_requests_queue_in_order(scheduler_cls):
    scheduler = make_scheduler(scheduler_cls)
    requests = make_requests(10)
    for n, request in enumerate(requests, 1):
        scheduler.add_request(request)
        assert scheduler.requests[request.request_id] is request
        assert len(scheduler.waiting) == n
    assert list(scheduler.waiting) == requests
    assert scheduler.get_num_unfinished_requests() == 10


@pytest.mark.parametrize("scheduler_cls", ALL)
def test_abort_waiting_requests(scheduler_cls):
    """Aborting a request that never got blocks drops it and frees nothing."""
    scheduler = make_scheduler(scheduler_cls)
    requests = make_requests(10)
    for request in requests:
        scheduler.add_request(request)
    for n, request in enumerate(requests, 1):
        scheduler.finish_requests(request.request_id, RequestStatus.FINISHED_ABORTED)
        assert request.request_id not in scheduler.requests
        assert request.status == RequestStatus.FINISHED_ABORTED
        assert len(scheduler.waiting) == 10 - n
    assert scheduler.finished_req_ids == {r.request_id for r in requests}
    KVView(scheduler).assert_empty()


@pytest.mark.parametrize("scheduler_cls", ALL)
def test_num_unfinished_requests_counts_down(scheduler_cls):
    scheduler = make_scheduler(scheduler_cls)
    requests = make_requests(10)
    for request in requests:
        scheduler.add_request(request)
    for n, request in enumerate(requests, 1):
        scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_STOPPED)
        assert scheduler.get_num_unfinished_requests() == 10 - n
    assert not scheduler.has_unfinished_requests()


@pytest.mark.parametrize("scheduler_cls", ALL)
def test_abort_running_request_frees_its_blocks(scheduler_cls):
    scheduler = make_scheduler(scheduler_cls, num_blocks=64)
    for request in make_requests(3, num_tokens=40):
        scheduler.add_request(request)
    tables = BlockTables()
    step(scheduler, tables=tables)
    view = KVView(scheduler)
    assert view.num_free_blocks() == 63 - 3 * 3
    scheduler.finish_requests("1", RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in scheduler.running] == ["0", "2"]
    assert view.request_ids() == {"0", "2"}
    assert view.num_free_blocks() == 63 - 2 * 3
    out = _schedule(scheduler, tables)
    assert out.finished_req_ids == {"1"}
    assert out.num_scheduled_tokens == {"0": 1, "2": 1}


# ---------------------------------------------------------------- scheduling prompts

@pytest.mark.parametrize("enable_prefix_caching, prompt_logprobs", [(None, None), (True, 5)],
                         ids=["default", "caching+logprobs"])
@pytest.mark.parametrize("scheduler_cls", ALL)
def test_schedule_whole_prompts(scheduler_cls, enable_prefix_caching, prompt_logprobs):
    """Ten short prompts fit the budget: all admitted at once, in arrival order."""
    scheduler = make_scheduler(scheduler_cls, enable_prefix_caching=enable_prefix_caching)
    n = small_on_interpreter(scheduler_cls, 10, 4)
    requests = make_requests(n, prompt_logprobs=prompt_logprobs)
    for request in requests:
        scheduler.add_request(request)
    tables = BlockTables()
    out = _schedule(scheduler, tables)
    assert [new.req_id for new in out.scheduled_new_reqs] == [r.request_id for r in requests]
    assert out.scheduled_cached_reqs == []
    assert out.finished_req_ids == set()
    assert out.num_scheduled_tokens == {r.request_id: len(r.prompt_token_ids) for r in requests}
    assert out.total_num_scheduled_tokens == 10 * n
    assert not scheduler.waiting
    assert scheduler.running == requests
    view = KVView(scheduler)
    assert all(len(view.block_ids(r.request_id)) == 1 for r in requests)
    assert view.num_free_blocks() == view.num_blocks - 1 - n
    assert len({b for r in requests for b in view.block_ids(r.request_id)}) == n


# ---------------------------------------------------------------- multimodal inputs

def _image_requests(num_requests: int, num_tokens: int, offsets: list[int], length: int):
    positions = [[PlaceholderRange(offset=offset, length=length)] for offset in offsets]
    return make_requests(num_requests, num_tokens=num_tokens, mm_positions=positions)


@pytest.mark.parametrize("scheduler_cls", ALL)
def test_schedule_multimodal_prompts(scheduler_cls):
    scheduler = make_scheduler(scheduler_cls, mm_tokens_per_item=LLAVA_IMAGE_TOKENS)
    n = small_on_interpreter(scheduler_cls, 10, 4)
    requests = _image_requests(n, 200, offsets=list(range(n)), length=100)
    for request in requests:
        scheduler.add_request(request)
    tables = BlockTables()
    out = _schedule(scheduler, tables)
    assert len(out.scheduled_new_reqs) == n
    assert out.scheduled_cached_reqs == []
    assert out.num_scheduled_tokens == {r.request_id: 200 for r in requests}
    assert out.scheduled_encoder_inputs == {r.request_id: [0] for r in requests}


@pytest.mark.parametrize("scheduler_cls", ALL)
def test_encoder_budget_splits_prompts(scheduler_cls):
    """An image that does not fit the step's encoder budget stops its request's
    chunk just before the image; a request whose next token is inside such an
    image is not scheduled at all, though it is running."""
    scheduler = make_scheduler(scheduler_cls, mm_tokens_per_item=LLAVA_IMAGE_TOKENS, max_num_batched_tokens=1024)
    assert scheduler.max_num_encoder_input_tokens == 1024
    requests = _image_requests(3, 800, offsets=[100] * 3, length=600)
    for request in requests:
        scheduler.add_request(request)
    tables = BlockTables()
    out = _schedule(scheduler, tables)
    assert len(out.scheduled_new_reqs) == 3
    assert out.num_scheduled_tokens == {"0": 800, "1": 100, "2": 100}
    assert out.scheduled_encoder_inputs == {"0": [0]}
    mro = model_output(scheduler, out)
    assert mro.sampled_token_ids == [[SAMPLED_TOKEN_ID], [], []]  # only request 0 finished its prompt
    scheduler.update_from_output(out, mro)

    out = _schedule(scheduler, tables)
    assert len(scheduler.running) == 3
    assert out.scheduled_new_reqs == []
    assert [c.req_id for c in out.scheduled_cached_reqs] == ["0", "1"]
    assert out.num_scheduled_tokens == {"0": 1, "1": 700}
    assert out.scheduled_encoder_inputs == {"1": [0]}
    view = KVView(scheduler)
    assert len(view.block_ids("0")) == _cdiv(801, 16)
    assert len(view.block_ids("1")) == _cdiv(800, 16)
    assert len(view.block_ids("2")) == _cdiv(100, 16)


@pytest.mark.parametrize("scheduler_cls", ALL)
def test_unchunked_image_waits_for_a_whole_step(scheduler_cls):
    """With chunked multimodal input off, a chunk never ends inside an image."""
    scheduler = make_scheduler(scheduler_cls, mm_tokens_per_item=LLAVA_IMAGE_TOKENS, max_num_batched_tokens=1024,
                               disable_chunked_mm_input=True, max_model_len=2048)
    scheduler.add_request(_image_requests(1, 1200, offsets=[400], length=800)[0])
    tables = BlockTables()
    out = _schedule(scheduler, tables)
    assert len(out.scheduled_new_reqs) == 1
    assert out.num_scheduled_tokens == {"0": 400}  # the text before the image, not 1024
    scheduler.update_from_output(out, model_output(scheduler, out))

    out = _schedule(scheduler, tables)
    assert [c.req_id for c in out.scheduled_cached_reqs] == ["0"]
    assert out.num_scheduled_tokens == {"0": 800}  # the image whole
    assert len(KVView(scheduler).block_ids("0")) == _cdiv(1200, 16)


@pytest.mark.parametrize("scheduler_cls", ALL)
def test_unchunked_image_larger_than_the_budget_is_refused(scheduler_cls):
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        make_scheduler(scheduler_cls, mm_tokens_per_item=LLAVA_IMAGE_TOKENS, max_num_batched_tokens=100,
                       disable_chunked_mm_input=True)


# ---------------------------------------------------------------- chunked prefill

@pytest.mark.parametrize("enable_prefix_caching", [True, False], ids=["caching", "no-caching"])
@pytest.mark.parametrize("scheduler_cls", ALL)
def test_long_prefills_share_the_budget(scheduler_cls, enable_prefix_caching):
    """``long_prefill_token_threshold`` caps each prefill chunk, so several long
    prompts advance together; the last one takes what the budget leaves."""
    scheduler = make_scheduler(scheduler_cls, max_num_batched_tokens=1024, long_prefill_token_threshold=400,
                               enable_prefix_caching=enable_prefix_caching)
    requests = make_requests(3, num_tokens=800)
    for request in requests:
        scheduler.add_request(request)
    tables = BlockTables()
    out = _schedule(scheduler, tables)
    assert len(out.scheduled_new_reqs) == 3
    assert out.num_scheduled_tokens == {"0": 400, "1": 400, "2": 224}
    scheduler.update_from_output(out, model_output(scheduler, out))
    view = KVView(scheduler)
    assert [len(view.block_ids(r.request_id)) for r in requests] == [25, 25, 14]

    out = _schedule(scheduler, tables)
    assert out.scheduled_new_reqs == []
    assert len(out.scheduled_cached_reqs) == 3
    assert out.num_scheduled_tokens == {"0": 400, "1": 400, "2": 224}
    mro = model_output(scheduler, out)
    assert mro.sampled_token_ids == [[SAMPLED_TOKEN_ID], [SAMPLED_TOKEN_ID], []]
    scheduler.update_from_output(out, mro)

    out = _schedule(scheduler, tables)
    assert len(out.scheduled_cached_reqs) == 3
    assert out.num_scheduled_tokens == {"0": 1, "1": 1, "2": 800 - 2 * 224}
    assert [len(view.block_ids(r.request_id)) for r in requests] == [51, 51, 50]
    if enable_prefix_caching:
        # Full blocks are cached when they are allocated, before they are computed.
        assert [view.num_cached_blocks(r.request_id) for r in requests] == [50, 50, 50]


@pytest.mark.parametrize("enable_prefix_caching, prompt_logprobs", [(None, None), (True, 5)],
                         ids=["default", "caching+logprobs"])
@pytest.mark.parametrize("scheduler_cls", ALL)
def test_next_batch_scheduled_before_the_last_returns(scheduler_cls, enable_prefix_caching, prompt_logprobs):
    """Pipelined batches: while request 0's prompt is in flight it gets nothing
    more, request 1 is admitted; once 0's token is back, 0 decodes."""
    scheduler = make_scheduler(scheduler_cls, max_num_batched_tokens=1024, max_num_seqs=2,
                               enable_prefix_caching=enable_prefix_caching)
    requests = make_requests(2, num_tokens=512, prompt_logprobs=prompt_logprobs)
    tables = BlockTables()
    scheduler.add_request(requests[0])
    out0 = _schedule(scheduler, tables)
    assert [n.req_id for n in out0.scheduled_new_reqs] == ["0"]
    assert out0.num_scheduled_tokens == {"0": 512}

    scheduler.add_request(requests[1])
    out1 = _schedule(scheduler, tables)
    assert [n.req_id for n in out1.scheduled_new_reqs] == ["1"]
    assert out1.num_scheduled_tokens == {"1": 512}

    scheduler.update_from_output(out0, model_output(scheduler, out0))
    out2 = _schedule(scheduler, tables)
    assert out2.num_scheduled_tokens == {"0": 1}
    scheduler.update_from_output(out1, model_output(scheduler, out1))
    assert [r.num_output_tokens for r in requests] == [1, 1]
    view = KVView(scheduler)
    assert [len(view.block_ids(r.request_id)) for r in requests] == [33, 32]


# ---------------------------------------------------------------- stopping

def _decoding(scheduler_cls, *, num_speculative_tokens: int, drafts: dict[str, list[int]], **request_kwargs):
    """A scheduler whose requests have computed their prompts and sampled token
    5, and the output of the step that verifies their drafts ``drafts``."""
    scheduler = make_scheduler(scheduler_cls, num_speculative_tokens=num_speculative_tokens)
    requests = make_requests(len(drafts), **request_kwargs)
    for request in requests:
        scheduler.add_request(request)
    tables = BlockTables()
    out = _schedule(scheduler, tables)
    scheduler.update_from_output(out, model_output(scheduler, out, lambda _r: 5, spec_token_ids=drafts))
    out = _schedule(scheduler, tables)
    assert out.num_scheduled_tokens == {rid: 1 + len(d) for rid, d in drafts.items()}
    assert out.scheduled_spec_decode_tokens == {rid: d for rid, d in drafts.items() if d}
    return scheduler, requests, out


def _finish(scheduler, out, sampled: dict[str, list[int]]) -> None:
    scheduler.update_from_output(out, model_output(scheduler, out, sampled=sampled, spec_token_ids={}))


def _assert_only_running(scheduler, request_id: str, stopped: str) -> None:
    assert [r.request_id for r in scheduler.running] == [request_id]
    assert stopped in scheduler.finished_req_ids
    view = KVView(scheduler)
    assert view.request_ids() == {request_id}
    assert view.block_ids(stopped) == []


@pytest.mark.parametrize("scheduler_cls", ALL)
def test_stop_on_eos(scheduler_cls):
    scheduler, (r0, r1), out = _decoding(scheduler_cls, num_speculative_tokens=1, drafts={"0": [], "1": [10]},
                                         max_tokens=10)
    _finish(scheduler, out, {"0": [EOS_TOKEN_ID], "1": [10, 11]})
    _assert_only_running(scheduler, "1", stopped="0")
    assert r0.status == RequestStatus.FINISHED_STOPPED
    assert list(r0.output_token_ids) == [5, EOS_TOKEN_ID]
    assert list(r1.output_token_ids) == [5, 10, 11]


@pytest.mark.parametrize("scheduler_cls", ALL)
def test_stop_on_a_stop_token_drops_what_follows(scheduler_cls):
    scheduler, (r0, r1), out = _decoding(scheduler_cls, num_speculative_tokens=2,
                                         drafts={"0": [10, 42], "1": [13]}, max_tokens=10, stop_token_ids=[42, 43])
    _finish(scheduler, out, {"0": [10, 42, 12], "1": [13, 14]})
    _assert_only_running(scheduler, "1", stopped="0")
    assert r0.status == RequestStatus.FINISHED_STOPPED
    assert r0.stop_reason == 42
    assert list(r0.output_token_ids) == [5, 10, 42]
    assert list(r1.output_token_ids) == [5, 13, 14]


@pytest.mark.parametrize("scheduler_cls", ALL)
def test_stop_at_max_tokens_truncates(scheduler_cls):
    scheduler, (r0, r1), out = _decoding(scheduler_cls, num_speculative_tokens=2, drafts={"0": [10, 11], "1": []},
                                         max_tokens=3)
    _finish(scheduler, out, {"0": [10, 11, 12], "1": [13]})
    _assert_only_running(scheduler, "1", stopped="0")
    assert r0.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert list(r0.output_token_ids) == [5, 10, 11]
    assert list(r1.output_token_ids) == [5, 13]


@pytest.mark.parametrize("scheduler_cls", ALL)
def test_ignore_eos_runs_past_eos(scheduler_cls):
    scheduler, (r0,), out = _decoding(scheduler_cls, num_speculative_tokens=2, drafts={"0": [EOS_TOKEN_ID, 10]},
                                      max_tokens=10, ignore_eos=True)
    _finish(scheduler, out, {"0": [EOS_TOKEN_ID, 10, 11]})
    assert scheduler.running == [r0]
    assert not r0.is_finished()
    assert list(r0.output_token_ids) == [5, EOS_TOKEN_ID, 10, 11]
    assert len(KVView(scheduler).block_ids("0")) == 1  # 10 + 3 tokens allocated: one block


# ---------------------------------------------------------------- speculative decoding

@pytest.mark.parametrize(
    "drafts, sampled, expected",
    [
        # (drafts per request, tokens sampled when they are verified,
        #  (drafts, draft tokens, accepted tokens, accepted per position))
        ([[1, 2, 3]], [[1, 2, 3, 4]], (1, 3, 3, [1, 1, 1])),
        ([[1, 2, 3]], [[1, 5]], (1, 3, 1, [1, 0, 0])),
        ([[1, 2], [3]], [[1, 2, 5], [3, 4]], (2, 3, 3, [2, 1])),
        ([[1]], [[1, 2]], (1, 1, 1, [1])),
        ([[]], [[5]], (0, 0, 0, [0])),
        ([[1, 2, 3], [4, 5, 6]], [[1, 2, 7], [4, 8]], (2, 6, 3, [2, 1, 0])),
    ],
    ids=["all-accepted", "first-rejected-later", "two-requests", "one-draft", "no-drafts", "two-rejections"],
)
@pytest.mark.parametrize("scheduler_cls", ALL)
def test_spec_decoding_schedules_drafts_and_counts_acceptance(scheduler_cls, drafts, sampled, expected):
    scheduler = make_scheduler(scheduler_cls, num_speculative_tokens=max(1, *map(len, drafts)))
    requests = make_requests(len(drafts), num_tokens=1)
    ids = [r.request_id for r in requests]
    for request in requests:
        scheduler.add_request(request)
    tables = BlockTables()
    out = _schedule(scheduler, tables)
    assert out.num_scheduled_tokens == dict.fromkeys(ids, 1)
    assert out.scheduled_spec_decode_tokens == {}
    new_drafts = dict(zip(ids, drafts, strict=True))
    result = scheduler.update_from_output(
        out, model_output(scheduler, out, sampled=dict.fromkeys(ids, [0]), spec_token_ids=new_drafts))
    for request, d in zip(scheduler.running, drafts, strict=True):
        assert (request.num_computed_tokens, request.num_tokens, request.num_tokens_with_spec) == (1, 2, 2 + len(d))
    assert result.scheduler_stats.spec_decoding_stats is None

    out = _schedule(scheduler, tables)
    assert out.scheduled_new_reqs == []
    assert out.total_num_scheduled_tokens == len(ids) + sum(map(len, drafts))
    assert out.num_scheduled_tokens == {rid: 1 + len(d) for rid, d in zip(ids, drafts, strict=True)}
    assert out.scheduled_spec_decode_tokens == {rid: d for rid, d in zip(ids, drafts, strict=True) if d}
    result = scheduler.update_from_output(
        out, model_output(scheduler, out, sampled=dict(zip(ids, sampled, strict=True)), spec_token_ids={}))
    stats = result.scheduler_stats.spec_decoding_stats
    if expected[0] == 0:
        assert stats is None
    else:
        got = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens, stats.num_accepted_tokens_per_pos)
        assert got == expected

    # Rejected drafts are given back: the next step computes from the last sampled token on.
    for request, s in zip(scheduler.running, sampled, strict=True):
        assert (request.num_computed_tokens, request.num_tokens) == (1 + len(s), 2 + len(s))
    out = _schedule(scheduler, tables)
    assert out.num_scheduled_tokens == dict.fromkeys(ids, 1)
    scheduler.update_from_output(out, model_output(scheduler, out, spec_token_ids={}))
    run_until_idle(scheduler, tables=tables)
    KVView(scheduler).assert_empty()


# ---------------------------------------------------------------- KV connector (remote prefix hits)

def _remote_hits(scheduler, num_tokens: int) -> None:
    """The connector reports ``num_tokens`` more tokens found remotely at every lookup."""
    scheduler.connector.get_num_new_matched_tokens = lambda *_args: num_tokens


def _assert_scheduled(out: SchedulerOutput, num_connector_requests: int, num_tokens: int) -> None:
    """The connector has work for this many requests; each scheduled request got ``num_tokens``."""
    assert len(out.kv_connector_metadata.requests) == num_connector_requests
    assert set(out.num_scheduled_tokens.values()) <= {num_tokens}


def _decode_until_finished(scheduler, out: SchedulerOutput, tables: BlockTables) -> None:
    """Answer ``out``, then decode (one token a step, no connector work) until
    a step's outputs all finish their requests."""
    result = scheduler.update_from_output(out, model_output(scheduler, out))
    while not result.outputs or any(o.finish_reason is None for o in result.outputs):
        out = _schedule(scheduler, tables)
        assert scheduler.running
        _assert_scheduled(out, 0, 1)
        result = scheduler.update_from_output(out, model_output(scheduler, out))


@pytest.mark.parametrize("scheduler_cls", ALL)
def test_kv_connector_remote_and_local_hits(scheduler_cls, tmp_path):
    scheduler = make_scheduler(scheduler_cls, enable_prefix_caching=True, kv_connector_path=tmp_path, num_blocks=1000)
    view = KVView(scheduler)
    free_at_start = view.num_free_blocks()
    block_size = scheduler.cache_config.block_size
    remote = 2 * block_size
    _remote_hits(scheduler, remote)
    tables = BlockTables()

    # Remote hits only: both requests load 32 tokens and compute the other 32.
    num_tokens = 2 * remote
    for request in make_requests(2, num_tokens=num_tokens, max_tokens=3):
        scheduler.add_request(request)
    out = _schedule(scheduler, tables)
    _assert_scheduled(out, 2, num_tokens - remote)
    for rid in ("0", "1"):
        assert len(view.block_ids(rid)) == num_tokens // block_size
        assert view.num_cached_blocks(rid) == num_tokens // block_size
        assert view.num_block_hashes(rid) == num_tokens // block_size
    assert view.num_free_blocks() == free_at_start - 2 * num_tokens // block_size
    _decode_until_finished(scheduler, out, tables)
    scheduler.schedule()
    assert view.num_free_blocks() == free_at_start

    # The same prompts twice as long: 64 tokens hit locally, 32 remotely, 32 computed.
    local = num_tokens
    num_tokens = 2 * local
    for request in make_requests(2, num_tokens=num_tokens, max_tokens=3):
        scheduler.add_request(request)
    out = _schedule(scheduler, tables)
    _assert_scheduled(out, 2, num_tokens - local - remote)
    assert [r.num_computed_tokens for r in scheduler.running] == [num_tokens] * 2
    for rid in ("0", "1"):
        assert len(view.block_ids(rid)) == num_tokens // block_size
        assert view.num_cached_blocks(rid) == num_tokens // block_size
        assert view.num_block_hashes(rid) == num_tokens // block_size
    assert view.num_free_blocks() == free_at_start - 2 * num_tokens // block_size
    _decode_until_finished(scheduler, out, tables)
    scheduler.schedule()
    assert view.num_free_blocks() == free_at_start


@pytest.mark.parametrize("scheduler_cls", ALL)
def test_kv_connector_request_waits_for_blocks(scheduler_cls, tmp_path):
    """A remote hit still needs local blocks: the second request waits until
    the first has finished and freed its blocks."""
    block_size, num_blocks = 4, 10
    scheduler = make_scheduler(scheduler_cls, enable_prefix_caching=True, kv_connector_path=tmp_path,
                               block_size=block_size, num_blocks=num_blocks)
    remote = 2 * block_size
    _remote_hits(scheduler, remote)
    num_tokens = (num_blocks // 2 + 1) * block_size
    for request in make_requests(2, num_tokens=num_tokens, max_tokens=2):
        scheduler.add_request(request)
    view = KVView(scheduler)
    tables = BlockTables()
    for still_waiting in (1, 0):
        out = _schedule(scheduler, tables)
        _assert_scheduled(out, 1, num_tokens - remote)
        assert (len(scheduler.running), len(scheduler.waiting)) == (1, still_waiting)
        _decode_until_finished(scheduler, out, tables)
        assert view.num_free_blocks() == num_blocks - 1
        assert (len(scheduler.running), len(scheduler.waiting)) == (0, still_waiting)


@pytest.mark.parametrize("scheduler_cls", ALL)
def test_kv_connector_preempted_request_resumes_with_hits(scheduler_cls, tmp_path):
    block_size, num_blocks = 2, 7  # 6 usable blocks
    scheduler = make_scheduler(scheduler_cls, enable_prefix_caching=True, kv_connector_path=tmp_path,
                               block_size=block_size, num_blocks=num_blocks)
    _remote_hits(scheduler, block_size)
    num_tokens = 2 * block_size + 1
    for request in make_requests(2, num_tokens=num_tokens, max_tokens=2 * block_size):
        scheduler.add_request(request)
    view = KVView(scheduler)
    tables = BlockTables()

    def one_step(num_connector_requests: int, num_scheduled: int, scheduled: tuple, updated: tuple) -> None:
        """One step; (running, waiting) after ``schedule()`` and after ``update_from_output``."""
        out = _schedule(scheduler, tables)
        _assert_scheduled(out, num_connector_requests, num_scheduled)
        assert (len(scheduler.running), len(scheduler.waiting)) == scheduled
        scheduler.update_from_output(out, model_output(scheduler, out))
        assert (len(scheduler.running), len(scheduler.waiting)) == updated

    one_step(2, num_tokens - block_size, (2, 0), (2, 0))  # both admitted with a remote hit: 3 blocks each
    one_step(0, 1, (2, 0), (2, 0))  # output token 2: still within their blocks
    one_step(0, 1, (1, 1), (1, 1))  # token 3 needs a block each: request 1 is preempted
    assert view.request_ids() == {"0"}
    # Request 0's last token. Request 1 would hit 4 tokens locally and 2 remotely, but its
    # hit blocks are free blocks and it needs 2 more besides: it keeps waiting.
    one_step(0, 1, (1, 1), (0, 1))
    assert view.num_free_blocks() == num_blocks - 1
    one_step(1, 1, (1, 0), (1, 0))  # request 1 resumes with those hits and computes its last sampled token
    one_step(0, 1, (1, 0), (0, 0))
    view.assert_empty()


# ---------------------------------------------------------------- nothing leaks

def _assert_scheduler_empty(scheduler) -> None:
    assert scheduler.requests == {}
    assert not scheduler.waiting and not scheduler.running
    assert scheduler.finished_req_ids == set()
    assert len(scheduler._cached_reqs_data) == 0
    assert scheduler.encoder_cache_manager.freed == []
    assert scheduler.encoder_cache_manager.cached == {}
    KVView(scheduler).assert_empty()


@pytest.mark.parametrize("scheduler_cls", ALL)
def test_no_leak_after_requests_finish(scheduler_cls):
    scheduler = make_scheduler(scheduler_cls, enable_prefix_caching=True)
    tables = BlockTables()
    for request in make_requests(small_on_interpreter(scheduler_cls, 5, 3), num_tokens=10, max_tokens=10):
        scheduler.add_request(request)
        step(scheduler, tables=tables)
    # Run until the scheduler has also told the workers of the last finished request.
    while scheduler.running or scheduler.finished_req_ids:
        step(scheduler, tables=tables)
    _assert_scheduler_empty(scheduler)
