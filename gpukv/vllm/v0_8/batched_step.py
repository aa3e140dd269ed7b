"""A batched ``schedule()``'s decisions and the ``SchedulerOutput`` made from them.

``gpukv.vllm.Scheduler``'s batched ``schedule()`` records what it decides in
a ``BatchedStep`` (vLLM's locals in its ``schedule()``: the requests
scheduled, their tokens and new block ids, the preempted ones, the budget
left); ``BatchedOutput._batched_output`` then builds vLLM 0.8.5's
``SchedulerOutput`` from it and advances each scheduled request's
``num_computed_tokens`` and the scheduler's ``finished_req_ids`` as vLLM
does, in one pass over the scheduled requests. ``BatchedOutput`` is a base
of ``gpukv.vllm.Scheduler``: what it changes is the scheduler's own state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler
from vllm.v1.request import Request

from gpukv.core.requests import StepResult


@dataclass
class BatchedStep:
    """What one batched ``schedule()`` has decided so far (vLLM's locals)."""

    token_budget: int
    timestamp: float
    new: list[Request] = field(default_factory=list)
    resumed: list[Request] = field(default_factory=list)
    # The running requests scheduled, their tokens and new block ids, in order.
    running: list[Request] = field(default_factory=list)
    running_tokens: list[int] = field(default_factory=list)
    running_blocks: list[list[int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    block_ids: dict[str, list[int]] = field(default_factory=dict)  # new and resumed requests' blocks
    req_index: int = 0
    # The batched call's result, while no later call changed the manager:
    # the common prefix needs no read of its own then.
    prefix: StepResult | None = None

    def new_request_data(self) -> list[NewRequestData]:
        """vLLM's ``NewRequestData`` for each new request, and the advance
        of its ``num_computed_tokens``."""
        out = []
        for request in self.new:
            out.append(NewRequestData.from_request(request, self.block_ids[request.request_id]))
            request.num_computed_tokens += self.num_scheduled_tokens[request.request_id]
        return out


class BatchedOutput(VllmScheduler):
    """vLLM's scheduler, with the ``SchedulerOutput`` of a batched step (a
    base of ``gpukv.vllm.Scheduler``, not used alone)."""

    def _batched_output(self, step: BatchedStep) -> SchedulerOutput:
        """vLLM's ``SchedulerOutput`` from the step's decisions, then vLLM's
        advance of ``num_computed_tokens`` and of ``finished_req_ids``, in one
        pass over the scheduled requests."""
        num_scheduled_tokens = step.num_scheduled_tokens
        total = sum(num_scheduled_tokens.values())
        assert total <= self.max_num_scheduled_tokens
        assert step.token_budget >= 0
        assert len(self.running) <= self.max_num_running_reqs
        assert len(step.new) + len(step.resumed) + len(step.running) <= len(self.running)
        output = SchedulerOutput(
            scheduled_new_reqs=step.new_request_data(),
            scheduled_cached_reqs=self._resumed_request_data(step) + self._running_request_data(step),
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=total,
            scheduled_spec_decode_tokens=step.spec_decode_tokens,
            scheduled_encoder_inputs={},
            num_common_prefix_blocks=self._common_prefix_blocks(step),
            finished_req_ids=self.finished_req_ids,
            free_encoder_input_ids=self.encoder_cache_manager.get_freed_ids(),
            structured_output_request_ids={},
            grammar_bitmask=self.structured_output_manager.grammar_bitmask(self.requests, {}, len(self.running)),
        )
        self.finished_req_ids = set()
        return output

    def _common_prefix_blocks(self, step: BatchedStep) -> int:
        """vLLM's ``get_num_common_prefix_blocks(running[0], len(running))``:
        from the batched call's read while nothing changed since, else read."""
        running = self.running
        if not running:
            return 0
        if step.prefix is not None and step.prefix.prefix_ref_counts is not None:
            return step.prefix.num_common_prefix_blocks(len(running))[0]
        return self.kv_cache_manager.get_num_common_prefix_blocks(running[0], len(running))

    def _resumed_request_data(self, step: BatchedStep) -> list[CachedRequestData]:
        out = []
        for request in step.resumed:
            rid = request.request_id
            n = step.num_scheduled_tokens[rid]
            out.append(self._make_cached_request_data(request, n, len(step.spec_decode_tokens.get(rid, ())),
                                                      step.block_ids[rid], resumed_from_preemption=True))
            request.num_computed_tokens += n
        return out

    def _running_request_data(self, step: BatchedStep) -> list[CachedRequestData]:
        """vLLM's ``_make_cached_request_data`` for each scheduled running
        request (its cached objects reused), and the advance of its
        ``num_computed_tokens``, in one loop."""
        spec = step.spec_decode_tokens
        cache = self._cached_reqs_data
        out = []
        for request, n, ids in zip(step.running, step.running_tokens, step.running_blocks, strict=True):
            rid = request.request_id
            computed = request.num_computed_tokens
            regular = n - len(spec[rid]) if spec and rid in spec else n
            new_token_ids = request.all_token_ids[computed: computed + regular]
            queue = cache.get(rid)
            if queue:
                data = queue.popleft()
                data.resumed_from_preemption = False
                data.new_token_ids = new_token_ids
                data.new_block_ids = ids
                data.num_computed_tokens = computed
            else:
                data = CachedRequestData.from_request(request, False, new_token_ids, ids)
            out.append(data)
            request.num_computed_tokens = computed + n
        return out
