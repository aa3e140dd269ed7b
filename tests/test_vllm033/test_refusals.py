"""A request gpukv's adapter cannot serve never costs another request its
blocks: it is refused on arrival (or when a sampled token comes back),
finished as an error through vLLM's own route, and every other request
gets exactly the decisions vLLM's own scheduler makes without it."""

from __future__ import annotations

import pytest
import torch

from gpukv.errors import GpukvInputError

from .harness import (
    Engine,
    KVView,
    LoRARequest,
    Request,
    RequestStatus,
    SamplingParams,
    VllmAsyncScheduler,
    VllmScheduler,
    gpukv033,
    is_async,
    make_requests,
    make_scheduler,
    model_output,
    vllm_version,
)
from .streams import recorded_step

GPUKV = [pytest.param(gpukv033.ReferenceScheduler, id="ref"),
         pytest.param(gpukv033.ReferenceAsyncScheduler, id="ref-async"),
         pytest.param(gpukv033.UnbatchedReferenceScheduler, id="ref-unbatched")]
DEVICE = [pytest.param(gpukv033.DeviceAsyncScheduler, id="device-async")]  # (the interpreter: one class)


def _embeds_request() -> Request:
    return Request(request_id="E", prompt_token_ids=None, prompt_embeds=torch.zeros(6, 8),
                   sampling_params=SamplingParams(max_tokens=4), pooling_params=None, arrival_time=0.0)


def _token_request(prompt: list[int]) -> Request:
    (request,) = make_requests(1, prompt=lambda _: prompt, first_id=99, max_tokens=4)
    request.request_id = "E"
    return request


def _lora_request() -> Request:
    """A LoRA request whose adapter name vLLM's block-hash keys carry as a
    list: a key gpukv cannot compare, so cannot map to one LoRA id."""
    (request,) = make_requests(1, first_id=99, max_tokens=4,
                               lora_request=LoRARequest(lora_name=["sql"], lora_int_id=1, lora_path="/adapters/sql"))
    request.request_id = "E"
    return request


def _overlapping_images_request() -> Request:
    """Two images over one token range: a key gpukv cannot derive (vLLM's
    processor never makes such a request; another front end might)."""
    (request,) = make_requests(1, 12, first_id=99, max_tokens=4, mm_items=[("cat", 0, 6), ("dog", 4, 6)])
    request.request_id = "E"
    return request


BAD = {
    "prompt-embeds": (_embeds_request, "prompt embeddings"),
    "over-max-model-len": (lambda: _token_request(list(range(70))), "more than max_model_len=64"),
    "negative-token": (lambda: _token_request([1, 2, -1, 4]), "outside [0, 2**32)"),
    "token-2**32": (lambda: _token_request([1, 2**32, 3]), "is 4294967296, outside [0, 2**32)"),
    "empty-prompt": (lambda: _token_request([]), "has no tokens"),
    "lora-key-not-comparable": (_lora_request, "keys of its LoRA adapter cannot be compared"),
    "overlapping-images": (_overlapping_images_request, "a multimodal input gpukv cannot key"),
}


def _run(cls: type, bad: Request | None, steps: int = 6) -> tuple[list, list, Engine]:
    """Request b (15 tokens: its first decode fills its block, so the next
    step gives it a new one) and c run; ``bad`` arrives at step 1."""
    scheduler = make_scheduler(cls, num_blocks=12, max_model_len=64, max_num_batched_tokens=64)
    engine = Engine(scheduler)
    engine.add(make_requests(2, 15, max_tokens=20, ignore_eos=True, first_id=1))  # b = "1", c = "2"
    records = []
    for step in range(steps):
        if step == 1 and bad is not None:
            scheduler.add_request(bad)
        recorded_step(engine, records)
    engine.drain()
    return records, engine.results, engine


def _without(records: list, rid: str) -> list:
    for r in records:
        r.tokens.pop(rid, None)
        r.finish_reasons.pop(rid, None)
        r.finished = frozenset(r.finished - {rid})
        r.prefix_cache = None  # (vLLM counts a lookup of the refused request only where it ran)
    return records


@pytest.mark.parametrize(("cls", "kind"), [pytest.param(c.values[0], k, id=f"{c.id}-{k}") for c in GPUKV for k in BAD]
                         + [pytest.param(c.values[0], "prompt-embeds", id=f"{c.id}-prompt-embeds") for c in DEVICE])
