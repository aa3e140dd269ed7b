"""``gpukv replay``, run as vLLM runs, against vLLM 0.8.5's own ``Scheduler``.

The replay with ``admission="one"`` (vLLM's waiting loop) and
``uncached_first=False`` (vLLM's free order) must schedule a Mooncake trace as
vLLM's scheduler does on its own manager: here both run slices of the
built-in workload under token budgets, a long-prefill threshold and pools
small enough to preempt, and every request's admission step, cached tokens,
prefill step, block ids when its prefill is done, preemptions and finish step
must be equal. ``admission="batch"`` (one ``step()`` applying the same loop
on the device) must match too, block ids included: where vLLM's loop
evicts what a later request of the step would hit, the step looks that one
up again after the evicting pops. vLLM is driven exactly as the replay drives its manager:
arrivals join the queue at their step, a request samples the trace's output
tokens once its prompt is computed, and finishes after its last one.
"""

from __future__ import annotations

from typing import Any

import pytest

from gpukv.tools.replay import Replay, ReplayOptions
from gpukv.tools.traces import Trace, builtin_trace_path, load_trace
from tests.test_vllm.harness import (  # it skips the module without vLLM
    BlockTables,
    Request,
    SamplingParams,
    VllmScheduler,
    make_scheduler,
    model_output,
)


def vllm_records(trace: Trace, opts: ReplayOptions) -> dict[str, dict[str, Any]]:
    """The replay's per-request fields, from vLLM's scheduler run on the trace."""
    scheduler = make_scheduler(VllmScheduler, max_num_seqs=opts.max_num_seqs,
                               max_num_batched_tokens=opts.max_num_batched_tokens,
                               long_prefill_token_threshold=opts.long_prefill_token_threshold,
                               enable_prefix_caching=True, num_blocks=opts.num_blocks, block_size=opts.block_size,
                               max_model_len=opts.max_model_len)
    specs = {r.request_id: r for r in trace.requests}
    arrivals: dict[int, list[Any]] = {}
    for spec in trace.requests:
        arrivals.setdefault(spec.arrival_step, []).append(spec)
    records: dict[str, dict[str, Any]] = {
        rid: {"admitted_step": None, "num_cached_tokens": None, "prefill_done_step": None, "block_ids": None,
              "preemptions": 0, "finished_step": None} for rid in specs}

    def sample(request: Request) -> int:
        k = len(request.output_token_ids)
        return int(specs[request.request_id].output_tokens(k, k + 1)[0])

    tables, step, pending = BlockTables(), 0, sorted(arrivals)
    while pending or scheduler.waiting or scheduler.running:
        if not scheduler.waiting and not scheduler.running:
            step = max(step, pending[0])  # the replay skips idle steps the same way
        while pending and pending[0] <= step:
            for spec in arrivals[pending.pop(0)]:
                scheduler.add_request(Request(
                    request_id=spec.request_id, prompt_token_ids=spec.prompt_tokens().tolist(),
                    multi_modal_inputs=None, multi_modal_hashes=None, multi_modal_placeholders=None,
                    sampling_params=SamplingParams(max_tokens=spec.output_length, ignore_eos=True),
                    eos_token_id=None, arrival_time=0))
        out = scheduler.schedule()
        tables.update(out)
        for new in out.scheduled_new_reqs:
            rec = records[new.req_id]
            if rec["admitted_step"] is None:
                rec["admitted_step"], rec["num_cached_tokens"] = step, new.num_computed_tokens
        for cached in out.scheduled_cached_reqs:
            records[cached.req_id]["preemptions"] += cached.resumed_from_preemption
        for rid in out.num_scheduled_tokens:
            request, rec = scheduler.requests[rid], records[rid]
            if rec["prefill_done_step"] is None and request.num_computed_tokens >= request.num_tokens:
                rec["prefill_done_step"], rec["block_ids"] = step, [list(tables.tables[rid])]
        result = scheduler.update_from_output(out, model_output(scheduler, out, sample))
        for output in result.outputs:
            if output.finish_reason is not None:
                records[output.request_id]["finished_step"] = step + 1  # the replay frees it next step
        step += 1
    return records


def replay_records(trace: Trace, opts: ReplayOptions) -> dict[str, dict[str, Any]]:
    report = Replay(trace, opts).run()
    keys = ("admitted_step", "num_cached_tokens", "prefill_done_step", "block_ids", "preemptions", "finished_step")
    return {rid: {k: r[k] for k in keys} for rid, r in report["requests"].items()}


CASES = [
    # (requests, arrival, budget, threshold, max_num_seqs, num_blocks)
    (10, "back-to-back", 8192, 0, 64, 20_000),
    (10, "back-to-back", 2048, 0, 4, 20_000),
    (10, "timestamp", 512, 0, 16, 20_000),
    (10, "back-to-back", 2048, 1000, 16, 20_000),
    # small pools that preempt (the largest of these requests needs 1,710 blocks alone)
    (11, "back-to-back", 8192, 0, 64, 2_000),
    (11, "back-to-back", 2048, 512, 16, 2_000),
]


@pytest.mark.parametrize("admission", ["one", "batch"])
@pytest.mark.parametrize(("num_requests", "arrival", "budget", "threshold", "max_num_seqs", "num_blocks"), CASES)
def test_replay_schedules_as_vllm(num_requests: int, arrival: str, budget: int, threshold: int, max_num_seqs: int,
                                  num_blocks: int, admission: str) -> None:
    trace = load_trace(builtin_trace_path(), max_requests=num_requests, arrival=arrival, step_ms=40.0)
    opts = ReplayOptions(block_size=16, num_blocks=num_blocks, max_num_seqs=max_num_seqs, admission=admission,
                         uncached_first=False, max_num_batched_tokens=budget, long_prefill_token_threshold=threshold,
                         hash_key=bytes(16), ceiling=False)
    want, got = vllm_records(trace, opts), replay_records(trace, opts)
    diff = {rid: {k: (want[rid][k], got[rid][k]) for k in want[rid] if want[rid][k] != got[rid][k]}
            for rid in want if want[rid] != got[rid]}
    assert not diff, f"per request, (vLLM, replay): {diff}"
    if num_blocks < 5000:
        assert sum(r["preemptions"] for r in want.values()) > 0  # the small pool does preempt
