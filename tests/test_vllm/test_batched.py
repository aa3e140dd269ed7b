"""``gpukv.vllm.Scheduler``'s batched ``schedule()``: its cost and its preemptions.

* gpukv calls and device reads per step: the batched path makes one gpukv
  call a step (the frees since the last step, the running batch, the waiting
  run) and reads the device once in it (the admission's status and the
  running batch's fit, every new block id, the common prefix's reference
  counts), whatever the number of requests, where vLLM's loop reads it once
  per request.
* A running batch that fails mid-way (a pool too small for every request's
  next block): the requests before the failure keep their blocks, vLLM's loop
  goes on from the failed one (preempting from the tail), and every
  ``SchedulerOutput`` equals vLLM's own, step by step.
* The cases the batched path hands to vLLM's loop.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.test_vllm.harness import (  # first: it skips the module without vLLM
    EOS_TOKEN_ID,
    SAMPLED_TOKEN_ID,
    BlockTables,
    VllmScheduler,
    make_requests,
    make_scheduler,
    model_output,
    scheduler_params,
)
from tests.test_vllm.test_differential import CONFIGS, assert_same, describe_output, describe_result

# (after the harness, which skips the module without vLLM)
gv = pytest.importorskip("gpukv.vllm", reason="gpukv.vllm needs vLLM 0.8.5 installed")


def counting_reads(scheduler: Any) -> list[int]:
    """A list that gets an entry per device read of the scheduler's device manager."""
    manager = scheduler.kv_cache_manager.manager
    reads: list[int] = []
    read = manager._read

    def counted(t: Any) -> list:
        reads.append(1)
        return read(t)

    manager._read = counted
    return reads


def counting_calls(scheduler: Any) -> list[str]:
    """A list that gets the name of each call the scheduler's adapter makes
    to its gpukv manager (reads of host state included)."""
    manager = scheduler.kv_cache_manager.manager
    calls: list[str] = []

    class Counted:
        def __getattr__(self, name: str) -> Any:
            member = getattr(manager, name)
            if not callable(member):
                return member

            def call(*args: Any, **kwargs: Any) -> Any:
                calls.append(name)
                return member(*args, **kwargs)

            return call

    scheduler.kv_cache_manager.manager = Counted()
    return calls


def per_step(cls: type, num_requests: int, num_steps: int, *, log_stats: bool = True) -> tuple[list, list, list]:
    """Per ``schedule()``: device reads, gpukv calls; and per
    ``update_from_output``: gpukv calls. ``num_requests`` prompts of 20
    tokens (two blocks of 16 once their first sampled token is in), admitted
    in step 0, then decoded; the first finishes at step 5 (its EOS token)."""
    scheduler = make_scheduler(cls, num_blocks=16 * num_requests + 8, block_size=16, max_num_batched_tokens=2048,
                               max_model_len=512, max_num_seqs=num_requests, enable_prefix_caching=True,
                               log_stats=log_stats)
    for request in make_requests(num_requests, 20, ignore_eos=False, max_tokens=20):
        scheduler.add_request(request)
    reads = counting_reads(scheduler)
    calls = counting_calls(scheduler)
    reads_out, calls_out, update_calls = [], [], []
    for i in range(num_steps):
        del reads[:], calls[:]
        out = scheduler.schedule()
        reads_out.append(len(reads))
        calls_out.append(list(calls))
        del calls[:]
        sample = (lambda r: EOS_TOKEN_ID if r.request_id == "0" else SAMPLED_TOKEN_ID) if i == 5 else None
        scheduler.update_from_output(out, model_output(scheduler, out, sample))
        update_calls.append(list(calls))
    return reads_out, calls_out, update_calls


@pytest.mark.parametrize("num_requests", [4, 24])
@pytest.mark.parametrize("cls", scheduler_params("device"))
def test_batched_device_reads_and_calls_do_not_grow_with_the_requests(cls: type, num_requests: int) -> None:
    """One gpukv step and one read a step, whatever the number of requests:
    step 0 admits them all, steps 1-12 decode within their blocks (one more
    call, host only: the rows' token counts), step 13 crosses a block
    boundary; the request finished at step 5 is freed in update_from_output's
    one call (``usage`` needs the free count: one read there) and not again
    in step 6."""
    assert cls.batched is True  # the default
    reads, calls, updates = per_step(cls, num_requests, 14)
    assert reads == [1] * 14
    assert calls == [["step"]] + [["row_token_counts", "step"]] * 13
    assert updates[5] == ["step", "read_num_free_blocks"]  # the free, then vLLM's usage
    assert all(u == ["read_num_free_blocks"] for i, u in enumerate(updates) if i != 5)


@pytest.mark.parametrize("cls", scheduler_params("device"))
def test_without_stats_frees_fold_into_the_next_step(cls: type) -> None:
    """Without ``log_stats`` nothing reads the pool after a step: the frees
    of update_from_output wait for the next step's one call."""
    reads, calls, updates = per_step(cls, 4, 8, log_stats=False)
    assert reads == [1] * 8 and calls == [["step"]] + [["row_token_counts", "step"]] * 7
    assert updates == [[]] * 8


