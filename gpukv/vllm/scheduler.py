"""vLLM 0.8.5's v1 ``Scheduler`` on gpukv: ``--scheduler-cls gpukv.vllm.Scheduler``.

Its ``SchedulerOutput`` is vLLM's: the same requests scheduled, token counts,
block ids, preemptions and finished requests (``tests/test_vllm/`` hold it to
that, step by step). Two ways to get there:

* vLLM's own ``schedule()``, unchanged, on gpukv's block manager
  (``gpukv.vllm.KVCacheManager``), which answers each call as vLLM's manager
  does: one gpukv call per request, each a device read on the device manager.
* The batched ``schedule()`` (``batched``; the default on the device manager):
  vLLM's loop logic on the host, and the block manager's work in a few
  batched calls: every running request grown in one gpukv step, the waiting
  queue admitted in one gpukv step (vLLM's waiting loop on the manager), and
  every new block id read back in one device read. Where a step has something
  it does not handle, the whole step is vLLM's own (``Scheduler``'s docstring
  names those cases).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from itertools import chain, islice
from typing import Any

from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler
from vllm.v1.engine import EngineCoreEventType
from vllm.v1.request import Request, RequestStatus

from gpukv.vllm.manager import KVCacheManager


@dataclass
class _Step:
    """What one batched ``schedule()`` has decided so far (vLLM's locals)."""

    token_budget: int
    timestamp: float
    new: list[Request] = field(default_factory=list)
    resumed: list[Request] = field(default_factory=list)
    running: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # new block ids: known ones, and positions to read (rid, start, end)
    block_ids: dict[str, list[int]] = field(default_factory=dict)
    spans: list[tuple[str, int, int]] = field(default_factory=list)
    req_index: int = 0


class Scheduler(VllmScheduler):
    """vLLM's scheduler with gpukv's block manager. ``backend``: "auto" (the
    device manager on CUDA, else the reference), "reference" or "device".

    ``batched`` (class attribute, or set on an instance): True for the
    batched ``schedule()``, False for vLLM's loop calling the manager once per
    request; None (the default) picks the batched one on the device manager
    and vLLM's loop on the reference.

    The batched ``schedule()`` hands a step to vLLM's own ``schedule()``, whole,
    when the step has any of: a LoRA config (``max_loras`` admission checks),
    a KV connector (external hits and its metadata), EAGLE (``use_eagle``: the
    lookup drops its last hit block), a sliding-window KV-cache group (gpukv's
    batched step releases every running request's blocks behind the window
    before the first fit check, vLLM one request at a time, so a tight pool
    could decide differently), a running request or one of the waiting
    requests it could admit with encoder inputs (encoder budget and cache) or
    structured output (the grammar bitmask, ``WAITING_FOR_FSM``), or a
    running request with no token to schedule (pipeline parallelism). Handled
    exactly: chunked prefill, the long-prefill threshold, ``max_model_len``,
    speculative tokens and lookahead slots, prompt logprobs, preemption (the
    running batch stops at the first request that does not fit; vLLM's loop
    goes on from there one call at a time) and resumed requests (one whose
    lookup vLLM caps below gpukv's, and one carrying speculative tokens, is
    admitted by vLLM's loop body, one call at a time).
    """

    backend = "auto"
    batched: bool | None = None
    finished_req_ids: set[str]  # vLLM's (typed here: mypy does not see vLLM's)

    def __init__(self, vllm_config: Any, kv_cache_config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(vllm_config, kv_cache_config, *args, **kwargs)
        # vLLM's constructor built its own manager; this one replaces it,
        # with the arguments vLLM gave its own.
        # Not a subclass of vLLM's manager (it shares no state with it), but its interface.
        self.kv_cache_manager = KVCacheManager(  # type: ignore[assignment]
            kv_cache_config=kv_cache_config,
            max_model_len=self.max_model_len,
            enable_caching=bool(self.cache_config.enable_prefix_caching),
            caching_hash_algo=self.cache_config.prefix_caching_hash_algo,
            use_eagle=self.use_eagle,
            log_stats=self.log_stats,
            backend=self.backend,
            max_num_reqs=self.max_num_running_reqs,
        )
        if self.batched is None:
            self.batched = self._kvm.backend == "device"

    @property
    def _kvm(self) -> KVCacheManager:
        return self.kv_cache_manager  # type: ignore[return-value]

    # ------------------------------------------------------------ the step
    def schedule(self) -> SchedulerOutput:
        """vLLM's ``schedule()``: batched when ``batched`` and the step has
        nothing the batched path hands to vLLM's loop (class docstring)."""
        plan = self._running_plan() if self.batched and self._batchable() else None
        if plan is None:
            return super().schedule()
        step = _Step(token_budget=self.max_num_scheduled_tokens, timestamp=time.monotonic())
        self._schedule_running(step, plan)
        if not step.preempted:
            self._schedule_waiting(step)
        return self._output(step)

    def _batchable(self) -> bool:
        """No LoRA, KV connector, EAGLE or sliding window, and no request the
        step may schedule with encoder inputs or structured output."""
        if self.lora_config or self.connector is not None or self.use_eagle:
            return False
        if self._kvm.sliding_window is not None:
            return False
        room = max(0, self.max_num_running_reqs - len(self.running))
        return not any(r.has_encoder_inputs or r.use_structured_output or r.status == RequestStatus.WAITING_FOR_FSM
                       for r in chain(self.running, islice(self.waiting, room)))

    def _num_new_running(self, request: Request, token_budget: int) -> int:
        """vLLM's tokens to schedule for a running request (before encoder inputs)."""
        num_new_tokens = request.num_tokens_with_spec - request.num_computed_tokens
        threshold = self.scheduler_config.long_prefill_token_threshold
        if 0 < threshold < num_new_tokens:
            num_new_tokens = threshold
        num_new_tokens = min(num_new_tokens, token_budget)
        return min(num_new_tokens, self.max_model_len - request.num_computed_tokens)

    def _running_plan(self) -> list[int] | None:
        """Each running request's ``num_new_tokens`` if all are scheduled (vLLM's
        loop without a preemption), on the host; None when one has none
        (pipeline parallelism: vLLM skips it, the batched path does not)."""
        budget, plan = self.max_num_scheduled_tokens, []
        for request in self.running:
            if budget <= 0:
                break
            num_new_tokens = self._num_new_running(request, budget)
            if num_new_tokens == 0:
                return None
            plan.append(num_new_tokens)
            budget -= num_new_tokens
        return plan

    # ------------------------------------------------------- running phase
    def _schedule_running(self, step: _Step, plan: list[int]) -> None:
        """vLLM's running loop: the planned requests grown in one gpukv step;
        from the first that does not fit, vLLM's loop (preempt from the tail,
        retry) one request at a time."""
        batch = self.running[: len(plan)]
        spans = self._kvm.allocate_running(batch, plan, self.num_lookahead_tokens) if batch else []
        for request, num_new_tokens, (start, end) in zip(batch, plan, spans, strict=False):
            step.spans.append((request.request_id, start, end))
            self._scheduled_running(step, request, num_new_tokens)
        req_index = len(spans)
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
            step.block_ids[request.request_id] = [b.block_id for b in new_blocks]
            self._scheduled_running(step, request, num_new_tokens)
            req_index += 1
        step.req_index = req_index

    def _scheduled_running(self, step: _Step, request: Request, num_new_tokens: int) -> None:
        """vLLM's bookkeeping for a running request that got its blocks."""
        step.running.append(request)
        step.num_scheduled_tokens[request.request_id] = num_new_tokens
        step.token_budget -= num_new_tokens
        if request.spec_token_ids:
            num_spec = num_new_tokens + request.num_computed_tokens - request.num_tokens
            if num_spec > 0:
                del request.spec_token_ids[num_spec:]
                step.spec_decode_tokens[request.request_id] = request.spec_token_ids

    # ------------------------------------------------------- waiting phase
    def _schedule_waiting(self, step: _Step) -> None:
        """vLLM's waiting loop: each run of batchable requests (up to the free
        running slots) admitted in one gpukv step, any other request by
        vLLM's loop body, until the budget, the slots or the blocks run out."""
        kvm, lookahead = self._kvm, self.num_lookahead_tokens
        threshold = self.scheduler_config.long_prefill_token_threshold
        while self.waiting and step.token_budget > 0 and len(self.running) < self.max_num_running_reqs:
            batch = []
            for request in islice(self.waiting, self.max_num_running_reqs - len(self.running)):
                if not kvm.waiting_batchable(request, lookahead):
                    break
                batch.append(request)
            if not batch:
                if not self._schedule_one_waiting(step, self.waiting[0]):
                    break
                continue
            admitted = kvm.admit_waiting(batch, num_tokens_to_compute=threshold if threshold > 0 else None,
                                         num_lookahead_tokens=lookahead, token_budget=step.token_budget)
            for request, (hit, num_new_tokens, (start, end)) in zip(batch, admitted, strict=False):
                self.waiting.popleft()
                step.spans.append((request.request_id, start, end))
                self._scheduled_waiting(step, request, hit, num_new_tokens)
            if len(admitted) < len(batch):
                break  # refused, or the budget is spent

    def _schedule_one_waiting(self, step: _Step, request: Request) -> bool:
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

    def _scheduled_waiting(self, step: _Step, request: Request, num_computed_tokens: int,
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

    # ------------------------------------------------------------ the output
    def _output(self, step: _Step) -> SchedulerOutput:
        """vLLM's ``SchedulerOutput`` from the step's decisions (the new block
        ids of the batched calls read here, in one read), then vLLM's
        advance of ``num_computed_tokens`` and of ``finished_req_ids``."""
        num_scheduled_tokens = step.num_scheduled_tokens
        total = sum(num_scheduled_tokens.values())
        assert total <= self.max_num_scheduled_tokens
        assert step.token_budget >= 0
        assert len(self.running) <= self.max_num_running_reqs
        assert len(step.new) + len(step.resumed) + len(step.running) <= len(self.running)
        block_ids = step.block_ids
        for (rid, _, _), ids in zip(step.spans, self._kvm.read_new_block_ids(step.spans), strict=True):
            block_ids[rid] = ids
        num_common_prefix_blocks = 0
        if self.running:
            num_common_prefix_blocks = self._kvm.get_num_common_prefix_blocks(self.running[0], len(self.running))
        grammar_bitmask = self.structured_output_manager.grammar_bitmask(self.requests, {}, len(self.running))

        def cached(request: Request, resumed: bool) -> Any:
            rid = request.request_id
            return self._make_cached_request_data(request, num_scheduled_tokens[rid],
                                                  len(step.spec_decode_tokens.get(rid, ())), block_ids[rid],
                                                  resumed_from_preemption=resumed)

        output = SchedulerOutput(
            scheduled_new_reqs=[NewRequestData.from_request(r, block_ids[r.request_id]) for r in step.new],
            scheduled_cached_reqs=[cached(r, True) for r in step.resumed] + [cached(r, False) for r in step.running],
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=total,
            scheduled_spec_decode_tokens=step.spec_decode_tokens,
            scheduled_encoder_inputs={},
            num_common_prefix_blocks=num_common_prefix_blocks,
            finished_req_ids=self.finished_req_ids,
            free_encoder_input_ids=self.encoder_cache_manager.get_freed_ids(),
            structured_output_request_ids={},
            grammar_bitmask=grammar_bitmask,
        )
        for rid, num_tokens in num_scheduled_tokens.items():
            self.requests[rid].num_computed_tokens += num_tokens
        self.finished_req_ids = set()
        return output


class ReferenceScheduler(Scheduler):
    """On gpukv's reference manager (host memory, any machine); vLLM's loop
    (``batched`` False) unless told otherwise."""

    backend = "reference"


class BatchedReferenceScheduler(ReferenceScheduler):
    """On gpukv's reference manager, with the batched ``schedule()``."""

    batched = True


class DeviceScheduler(Scheduler):
    """On gpukv's device manager (CUDA; on a CPU, Triton's interpreter), with
    the batched ``schedule()`` unless told otherwise."""

    backend = "device"


class UnbatchedDeviceScheduler(DeviceScheduler):
    """On gpukv's device manager, with vLLM's loop (one call per request)."""

    batched = False
