"""A LoRA request's hits under vLLM 0.8.5, whose block hashes key an adapter
by its ``lora_int_id`` (``_gen_lora_extra_hash_keys`` there; 0.33 on key
its name and path: ``tests/test_vllm033/test_extra_keys.py``). Request A (32
shared tokens, then its own 8) runs to the end, then request B (the 32, then
other 8) arrives: B hits A's two full blocks exactly when the int ids agree,
on vLLM's own scheduler and on gpukv's."""

from __future__ import annotations

import pytest

from .harness import make_requests, make_scheduler, run_until_idle, scheduler_params

SHARED = list(range(32))  # two full blocks of 16
CASES = {
    # (A's adapter, B's adapter) as (name, int id, path), None for the base model: B's hit in tokens
    "the-same-adapter": (("sql", 1, "/a/sql"), ("sql", 1, "/a/sql"), 32),
    "a-new-int-id-same-name-and-path": (("sql", 1, "/a/sql"), ("sql", 2, "/a/sql"), 0),
    "the-same-int-id-at-another-path": (("sql", 1, "/a/sql"), ("sql", 1, "/a/sql-v2"), 32),
    "an-adapter-then-the-base-model": (("sql", 1, "/a/sql"), None, 0),
}


def _with_lora(request, adapter):
    from vllm.lora.request import LoRARequest

    if adapter is not None:
        name, int_id, path = adapter
        request.lora_request = LoRARequest(lora_name=name, lora_int_id=int_id, lora_path=path)
    return request


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("scheduler_cls", scheduler_params("vllm", "reference", "batched", "device"))
def test_a_hit_needs_the_lora_int_ids_to_agree(scheduler_cls, case):
    first, second, hit = CASES[case]
    scheduler = make_scheduler(scheduler_cls, enable_prefix_caching=True)
    (a,) = make_requests(1, prompt=lambda _: SHARED + [100] * 8, first_id=0, max_tokens=1, ignore_eos=True)
    scheduler.add_request(_with_lora(a, first))
    run_until_idle(scheduler)
    (b,) = make_requests(1, prompt=lambda _: SHARED + [200] * 8, first_id=1, max_tokens=1, ignore_eos=True)
    scheduler.add_request(_with_lora(b, second))
    out = scheduler.schedule()
    assert [(n.req_id, n.num_computed_tokens) for n in out.scheduled_new_reqs] == [("1", hit)]
