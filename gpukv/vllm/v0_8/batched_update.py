"""``update_from_output`` after a batched ``schedule()`` (``gpukv.vllm.Scheduler``).

vLLM 0.8.5's ``Scheduler.update_from_output`` for a step with no encoder
inputs and no structured output (the batched ``schedule()`` hands any step
with those to vLLM's own, and so its update too): per scheduled request its
sampled tokens appended and checked for a stop (a stopped request freed),
its rejected drafts taken back, new drafts, logprobs and prompt logprobs
handed on; the same ``EngineCoreOutputs``, objects and state changes as
vLLM's, in a tighter loop (one pass over the running requests, no call of
its own per request: this loop is timed by ``benchmarks/bench_self.py``).
``BatchedUpdate`` is a base of ``gpukv.vllm.Scheduler``: what it changes is
the scheduler's own state.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.request import Request, RequestStatus


class BatchedUpdate(VllmScheduler):
    """vLLM's scheduler, with ``update_from_output`` after a batched step (a
    base of ``gpukv.vllm.Scheduler``, not used alone)."""

    def _update_batched(self, scheduler_output: SchedulerOutput, model_runner_output: Any) -> EngineCoreOutputs:
        """vLLM's ``update_from_output`` after a batched step (module docstring)."""
        running, outputs, spec_stats = self._advance_running(scheduler_output, model_runner_output)
        # vLLM keeps each scheduled cached request's data for reuse, unless it finished.
        finished, cache = self.finished_req_ids, self._cached_reqs_data
        for data in scheduler_output.scheduled_cached_reqs:
            if data.req_id not in finished:
                cache[data.req_id].append(data)
        self.running = running
        result = EngineCoreOutputs(outputs=outputs, scheduler_stats=self.make_stats(spec_stats))
        if self.include_finished_set:
            result.finished_requests = scheduler_output.finished_req_ids | self.finished_req_ids
        return result

    def _advance_running(self, scheduler_output: SchedulerOutput,
                         model_runner_output: Any) -> tuple[list[Request], list[EngineCoreOutput], Any]:
        """vLLM's loop over the running requests: those still running after it, the
        outputs of those that produced tokens, the speculative-decoding stats."""
        sampled, drafts, index = (model_runner_output.sampled_token_ids, model_runner_output.spec_token_ids,
                                  model_runner_output.req_id_to_index)
        logprobs, prompt_logprobs = model_runner_output.logprobs, model_runner_output.prompt_logprobs_dict
        scheduled, spec_scheduled = scheduler_output.num_scheduled_tokens, scheduler_output.scheduled_spec_decode_tokens
        max_model_len, spec_stats = self.max_model_len, None
        new_running: list[Request] = []
        outputs: list[EngineCoreOutput] = []
        for request in self.running:
            rid = request.request_id
            if not scheduled.get(rid, 0):
                new_running.append(request)
                continue
            i = index[rid]
            tokens = sampled[i]
            if spec_scheduled:
                drafted = spec_scheduled.get(rid)
                if drafted:  # the rejected drafts' tokens were never computed
                    request.num_computed_tokens -= len(drafted) + 1 - len(tokens)
                    spec_stats = self.make_spec_decoding_stats(spec_stats, num_draft_tokens=len(drafted),
                                                               num_accepted_tokens=len(tokens) - 1)
            if drafts is not None:
                request.spec_token_ids = drafts[i]
            stopped, params = False, request.sampling_params
            if tokens:
                outs, all_ids = request._output_token_ids, request._all_token_ids  # (append_output_token_ids')
                for num_new, token in enumerate(tokens, 1):  # vLLM's check_stop (vllm/v1/core/sched/utils.py)
                    outs.append(token)
                    all_ids.append(token)
                    if len(all_ids) >= max_model_len or len(outs) >= request.max_tokens:
                        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
                    elif not params.ignore_eos and token == request.eos_token_id:
                        request.status = RequestStatus.FINISHED_STOPPED
                    elif params.stop_token_ids and token in params.stop_token_ids:
                        request.status = RequestStatus.FINISHED_STOPPED
                        request.stop_reason = token
                    else:
                        continue
                    self._free_request(request)
                    del tokens[num_new:]
                    stopped = True
                    break
            prompt_tensors = prompt_logprobs.get(rid) if prompt_logprobs else None
            if not tokens:
                assert not prompt_tensors  # vLLM's invariant: no partial prefill outputs
            else:
                events = request.events
                if events:  # (take_events')
                    request.events = []
                outputs.append(EngineCoreOutput(
                    request_id=rid, new_token_ids=tokens,
                    finish_reason=request.get_finished_reason() if stopped else None,
                    new_logprobs=logprobs.slice(i, i + 1) if logprobs and params.logprobs is not None else None,
                    new_prompt_logprobs_tensors=prompt_tensors, stop_reason=request.stop_reason, events=events or None))
            if not stopped:
                new_running.append(request)
        return new_running, outputs, spec_stats