@pytest.mark.parametrize("cls", scheduler_params("device-unbatched"))
def test_unbatched_device_reads_once_per_request(cls: type) -> None:
    """vLLM's loop on the device manager, for comparison: a read per lookup
    and one per admission, its new blocks' ids (no request hits, so the host
    knows each admission's outcome: no status read, ``Admission.known_fit``);
    a running request's call reads nothing (the free count from the host
    mirror), the step the common prefix only."""
    assert per_step(cls, 4, 2)[0] == [4 + 4 + 1, 1]


# ---------------------------------------------------------------- preemption mid-batch

def preempting_run(cls: type) -> tuple[list[dict[str, Any]], list[tuple[int, int]]]:
    """Four requests of 30 tokens on 9 usable blocks of 16: all admitted (two
    blocks each), then at their 33rd token each needs a third block: request
    0 takes the last free one, request 1 does not fit, so request 3 (the
    tail) is preempted and request 1 retried. Returns each step's output and
    result, and for the batched path each running batch's (size, granted)."""
    scheduler = make_scheduler(cls, num_blocks=10, block_size=16, max_num_seqs=4, max_num_batched_tokens=256,
                               max_model_len=256, enable_prefix_caching=True)
    batches: list[tuple[int, int]] = []
    kvm = scheduler.kv_cache_manager
    if hasattr(kvm, "schedule_batch"):
        schedule_batch = kvm.schedule_batch

        def spy(requests: Any, *args: Any, **kwargs: Any) -> Any:
            outcome = schedule_batch(requests, *args, **kwargs)
            if len(requests):
                batches.append((len(requests), outcome.num_running))
            return outcome

        kvm.schedule_batch = spy
    for request in make_requests(4, 30, ignore_eos=True, max_tokens=10):
        scheduler.add_request(request)
    records, tables = [], BlockTables()
    for _ in range(40):
        if not scheduler.waiting and not scheduler.running:
            break
        out = scheduler.schedule()
        tables.update(out)
        tables.check(scheduler)
        record = describe_output(out)
        record.update(describe_result(scheduler.update_from_output(out, model_output(scheduler, out))))
        records.append(record)
    return records, batches


PREEMPTING = scheduler_params("batched", "device")


@pytest.mark.parametrize("cls", PREEMPTING)
def test_running_batch_fails_midway_then_preempts_as_vllm(cls: type) -> None:
    want, _ = preempting_run(VllmScheduler)
    got, batches = preempting_run(cls)
    # vLLM's own run, as planned: step 3 schedules requests 0, 1 and 2, each
    # with a new block (request 3 preempted for request 1's), then request 3
    # waits for a finished request's blocks and resumes.
    assert want[3]["cached"] == [
        ("0", False, [1000], [9], 32), ("1", False, [1000], [8], 32), ("2", False, [1000], [7], 32)]
    assert [r["num_scheduled_tokens"] for r in want[:4]] == [
        {"0": 30, "1": 30, "2": 30, "3": 30}, *[{"0": 1, "1": 1, "2": 1, "3": 1}] * 2, {"0": 1, "1": 1, "2": 1}]
    assert [step for step, r in enumerate(want) if any(c[1] for c in r["cached"])] == [10]
    assert want[10]["cached"] == [("3", True, [3] * 30 + [1000] * 3, [9, 2, 1], 0)]
    assert len(got) == len(want) == 17
    for i, (w, g) in enumerate(zip(want, got, strict=True)):
        assert g == w, f"step {i}"
    # The batched path: the step-3 batch of four granted one (request 0), the
    # rest went through vLLM's loop; then three running, then request 3
    # alone (steps 0 and 10 have no running request: no batch).
    assert batches == [(4, 4), (4, 4), (4, 1)] + [(3, 3)] * 6 + [(1, 1)] * 6


# ---------------------------------------------------------------- what is handed to vLLM's loop

def test_delegated_steps_run_vllms_loop(tmp_path: Any) -> None:
    """A KV connector, a sliding window, or a running request with nothing
    to schedule: the whole step is vLLM's ``schedule()`` (no batched call);
    a plain step is batched."""
    calls: list[str] = []

    class Spy(gv.ReferenceScheduler):
        def _schedule_batched(self, step: Any, plan: list[int]) -> None:
            calls.append("batched")
            super()._schedule_batched(step, plan)

    def run(**options: Any) -> list[str]:  # the two requests both scheduled, on either path
        del calls[:]
        scheduler = make_scheduler(Spy, enable_prefix_caching=True, **options)
        for request in make_requests(2, 20):
            scheduler.add_request(request)
        out = scheduler.schedule()
        assert set(out.num_scheduled_tokens) == {"0", "1"}
        return list(calls)

    assert run() == ["batched"]
    assert run(sliding_window=64) == []
    assert run(kv_connector_path=tmp_path) == []
    scheduler = make_scheduler(Spy, enable_prefix_caching=True)
    for request in make_requests(2, 20):
        scheduler.add_request(request)
    out = scheduler.schedule()
    scheduler.update_from_output(out, model_output(scheduler, out))
    scheduler.running[1].num_computed_tokens = scheduler.running[1].num_tokens  # nothing left (pipeline parallel)
    del calls[:]
    out = scheduler.schedule()
    assert calls == [] and set(out.num_scheduled_tokens) == {"0"}


