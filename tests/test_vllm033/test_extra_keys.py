"""What else than the tokens decides a hit under vLLM 0.33 and later: the
request's LoRA adapter, its cache salt and its multimodal inputs, as vLLM's
block hashes key them (``_gen_lora_extra_hash_keys``: the adapter's name and
path, not its int id; the salt in the first block's keys; each image a
block's tokens overlap, by its identifier and its offset from the block's
start). Request A (32 shared tokens, then its own 8) runs to the end, then
request B (the 32, then other 8) arrives: B hits A's two full blocks exactly
when vLLM's keys of the two agree. Every case runs on vLLM's own scheduler
too, so the hand-worked value is vLLM's."""

from __future__ import annotations

import pytest

from gpukv import MMItem

# (vLLM's names and gpukv's adapter through the harness, which skips this module where vLLM 0.33 is not importable)
from .harness import Engine, gpukv033, make_requests, make_scheduler, scheduler_params
from .streams import lora_adapter as lora

UnsupportedConfigError = gpukv033.UnsupportedConfigError
LoraIds = gpukv033.lora_ids.LoraIds
mm_items = gpukv033.mm_items.mm_items
SHARED = list(range(32))  # two full blocks of 16
BOTH = scheduler_params()
DEVICE = [pytest.param(gpukv033.DeviceScheduler, id="DeviceScheduler")]


ADAPTER = lora("sql", 1, "/adapters/sql")
LORA_AND_SALT = {
    # (A's LoRA, A's salt, B's LoRA, B's salt): B's hit in tokens
    "the-same-adapter": ((ADAPTER, None, ADAPTER, None), 32),
    "reloaded-a-new-int-id": ((ADAPTER, None, lora("sql", 2, "/adapters/sql"), None), 32),
    "the-int-id-re-pointed-at-another-path": ((ADAPTER, None, lora("sql", 1, "/adapters/sql-v2"), None), 0),
    "another-name-the-same-int-id-and-path": ((ADAPTER, None, lora("chat", 1, "/adapters/sql"), None), 0),
    "an-adapter-then-the-base-model": ((ADAPTER, None, None, None), 0),
    "the-base-model-then-an-adapter": ((None, None, ADAPTER, None), 0),
    "the-same-salt": ((None, "tenant-1", None, "tenant-1"), 32),
    "another-salt": ((None, "tenant-1", None, "tenant-2"), 0),
    "a-salt-then-none": ((None, "tenant-1", None, None), 0),
    "the-same-adapter-and-salt": ((ADAPTER, "tenant-1", lora("sql", 2, "/adapters/sql"), "tenant-1"), 32),
    "the-same-adapter-another-salt": ((ADAPTER, "tenant-1", ADAPTER, "tenant-2"), 0),
}
IMAGE = [9999] * 28  # (an image's placeholder tokens: the same whatever the image)
MM_SHARED = [0, 1, 2, 3] + IMAGE  # 32 tokens: placeholders at 4..31
IMAGES = {
    # (A's images, B's images) as (identifier, offset, length), on MM_SHARED: B's hit in tokens
    "the-same-image": (([("cat", 4, 20)], [("cat", 4, 20)]), 32),
    "another-image-the-same-placeholders": (([("cat", 4, 20)], [("dog", 4, 20)]), 0),
    "the-same-image-at-another-offset": (([("cat", 4, 20)], [("cat", 6, 20)]), 0),
    "another-image-in-the-second-block-only": (([("cat", 20, 8)], [("dog", 20, 8)]), 16),
    "an-image-then-none": (([("cat", 4, 20)], []), 0),
    "none-then-an-image-in-the-second-block": (([], [("cat", 20, 8)]), 16),
    # one identifier, two lengths (a reused uuid): the blocks both ranges overlap are keyed alike
    "the-same-image-longer": (([("cat", 4, 20)], [("cat", 4, 28)]), 32),
    "the-same-image-shorter-ending-in-the-first-block": (([("cat", 4, 20)], [("cat", 4, 8)]), 16),
}
#: Each case: (A's and B's extra ``make_requests`` arguments, the 32 tokens they share, B's hit in tokens).
CASES = {name: (dict(lora_request=a_lora, cache_salt=a_salt), dict(lora_request=b_lora, cache_salt=b_salt),
                SHARED, hit) for name, ((a_lora, a_salt, b_lora, b_salt), hit) in LORA_AND_SALT.items()}
