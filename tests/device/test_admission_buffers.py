"""The admission's per-bucket device buffers: made in one zeroed allocation
per dtype (each buffer a 64-byte aligned view), and buckets sized by the
prompts alone: lookups of prompts that differ only in what an admission would
take share one, and an admission of a prompt length already seen reuses its
bucket whatever its hit and chunk."""

from __future__ import annotations

import torch

from gpukv.core.requests import NewRequest
from gpukv.device.admission_plan import AdmissionBuffers
from gpukv.device.manager import DeviceManager
from gpukv.reference.manager import ReferenceManager
from workload import assert_same

KEY = bytes(range(16))


def test_a_buckets_buffers_are_views_of_one_zeroed_allocation_per_dtype():
    bufs = AdmissionBuffers.create((8, 4, 32, 2, 2), 2, torch.device("cpu"))
    int32 = [bufs.plan, bufs.zeros, bufs.cache, bufs.head, bufs.next, bufs.same, bufs.resolved, bufs.hit,
             bufs.start, bufs.alloc, bufs.record, bufs.popped]
    int64 = [bufs.status, bufs.record_scratch, bufs.record_seq]
    for group, dtype in ((int32, torch.int32), (int64, torch.int64)):
        assert {t.untyped_storage().data_ptr() for t in group} == {group[0].untyped_storage().data_ptr()}
        assert all(t.dtype == dtype and t.is_contiguous() and t.data_ptr() % 64 == 0 for t in group)
        assert all(int(t.abs().sum()) == 0 for t in group)
    assert [tuple(t.shape) for t in int32] == [(8 + 9 * 8 + 32,), (8,), (8, 4, 2), (8, 4), (32,), (32,), (8, 4),
                                               (8,), (8,), (5, 32), (4, 32), (32,)]
    assert [tuple(t.shape) for t in int64] == [(bufs.status.numel(),), (4, 32), (32,)]
    # No two buffers overlap: writing each in turn leaves the others as they were.
    for i, t in enumerate(int32):
        t.fill_(i + 1)
    assert [int(t.view(-1)[0]) for t in int32] == list(range(1, len(int32) + 1))
    assert [int(t.view(-1)[-1]) for t in int32] == list(range(1, len(int32) + 1))


def test_lookups_share_a_bucket_sized_by_their_prompt_and_give_the_references_hits():
    ref, dev = ReferenceManager(64, 2, hash_key=KEY), DeviceManager(64, 2, hash_key=KEY, max_model_len=128)
    prompt = list(range(1, 30))
    for m in (ref, dev):
        m.step(new=[NewRequest("p", prompt)])
        m.free("p")
    lookups = [NewRequest("a", prompt[:20] + [99] * 9), NewRequest("b", prompt[:4] + [98] * 25),
               NewRequest("c", prompt)]
    primed = set(dev._admission.buffers)
    assert primed == {(8, 16, 32, 16, 16)}  # (the priming step's: 15 new blocks, 14 cached)
    hits = []
    for req in lookups:
        got = dev.get_computed_blocks(req)
        assert got == ref.get_computed_blocks(req)
        hits.append(got.num_tokens)
    assert hits == [20, 4, 28]
    # One bucket for the three lookups (29 tokens each: 32 token slots, 16 hit positions), no block dims.
    assert set(dev._admission.buffers) - primed == {(8, 16, 32, 1, 1)}
    computed = dev.get_computed_blocks(lookups[1])
    assert dev.allocate_slots(lookups[1], computed=computed) == ref.allocate_slots(
        lookups[1], computed=ref.get_computed_blocks(lookups[1]))
    # The admission (a hit of 2 blocks, 13 new blocks, 12 to cache) is sized by
    # its prompt of 29 tokens alone: the priming step's bucket, no new one.
    assert set(dev._admission.buffers) - primed == {(8, 16, 32, 1, 1)}
    assert_same(ref, dev)