def test_a_refused_request_is_finished_as_an_error_and_others_keep_vllms_decisions(cls, kind):
    make_bad, why = BAD[kind]
    try:
        bad = make_bad()
    except OverflowError:  # (vLLM 0.34 keeps token ids as int32: such a request never reaches a scheduler)
        pytest.skip(f"vLLM {vllm_version()}'s Request cannot hold it")
    vllm_cls = VllmAsyncScheduler if is_async(cls) else VllmScheduler
    expected, _, _ = _run(vllm_cls, None)
    got, results, engine = _run(cls, bad)
    outputs = [o for result in results for eco in result.values() for o in eco.outputs if o.request_id == "E"]
    assert len(outputs) == 1 and outputs[0].finish_reason.name == "ERROR", outputs
    assert outputs[0].new_token_ids == []
    assert outputs[0].error.code == "validation_error" and why in outputs[0].error.message
    assert "E" not in engine.scheduler.requests
    assert all("E" not in r.num_scheduled_tokens for r in got)  # never scheduled
    assert _without(got, "E") == _without(expected, "E")  # b gets its new block as under vLLM, step by step
    engine.scheduler.kv_cache_manager.check_invariants()


@pytest.mark.parametrize("cls", GPUKV + DEVICE)
def test_a_sampled_token_gpukv_cannot_hold_finishes_that_request_alone(cls):
    """The model answers request b with token -7: vLLM's update appends it,
    the request is finished as an error in that update, gpukv never sees the
    token, and request c goes on as under vLLM with b finished at that step."""
    scheduler = make_scheduler(cls, num_blocks=12, max_model_len=64, max_num_batched_tokens=64)
    engine = Engine(scheduler)
    engine.add(make_requests(2, 15, max_tokens=20, ignore_eos=True, first_id=1))
    engine.step()
    out = engine.step(sampled={"1": [-7]})
    engine.drain()
    errors = [o for result in engine.results for eco in result.values() for o in eco.outputs
              if o.request_id == "1" and o.finish_reason is not None]
    assert [o.finish_reason.name for o in errors] == ["ERROR"], errors
    assert "sampled token -7" in errors[0].error.message
    assert "1" not in scheduler.requests and "1" in out.num_scheduled_tokens
    scheduler.kv_cache_manager.check_invariants()
    assert scheduler.kv_cache_manager.request_ids() == ["2"]
    engine.run_until_idle()
    KVView(scheduler).assert_empty()


def test_a_refused_request_aborted_before_its_update_is_gone_without_an_error():
    scheduler = make_scheduler(gpukv033.ReferenceScheduler, num_blocks=12, max_model_len=64)
    scheduler.add_request(_embeds_request())
    scheduler.finish_requests(["E"], RequestStatus.FINISHED_ABORTED)
    assert "E" not in scheduler.requests and not scheduler.has_unfinished_requests()
    out = scheduler.schedule()
    results = scheduler.update_from_output(out, model_output(scheduler, out))
    assert all(o.request_id != "E" for eco in results.values() for o in eco.outputs)


def test_a_refused_step_leaves_the_adapters_record_as_gpukvs():
    """gpukv refusing the batched running step (here: a token gpukv cannot
    hold put into a running request behind the screening's back) changes
    nothing, and the adapter's record stays gpukv's: the next schedule() is
    served once the request is gone."""
    scheduler = make_scheduler(gpukv033.ReferenceScheduler, num_blocks=12, max_model_len=64)
    engine = Engine(scheduler)
    engine.add(make_requests(2, 15, max_tokens=20, ignore_eos=True, first_id=1))
    engine.step()
    scheduler.requests["1"]._output_token_ids[-1] = -3  # (past the screening: the adapter's last line of defence)
    scheduler.requests["1"]._all_token_ids[-1] = -3
    with pytest.raises(GpukvInputError, match="outside"):
        scheduler.schedule()
    scheduler.kv_cache_manager.check_invariants()  # the record equals gpukv's: nothing ran ahead
    scheduler.finish_requests(["1"], RequestStatus.FINISHED_ABORTED)
    scheduler.kv_cache_manager.check_invariants()
    assert scheduler.kv_cache_manager.request_ids() == ["2"]
