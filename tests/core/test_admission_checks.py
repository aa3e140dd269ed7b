"""An admission's host work that must not grow with the prompt in Python:
the checks of a hit handed back (``normalize_computed``,
``check_computed_for``) pass plain ids without a Python call per block and
name the first bad one as before; the device plan sends each prompt's ids
once, cast into place, and only them (``plan_admission``)."""

from __future__ import annotations

import numpy as np
import pytest

from gpukv.core import checks
from gpukv.core.blocks import ManagerLimits
from gpukv.core.requests import ComputedBlocks, NewRequest
from gpukv.device.admission_plan import HEADER, plan_admission
from gpukv.errors import CapacityError, InvalidInputError, InvalidTypeError
from gpukv.kernels.prefill import PLAN_ARRAYS

LIMITS = ManagerLimits(block_size=16, num_blocks=10_000, sliding_windows=(None,), max_model_len=200_000)


def counting_check_int(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls = [0]
    real = checks.check_int

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(checks, "check_int", counted)
    return calls


def test_a_long_hit_is_checked_without_a_call_per_block_and_bad_ids_are_still_named(monkeypatch):
    calls = counting_check_int(monkeypatch)
    ids = list(range(1, 4097))
    got = checks.normalize_computed(ComputedBlocks([ids], 4096 * 16), LIMITS)
    assert got == ComputedBlocks([list(range(1, 4097))], 4096 * 16) and calls[0] == 1  # (num_tokens only)
    # Anything but plain ids in range takes the id-by-id path: numpy ints become ints, the rest is named.
    mixed = checks.normalize_computed(ComputedBlocks([[3, np.int64(4), 5]], 48), LIMITS)
    assert mixed.block_ids == [[3, 4, 5]] and type(mixed.block_ids[0][1]) is int
    with pytest.raises(InvalidTypeError, match="must be an int") as e:
        checks.normalize_computed(ComputedBlocks([[3, True, 5]], 48), LIMITS)
    assert e.value.argument == "computed.block_ids[0][1]"
    with pytest.raises(CapacityError) as e:
        checks.normalize_computed(ComputedBlocks([[3, 4, 10_000]], 48), LIMITS)
    assert e.value.argument == "computed.block_ids[0][2]"
    with pytest.raises(InvalidInputError) as e:
        checks.normalize_computed(ComputedBlocks([[-1, 4, 5]], 48), LIMITS)
    assert e.value.argument == "computed.block_ids[0][0]"


@pytest.mark.parametrize(("full", "window", "bad"), [
    ([1, 2, 3, 4], [0, 0, 7, 8], None),
    ([1, 2, 0, 4], [0, 0, 7, 8], "computed.block_ids[0][2] is the null block"),
    ([1, 2, 3, 4], [0, 2, 7, 8], "computed.block_ids[1][1] is block 2"),
    ([1, 2, 3, 4], [0, 0, 0, 8], "computed.block_ids[1][2] is the null block"),
])
def test_a_hits_null_blocks_are_exactly_where_its_window_puts_them(full, window, bad):
    """Group 0 full attention (no null block), group 1 a window of 32 tokens:
    a hit of 4 blocks of 16 has the null block at positions 0 and 1 there,
    checked group by group in C-level passes; the first misplaced one named."""
    limits = ManagerLimits(block_size=16, num_blocks=100, sliding_windows=(None, 32))
    request = checks.normalize_new_request(NewRequest("a", list(range(80))), "request", 16)[0]
    computed = ComputedBlocks([full, window], 64)
    if bad is None:
        checks.check_computed_for(request, computed, limits)
        return
    with pytest.raises(InvalidInputError) as e:
        checks.check_computed_for(request, computed, limits)
    assert bad in str(e.value) and e.value.argument == "computed"


def test_the_plan_sends_each_prompts_ids_once_and_only_them():
    big = 2**32 - 1  # (stored as the int32 bit pattern -1)
    new = [checks.normalize_new_request(NewRequest(rid, tokens), "new", 4)[0]
           for rid, tokens in (("a", [5, big, 7, 2**31]), ("b", [1, 2, 3, 4, 5]))]
    arrays: dict = {}

    def host_array(bucket, size):
        return arrays.setdefault(bucket, np.zeros(size, dtype=np.int32))

    plan = plan_admission(new, [3, 9], 4, host_array=host_array)
    assert plan.packed.base is arrays[plan.bucket]
    KP, P, TP, A, C = plan.bucket
    assert plan.bucket == (8, 1, 16, 2, 1)
    base = HEADER + len(PLAN_ARRAYS) * KP
    assert len(plan.packed) == base + 9  # the prompts' 9 ids, not the bucket's 16
    assert plan.packed[base:].tolist() == [5, -1, 7, -(2**31), 1, 2, 3, 4, 5]
    cols = plan.packed[HEADER: base].reshape(len(PLAN_ARRAYS), KP)
    assert cols[:, :2].T.tolist() == [[3, 4, 1, 1, 0, 4, 0, 0, 0], [9, 5, 1, 2, 1, 5, 0, 0, 4]]
    assert cols[:, 2:].tolist() == [[0] * 6] * len(PLAN_ARRAYS)
    assert plan.packed[:2].tolist() == [2, -1] and plan.max_new_blocks == 1 + 2
    # The bucket's host array is reused: the next plan of that bucket writes over it.
    again = plan_admission(new[::-1], [9, 3], 4, host_array=host_array)
    assert again.packed.base is plan.packed.base and again.packed[base:].tolist() == [1, 2, 3, 4, 5, 5, -1, 7,
                                                                                      -(2**31)]
    # Where no host array is given, the plan is a new array, the same plan.
    alone = plan_admission(new[::-1], [9, 3], 4)
    assert alone.packed.base is not again.packed.base and alone.packed.tolist() == again.packed.tolist()


def test_the_bucket_follows_the_prompt_not_the_hit_cap_or_the_chunk():
    """Sizes by the prompt alone (hit positions, new and cached entries), or
    by ``max_chunk`` where the prompt is longer; never below the step's need."""
    bs = 16

    def bucket(n, chunk=None, cap=None, lookahead=0, max_chunk=None, budget=None):
        req = checks.normalize_new_request(NewRequest("r", list(range(n)), num_tokens_to_compute=chunk,
                                                      num_lookahead_tokens=lookahead), "new", bs)[0]
        return plan_admission([req], [0], bs, None if cap is None else [cap], token_budget=budget,
                              max_chunk=max_chunk).bucket

    # 300 tokens: 18 hit positions (32), 19 new blocks (32), 18 to cache (32), 512 token slots.
    assert {bucket(300), bucket(300, chunk=20, cap=12), bucket(300, cap=0), bucket(300, chunk=100, budget=40)} == {
        (8, 32, 512, 32, 32)}
    assert bucket(300, lookahead=300) == (8, 32, 512, 64, 32)
    # A prompt longer than the engine's step: its new and cached entries sized by the step.
    assert bucket(5000, chunk=100, max_chunk=1024) == (8, 512, 8192, 64, 64)
    assert bucket(5000, chunk=100) == (8, 512, 8192, 512, 512)
    assert bucket(5000, max_chunk=1024) == (8, 512, 8192, 512, 512)  # (a chunk past it: sized by its need)
    assert bucket(300, max_chunk=1024) == bucket(300)


def test_allocate_args_change_only_the_chunk_and_the_lookahead():
    """``allocate_slots``' counts make a copy of the request that differs
    in those two fields alone: every other field (whatever fields the request
    type grows) is carried over as it was."""
    import dataclasses

    from gpukv.core.hashing import MMItem

    fields = dataclasses.fields(NewRequest)
    request = NewRequest("r", np.arange(40, dtype=np.int64), lora_id=3, cache_salt="s", skip_prefix_cache=False,
                         mm_items=(MMItem(0, 4, "img"),), block_hashes=[b"h"], num_preemptions=2)
    copied = checks.apply_allocate_args(request, 16, 10, 5, LIMITS)
    assert (copied.num_tokens_to_compute, copied.num_lookahead_tokens) == (10, 5)
    kept = [f.name for f in fields if f.name not in ("num_tokens_to_compute", "num_lookahead_tokens")]
    assert all(getattr(copied, name) is getattr(request, name) for name in kept), kept