# ---------------------------------------------------------------- batches and single admissions mixed

class EveryThirdAlone(gv.ReferenceScheduler):
    """The batched path whose adapter declares every third request not
    batchable (as it does a resumed request whose lookup vLLM caps, or one
    carrying speculative tokens): the waiting queue is then admitted in runs,
    each broken by a request admitted through vLLM's loop body."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        kvm = self.kv_cache_manager
        batchable = kvm.waiting_batchable
        kvm.waiting_batchable = lambda r, la=0: batchable(r, la) and int(r.request_id[1:]) % 3 != 0


@pytest.mark.parametrize("seed", [2, 5, 7, 8, 10, 12])
def test_runs_of_batches_and_single_admissions_as_vllm(seed: int) -> None:
    (config,) = [c for c in CONFIGS if c.seed == seed]
    assert_same(config, EveryThirdAlone)


def test_a_capped_resumed_lookup_is_not_batched() -> None:
    """vLLM looks a resumed request up on the blocks it hashed before its
    preemption; when that is fewer than gpukv's step would look up
    (``lookup="vllm"``), the request is admitted one call at a time."""
    (request,) = make_requests(1, 50)  # three full blocks of 16, the last lookup-able at (50 - 1) // 16 = 3
    scheduler = make_scheduler(gv.ReferenceScheduler, enable_prefix_caching=True)
    kvm = scheduler.kv_cache_manager
    assert kvm.waiting_batchable(request)
    kvm._num_hashed[request.request_id] = 2  # hashed two blocks before it was preempted
    assert not kvm.waiting_batchable(request)
    kvm.lookup = "all"
    assert kvm.waiting_batchable(request)
    kvm.lookup = "vllm"
    kvm._num_hashed[request.request_id] = 3
    assert kvm.waiting_batchable(request)
    assert not kvm.waiting_batchable(request, num_lookahead_tokens=kvm.max_model_len)


# ---------------------------------------------------------------- a long waiting queue

def queue_run(cls: type, prompt: Any) -> tuple[list[dict[str, Any]], list[int]]:
    """100 requests of 50 tokens waiting at once under a budget of 256 tokens
    a step: each step's output and result, and for the batched path the
    number of waiting requests handed to each gpukv call."""
    scheduler = make_scheduler(cls, max_num_seqs=128, max_num_batched_tokens=256, max_model_len=256,
                               enable_prefix_caching=True)
    offered: list[int] = []
    kvm = scheduler.kv_cache_manager
    if hasattr(kvm, "schedule_batch"):
        schedule_batch = kvm.schedule_batch

        def spy(running: Any, plan: Any, waiting: Any, **kwargs: Any) -> Any:
            offered.append(len(waiting))
            return schedule_batch(running, plan, waiting, **kwargs)

        kvm.schedule_batch = spy
    for request in make_requests(100, prompt=prompt, max_tokens=2):
        scheduler.add_request(request)
    records = []
    for _ in range(100):
        if not scheduler.waiting and not scheduler.running:
            break
        out = scheduler.schedule()
        record = describe_output(out)
        record.update(describe_result(scheduler.update_from_output(out, model_output(scheduler, out))))
        records.append(record)
    assert not scheduler.waiting and not scheduler.running
    return records, offered


def test_a_long_queue_is_offered_only_what_the_budget_can_take() -> None:
    """Past the first ``MIN_OFFER`` waiting requests, a gpukv call is handed
    those up to the one whose uncomputed tokens reach the step's budget,
    not the whole queue (each would be turned into a gpukv request, its
    tokens copied, every step, for the five that fit); vLLM's decisions
    are unchanged."""
    prompt = lambda i: [i + 1] * 50  # noqa: E731  (no two requests share a block)
    records, offered = queue_run(gv.ReferenceScheduler, prompt)
    assert records == queue_run(VllmScheduler, prompt)[0]
    from gpukv.vllm.v0_8 import scheduler

    assert scheduler.MIN_OFFER == 64
    assert offered[:3] == [64, 64, 64]  # 100, 95 and 90 waiting
    assert max(offered) == 64


def test_prefix_hits_past_the_offer_are_admitted_as_vllm() -> None:
    """With a shared prefix the offered requests take less than their
    uncomputed tokens; the budget left goes to the next requests in
    another gpukv call, as vLLM's loop admits them."""
    prompt = lambda i: [7] * 48 + [i + 100] * 2  # noqa: E731  (three shared blocks, then two tokens of its own)
    records, offered = queue_run(gv.ReferenceScheduler, prompt)
    assert records == queue_run(VllmScheduler, prompt)[0]
    # step 1: request 0 computes its 50 tokens, each later one 2 (its 48
    # tokens hit): the first 64 in one call, the 36 left in a second
    assert records[0]["total"] == 50 + 99 * 2
    assert offered[:2] == [64, 36]
