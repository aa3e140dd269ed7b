"""vLLM 0.8.5's v1 ``Scheduler`` on gpukv: ``--scheduler-cls gpukv.vllm.Scheduler``.

Its ``SchedulerOutput`` is vLLM's: the same requests scheduled, token counts,
block ids, preemptions and finished requests (``tests/test_vllm/`` hold it to
that, step by step). Two ways to get there:

* vLLM's own ``schedule()``, unchanged, on gpukv's block manager
  (``gpukv.vllm.KVCacheManager``), which answers each call as vLLM's manager
  does: one gpukv call per request, each a device read on the device manager.
* The batched ``schedule()`` (``batched``, the default): vLLM's loop
  decisions on the host, made over arrays where they allow it, and the
  block manager's work for the whole step in one gpukv call
  (``KVCacheManager.schedule_batch``: the requests freed since the last
  step, every running request grown, the waiting queue admitted by vLLM's
  waiting loop on the manager, every new block id and the common prefix's
  reference counts, in one device read). Where a step has something it does
  not handle, the whole step is vLLM's own (``Scheduler``'s docstring names
  those cases); where the running batch does not fit, vLLM's loop goes on
  from the first request that did not, one call at a time. The output is
  built in one pass over the scheduled requests (``BatchedOutput``, in
  ``gpukv.vllm.v0_8.batched_step``), and ``update_from_output`` after a batched
  step is a tighter loop making vLLM's own objects (``BatchedUpdate``, in
  ``gpukv.vllm.v0_8.batched_update``). Both are bases of ``Scheduler``: methods
  of the scheduler, apart by what they do, changing the scheduler's state.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from itertools import accumulate, islice
from typing import Any

from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.engine import EngineCoreEventType, EngineCoreOutputs
from vllm.v1.request import Request, RequestStatus

from gpukv.vllm.discarded import unlink_free_list
from gpukv.vllm.v0_8.batched_step import BatchedOutput, BatchedStep
from gpukv.vllm.v0_8.batched_update import BatchedUpdate
from gpukv.vllm.v0_8.manager import KVCacheManager

MIN_OFFER = 64
"""Waiting requests a batched call is always offered, budget or not (when
that many wait and are batchable): prefix hits can make each take a few
tokens, and every further call is one more gpukv step."""


class Scheduler(BatchedOutput, BatchedUpdate):
    """vLLM's scheduler with gpukv's block manager. ``backend``: "auto" (the
    device manager on CUDA, else the reference), "reference" or "device".

    ``batched`` (class attribute, or set on an instance): True (the default)
    for the batched ``schedule()``, False for vLLM's loop calling the
    manager once per request.

    The batched ``schedule()`` hands a step to vLLM's own ``schedule()``, whole,
    when the step has any of: a LoRA config (``max_loras`` admission checks),
    a KV connector (external hits and its metadata), EAGLE (``use_eagle``: the
    lookup drops its last hit block), a sliding-window KV-cache group (gpukv's
    batched step releases every running request's blocks behind the window
    before the first fit check, vLLM one request at a time, so a tight pool
    could decide differently), a request in the scheduler with encoder inputs
    (encoder budget and cache) or structured output (the grammar bitmask,
    ``WAITING_FOR_FSM``), or a running request with no token to schedule
    (pipeline parallelism). Handled
    exactly: chunked prefill, the long-prefill threshold, ``max_model_len``,
    speculative tokens and lookahead slots, prompt logprobs, preemption (the
    running batch stops at the first request that does not fit; vLLM's loop
    goes on from there one call at a time) and resumed requests (one whose
    lookup vLLM caps below gpukv's, and one carrying speculative tokens, is
    admitted by vLLM's loop body, one call at a time).
    """

    backend = "auto"
    batched: bool | None = True
    finished_req_ids: set[str]  # vLLM's (typed here: mypy does not see vLLM's)

    def __init__(self, vllm_config: Any, kv_cache_config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(vllm_config, kv_cache_config, *args, **kwargs)
        # vLLM's constructor built its own manager; this one replaces it,
        # with the arguments vLLM gave its own.
        # Not a subclass of vLLM's manager (it shares no state with it), but its interface.
        unlink_free_list(self.kv_cache_manager)  # (vLLM's, replaced: freed now, not by a later full collection)
        self.kv_cache_manager = KVCacheManager(  # type: ignore[assignment]
            kv_cache_config=kv_cache_config,
            max_model_len=self.max_model_len,
            enable_caching=bool(self.cache_config.enable_prefix_caching),
            caching_hash_algo=self.cache_config.prefix_caching_hash_algo,
            use_eagle=self.use_eagle,
            log_stats=self.log_stats,
            backend=self.backend,
            max_num_reqs=self.max_num_running_reqs,
            max_num_batched_tokens=self.max_num_scheduled_tokens,
        )
        if self.batched is None:
            self.batched = True
        self._last_batched = False  # whether the last schedule() was batched (update_from_output's path)
        self._num_special = 0  # requests with encoder inputs or structured output (``_batchable``)

    @property
    def _kvm(self) -> KVCacheManager:
        return self.kv_cache_manager  # type: ignore[return-value]

    # ------------------------------------------------------------ the step
    def schedule(self) -> SchedulerOutput:
        """vLLM's ``schedule()``: batched when ``batched`` and the step has
        nothing the batched path hands to vLLM's loop (class docstring)."""
        plan = self._running_plan() if self.batched and self._batchable() else None
        self._last_batched = plan is not None
        if plan is None:
            return super().schedule()
        step = BatchedStep(token_budget=self.max_num_scheduled_tokens, timestamp=time.monotonic())
        self._schedule_batched(step, plan)
        return self._batched_output(step)

    def _batchable(self) -> bool:
        """No LoRA, KV connector, EAGLE or sliding window, and no request
        with encoder inputs or structured output (``WAITING_FOR_FSM`` is
        one) in the scheduler (a count, not a scan of the queues)."""
        if self.lora_config or self.connector is not None or self.use_eagle:
            return False
        return self._kvm.sliding_window is None and not self._num_special

    @staticmethod
    def _special(request: Request) -> bool:
        """A request the batched path leaves to vLLM's loop."""
        return request.has_encoder_inputs or request.use_structured_output

    def add_request(self, request: Request) -> None:
        super().add_request(request)
        self._num_special += self._special(request)

    def _free_request(self, request: Request) -> None:
        self._num_special -= self._special(request)
        super()._free_request(request)

    def _running_plan(self) -> list[int] | None:
        """Each running request's ``num_new_tokens`` if all are scheduled
        (vLLM's loop without a preemption: the threshold, ``max_model_len``,
        then the budget in order until it is spent); None when one has none
        (pipeline parallelism: vLLM skips it, the batched path does not)."""
        running = self.running
        if self.num_spec_tokens:  # drafts can take a request past max_model_len: vLLM caps it
            mml = self.max_model_len
            n = [min(r.num_tokens_with_spec, mml) - r.num_computed_tokens for r in running]
        else:  # (known tokens never pass max_model_len)
            n = [r.num_tokens - r.num_computed_tokens for r in running]
        threshold = self.scheduler_config.long_prefill_token_threshold
        if threshold > 0:
            n = [min(x, threshold) for x in n]
        budget = self.max_num_scheduled_tokens
        taken = list(accumulate(n))
        m = bisect_left(taken, budget) + 1  # vLLM's loop runs while the budget lasts
        if m >= len(n):
            m = len(n)
        else:
            n = n[:m]
        if m and min(n) == 0:
            return None
        if m and taken[m - 1] > budget:
            n[-1] -= taken[m - 1] - budget
        return n

    # ------------------------------------------------------- the batched call
    def _schedule_batched(self, step: BatchedStep, plan: list[int]) -> None:
        """The running batch and a run of waiting requests in one gpukv call;
        then vLLM's loop where the batch did not fit (preemption), or vLLM's
        waiting loop where the run stopped before a request it does not take."""
        batch = self.running[: len(plan)]
        budget_left = step.token_budget - sum(plan)
        waiting = self._waiting_batch(len(self.running), budget_left) if budget_left > 0 else []
        # vLLM's common prefix is the first running request's after the step:
        # the first admitted one when none runs now.
        first = self.running[0] if self.running else waiting[0] if waiting else None
        outcome = self._kvm.schedule_batch(batch, plan, waiting, num_tokens_to_compute=self._chunk(),
                                           num_lookahead_tokens=self.num_lookahead_tokens, token_budget=budget_left,
                                           prefix_of=first)
        fit = outcome.num_running
        self._scheduled_running(step, batch[:fit], plan[:fit], outcome.running_block_ids)
        if fit < len(batch):
            self._running_loop(step, fit)  # (the batch's waiting requests were not looked at)
            return
        step.req_index = fit
        step.prefix = outcome.result
        for request, (hit, num_new), ids in zip(waiting, outcome.admitted, outcome.admitted_block_ids, strict=False):
            self.waiting.popleft()
            step.block_ids[request.request_id] = ids
            self._scheduled_waiting(step, request, hit, num_new)
        if len(outcome.admitted) == len(waiting) and not step.preempted:
            self._schedule_waiting(step)  # (nothing left, or a request the batch does not take)

    def _waiting_batch(self, num_running: int, token_budget: int) -> list[Request]:
        """The waiting requests vLLM's loop could admit this step (as many as
        the free running slots), up to the first the batch does not take,
        and, past the first ``MIN_OFFER``, no further than the one whose
        uncomputed tokens reach ``token_budget``. A request takes at most
        those tokens, so the ones after it are reached only through prefix
        hits, and ``_schedule_waiting`` offers them in another call while
        the budget lasts (the floor keeps such calls few). Without the bound
        a long queue would be turned into gpukv requests, their tokens
        copied, in every step for the few that fit: host work, and objects
        that outlive young-generation collections and so bring the
        interpreter's full collection (a pause over the whole process
        heap) many steps sooner."""
        batch = []
        kvm, lookahead = self._kvm, self.num_lookahead_tokens
        demand = 0
        for request in islice(self.waiting, max(0, self.max_num_running_reqs - num_running)):
            if not kvm.waiting_batchable(request, lookahead):
                break
            batch.append(request)
            demand += request.num_tokens - request.num_computed_tokens
            if demand >= token_budget and len(batch) >= MIN_OFFER:
                break
        return batch

    def _chunk(self) -> int | None:
        threshold = self.scheduler_config.long_prefill_token_threshold
        return threshold if threshold > 0 else None

    # ------------------------------------------------------- running phase
    def _num_new_running(self, request: Request, token_budget: int) -> int:
        """vLLM's tokens to schedule for a running request (before encoder inputs)."""
        num_new_tokens = request.num_tokens_with_spec - request.num_computed_tokens
        threshold = self.scheduler_config.long_prefill_token_threshold
        if 0 < threshold < num_new_tokens:
            num_new_tokens = threshold
        num_new_tokens = min(num_new_tokens, token_budget)
        return min(num_new_tokens, self.max_model_len - request.num_computed_tokens)

    def _running_loop(self, step: BatchedStep, req_index: int) -> None:
        """vLLM's running loop from ``req_index`` on, one request at a time
        (preempt from the tail, retry)."""
        step.prefix = None  # (the manager changes after the batched call)
        while req_index < len(self.running) and step.token_budget > 0:
            request = self.running[req_index]
            num_new_tokens = self._num_new_running(request, step.token_budget)
            if num_new_tokens == 0:
                req_index += 1
                continue
            while True:
                new_blocks = self._kvm.allocate_slots(request, num_new_tokens,
                                                      num_lookahead_tokens=self.num_lookahead_tokens)
                if new_blocks is not None:
                    break
                preempted = self.running.pop()  # the lowest-priority request
                self._kvm.free(preempted)
                preempted.status = RequestStatus.PREEMPTED
                preempted.num_computed_tokens = 0
                if self.log_stats:
                    preempted.record_event(EngineCoreEventType.PREEMPTED, step.timestamp)
                self.waiting.appendleft(preempted)
                step.preempted.append(preempted)
                if preempted == request:
                    break
            if new_blocks is None:
                break
            self._scheduled_running(step, [request], [num_new_tokens], [[b.block_id for b in new_blocks]])
            req_index += 1
        step.req_index = req_index

    def _scheduled_running(self, step: BatchedStep, requests: list[Request], num_tokens: list[int],
                           block_ids: list[list[int]]) -> None:
        """vLLM's bookkeeping for running requests that got their blocks."""
        step.running += requests
        step.running_tokens += num_tokens
        step.running_blocks += block_ids
        scheduled = step.num_scheduled_tokens
        scheduled.update(zip([r.request_id for r in requests], num_tokens, strict=True))
        step.token_budget -= sum(num_tokens)
        if self.num_spec_tokens:
            for request, n in zip(requests, num_tokens, strict=True):
                if request.spec_token_ids:
                    num_spec = n + request.num_computed_tokens - request.num_tokens
                    if num_spec > 0:
                        del request.spec_token_ids[num_spec:]
                        step.spec_decode_tokens[request.request_id] = request.spec_token_ids

    # ------------------------------------------------------- waiting phase
    def _schedule_waiting(self, step: BatchedStep) -> None:
        """vLLM's waiting loop: each run of batchable requests (up to the free
        running slots) admitted in one gpukv call, any other request by
        vLLM's loop body, until the budget, the slots or the blocks run out."""
        kvm = self._kvm
        while self.waiting and step.token_budget > 0 and len(self.running) < self.max_num_running_reqs:
            step.prefix = None  # (another call changes the manager)
            batch = self._waiting_batch(len(self.running), step.token_budget)
            if not batch:
                if not self._schedule_one_waiting(step, self.waiting[0]):
                    break
                continue
            outcome = kvm.schedule_batch((), (), batch, num_tokens_to_compute=self._chunk(),
                                         num_lookahead_tokens=self.num_lookahead_tokens,
                                         token_budget=step.token_budget, prefix_of=None)
            for request, (hit, num_new), ids in zip(batch, outcome.admitted, outcome.admitted_block_ids,
                                                    strict=False):
                self.waiting.popleft()
                step.block_ids[request.request_id] = ids
                self._scheduled_waiting(step, request, hit, num_new)
            if len(outcome.admitted) < len(batch):
                break  # refused, or the budget is spent

    def _schedule_one_waiting(self, step: BatchedStep, request: Request) -> bool:
        """vLLM's waiting loop body for one request (no LoRA, connector,
        encoder inputs or structured output here); False when refused."""
        computed_blocks, num_computed_tokens = self._kvm.get_computed_blocks(request)
        num_new_tokens = request.num_tokens - num_computed_tokens
        threshold = self.scheduler_config.long_prefill_token_threshold
        if 0 < threshold < num_new_tokens:
            num_new_tokens = threshold
        num_new_tokens = min(num_new_tokens, step.token_budget)
        assert num_new_tokens > 0
        new_blocks = self._kvm.allocate_slots(request, num_new_tokens, computed_blocks,
                                              num_lookahead_tokens=self.num_lookahead_tokens)
        if new_blocks is None:
            return False
        self.waiting.popleft()
        step.block_ids[request.request_id] = [b.block_id for b in computed_blocks + new_blocks]
        self._scheduled_waiting(step, request, num_computed_tokens, num_new_tokens)
        return True

    def _scheduled_waiting(self, step: BatchedStep, request: Request, num_computed_tokens: int,
                           num_new_tokens: int) -> None:
        """vLLM's bookkeeping for an admitted waiting request."""
        step.req_index += 1
        self.running.append(request)
        if self.log_stats:
            request.record_event(EngineCoreEventType.SCHEDULED, step.timestamp)
        if request.status == RequestStatus.WAITING:
            step.new.append(request)
        elif request.status == RequestStatus.PREEMPTED:
            step.resumed.append(request)
        else:
            raise RuntimeError(f"Invalid request status: {request.status}")
        step.num_scheduled_tokens[request.request_id] = num_new_tokens
        step.token_budget -= num_new_tokens
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_computed_tokens

    # -------------------------------------------------- update_from_output
    def update_from_output(self, scheduler_output: SchedulerOutput, model_runner_output: Any) -> EngineCoreOutputs:
        """vLLM's ``update_from_output``; after a batched step (no encoder
        inputs or structured output in it) a tighter loop that makes the same
        objects and state changes (``BatchedUpdate``)."""
        if not self._last_batched:
            return super().update_from_output(scheduler_output, model_runner_output)
        return self._update_batched(scheduler_output, model_runner_output)


class ReferenceScheduler(Scheduler):
    """On gpukv's reference manager (host memory, any machine), with the
    batched ``schedule()`` unless told otherwise."""

    backend = "reference"


class BatchedReferenceScheduler(ReferenceScheduler):
    """On gpukv's reference manager, with the batched ``schedule()`` (as
    ``ReferenceScheduler`` now is by default; kept for the name)."""

    batched = True


class UnbatchedReferenceScheduler(ReferenceScheduler):
    """On gpukv's reference manager, with vLLM's loop (one call per request)."""

    batched = False


class DeviceScheduler(Scheduler):
    """On gpukv's device manager (CUDA; on a CPU, Triton's interpreter), with
    the batched ``schedule()`` unless told otherwise."""

    backend = "device"


class UnbatchedDeviceScheduler(DeviceScheduler):
    """On gpukv's device manager, with vLLM's loop (one call per request)."""

    batched = False