CASES |= {name: (dict(mm_items=a), dict(mm_items=b), MM_SHARED, hit) for name, ((a, b), hit) in IMAGES.items()}


def _b_hit(cls: type, case: str) -> tuple[int, Engine]:
    a, b, shared, _ = CASES[case]
    scheduler = make_scheduler(cls, encoder_budget=64)  # (a multimodal model's encoder: images are scheduled)
    engine = Engine(scheduler)
    engine.add(make_requests(1, prompt=lambda _: shared + [100] * 8, first_id=0, max_tokens=1, ignore_eos=True, **a))
    engine.run_until_idle()
    engine.add(make_requests(1, prompt=lambda _: shared + [200] * 8, first_id=1, max_tokens=1, ignore_eos=True, **b))
    out = engine.step()
    (new,) = out.scheduled_new_reqs
    return new.num_computed_tokens, engine


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("cls", BOTH)
def test_a_hit_needs_vllms_lora_salt_and_image_keys_to_agree(cls, case):
    hit, engine = _b_hit(cls, case)
    assert hit == CASES[case][3]
    engine.run_until_idle()
    manager = engine.scheduler.kv_cache_manager
    if hasattr(manager, "check_invariants"):
        manager.check_invariants()


@pytest.mark.parametrize("case", ["reloaded-a-new-int-id", "the-int-id-re-pointed-at-another-path",
                                  "another-image-in-the-second-block-only", "the-same-image-longer"])
@pytest.mark.parametrize("cls", DEVICE)
def test_the_device_manager_keys_lora_adapters_and_images_as_vllm_does(cls, case):
    hit, _ = _b_hit(cls, case)
    assert hit == CASES[case][3]


def test_a_lookup_cuts_an_image_at_its_end_and_bad_images_are_refused():
    (request,) = make_requests(1, prompt=lambda _: MM_SHARED + [100] * 8, mm_items=[("dog", 20, 8), ("cat", 4, 16)])
    assert mm_items(request) == (MMItem(4, 16, "cat"), MMItem(20, 8, "dog"))  # (sorted by offset)
    assert mm_items(request, 24) == (MMItem(4, 16, "cat"), MMItem(20, 4, "dog"))
    assert mm_items(request, 20) == (MMItem(4, 16, "cat"),)
    (overlapping,) = make_requests(1, prompt=lambda _: MM_SHARED, mm_items=[("cat", 4, 20), ("dog", 20, 8)])
    with pytest.raises(UnsupportedConfigError, match="a multimodal input gpukv cannot key") as err:
        mm_items(overlapping)
    assert "overlap" in str(err.value)


def test_each_distinct_key_gets_its_own_int_in_the_order_first_seen():
    ids = LoraIds()
    requests = [make_requests(1, first_id=i, lora_request=r)[0] for i, r in enumerate(
        [ADAPTER, lora("sql", 7, "/adapters/sql"), lora("sql", 1, "/adapters/sql-v2"), None, ADAPTER,
         lora("chat", 1, "/adapters/sql")])]
    assert [ids.id_of(r) for r in requests] == [1, 1, 2, None, 1, 3]
    assert len(ids) == 3


def test_a_lora_request_without_a_known_rule_or_with_an_unhashable_key_is_refused_naming_it():
    (request,) = make_requests(1, lora_request=ADAPTER)
    with pytest.raises(UnsupportedConfigError, match="no rule gpukv knows") as err:
        LoraIds(None).id_of(request)
    assert err.value.argument == "request.lora_request"
    with pytest.raises(UnsupportedConfigError, match="cannot be compared"):
        LoraIds(lambda r: [("lora", ["a", "list"], "/p")]).id_of(request)  # noqa: ARG005
    base = make_requests(1)[0]
    assert LoraIds(None).id_of(base) is None  # (no adapter: no rule needed)
