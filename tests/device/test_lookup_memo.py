"""An admission after its lookup (``get_computed_blocks`` + ``allocate_slots``,
``read_prefix_hit`` + ``admit``) skips the capped re-check of the hit only
where the manager's last dry lookup proves it current (``LookupMemo``):
nothing changed since, the same host tokens and extra keys, a bound that
covers the hit. Counted in reads and launches; forged hits still refused."""

import numpy as np
import pytest
import torch

from gpukv.core.requests import ComputedBlocks, NewRequest, PrefixHit, RunningUpdate
from gpukv.device.admission import LookupMemo
from gpukv.device.manager import DeviceManager
from gpukv.errors import StaleComputedBlocksError
from gpukv.reference.manager import ReferenceManager
from workload import assert_same

KEY = bytes(range(16))
PROMPT = [1, 2, 3, 4, 5, 6, 7]  # block size 2: three full blocks cached, a hit of 3 blocks for a longer prompt


def primed():
    """A reference and a device manager with ``PROMPT``'s three full blocks cached and free."""
    ms = (ReferenceManager(16, 2, hash_key=KEY), DeviceManager(16, 2, hash_key=KEY, max_model_len=64))
    for m in ms:
        m.step(new=[NewRequest("p", PROMPT)])
        m.free("p")
    return ms


def counted_allocate(dev, req, computed):
    """``allocate_slots`` of a new request: its result, reads and launches."""
    out = dev.allocate_slots(req, computed=computed)
    return out, dev.counters.d2h, dev.counters.launches


def test_allocate_after_its_lookup_skips_the_recheck():
    ref, dev = primed()
    req = NewRequest("a", [*PROMPT[:6], 9, 9, 9])
    c_ref, c_dev = ref.get_computed_blocks(req), dev.get_computed_blocks(req)
    assert c_dev == c_ref == ComputedBlocks([[1, 2, 3]], 6)
    out, reads, launches = counted_allocate(dev, req, c_dev)
    assert out == ref.allocate_slots(req, computed=c_ref) == [[4, 5]]
    # One read of the step's status, one of the new blocks' ids: no re-check's two reads.
    assert reads == 2
    # The same admission with the memo dropped: the capped re-lookup runs (two reads, its launches).
    for m in (ref, dev):
        m.free("a")
    c_dev, c_ref = dev.get_computed_blocks(req), ref.get_computed_blocks(req)
    assert c_dev == c_ref == ComputedBlocks([[1, 2, 3, 4]], 8)
    dev._admission.memo = None
    assert dev.allocate_slots(req, computed=c_dev) == ref.allocate_slots(req, computed=c_ref) == [[5]]
    assert dev.counters.d2h == 4 and dev.counters.launches > launches
    assert_same(ref, dev)


def test_admit_after_read_prefix_hit_reads_nothing_where_the_bound_proves_the_fit():
    """The lookup read the hit's size and its unheld blocks: with the hit's
    three free blocks to touch and one new block (7 tokens, blocks of 2)
    under the host's bound of free blocks, the admission's outcome is
    certain: no read, and the bound drops by exactly the 4 blocks taken."""
    ref, dev = primed()
    req = NewRequest("a", [*PROMPT[:6], 9])
    hit = dev.read_prefix_hit(req)
    assert hit == ref.read_prefix_hit(req) == PrefixHit(6, 3)
    bound = dev.free_blocks_lower_bound()
    assert bound >= 4
    assert dev.admit(req, hit) is True and dev.counters.d2h == 0
    assert ref.admit(req, hit) is True
    assert dev.free_blocks_lower_bound() == bound - 4
    assert dev.read_num_free_blocks() == ref.num_free_blocks >= bound - 4
    assert dev.request_counts("a") == ref.request_counts("a")
    assert_same(ref, dev)
    dev.check_invariants()


@pytest.mark.parametrize("chunk, lookahead", [(None, 0), (1, 0), (None, 3), (1, 5)])
def test_an_admission_whose_fit_the_bound_does_not_prove_reads_its_outcome_once(chunk, lookahead):
    """The same admission with the host's bound one block short of what it
    takes (new blocks for the chunk and lookahead, and the touches): the
    step reads its status (the device decides), admits it all the same, and
    the read sets the bound to the exact free count."""
    ref, dev = primed()
    req = NewRequest("a", [*PROMPT[:6], 9, 9, 9, 9])
    hit = dev.read_prefix_hit(req)
    computed = 6 + (4 if chunk is None else chunk)
    taken = (-(-(computed + lookahead) // 2) - 3) + 3
    dev._shared.free_lower_bound = taken - 1  # (still a lower bound: the device decides)
    assert dev.admit(req, hit, num_tokens=chunk, num_lookahead_tokens=lookahead) is True
    assert dev.counters.d2h == 1
    assert ref.admit(req, hit, num_tokens=chunk, num_lookahead_tokens=lookahead) is True
    assert dev.free_blocks_lower_bound() == ref.num_free_blocks == 16 - 1 - taken
    assert_same(ref, dev)
    dev.check_invariants()
    # With the bound exactly covering, the same admission (after a free) reads nothing.
    for m in (ref, dev):
        m.free("a")
    hit = dev.read_prefix_hit(req)
    assert hit == ref.read_prefix_hit(req)
    dev._shared.free_lower_bound = taken
    assert dev.admit(req, hit, num_tokens=chunk, num_lookahead_tokens=lookahead) is True
    assert dev.counters.d2h == 0 and dev.free_blocks_lower_bound() == 0
    assert ref.admit(req, hit, num_tokens=chunk, num_lookahead_tokens=lookahead) is True
    assert_same(ref, dev)
    dev.check_invariants()


def test_an_admission_without_a_hit_reads_only_its_new_ids():
    """No hit (nothing to touch, nothing to check): ``allocate_slots`` reads
    only the new blocks' ids, ``admit`` nothing."""
    ref, dev = primed()
    got = [m.allocate_slots(NewRequest("a", [50, 51, 52]), computed=None) for m in (ref, dev)]
    assert got[1] == got[0] and len(got[0][0]) == 2
    assert dev.counters.d2h == 1 and dev.get_block_ids("a") == ref.get_block_ids("a")
    for m in (ref, dev):
        assert m.admit(NewRequest("b", [60, 61, 62]), PrefixHit(0, 0)) is True
    assert dev.counters.d2h == 0
    assert_same(ref, dev)
    dev.check_invariants()


def before_lookup(ms, kind):
    for m in ms:
        if kind in ("free", "step"):
            m.step(new=[NewRequest("x", [40, 41, 42])])


def between(ms, kind):
    """A change of the pool, the rows or the cache between a lookup and its admission, on each manager."""
    for m in ms:
        if kind == "admit":
            m.step(new=[NewRequest("x", [40, 41, 42])])
        elif kind == "free":
            m.free("x")
        else:
            m.step(running=[RunningUpdate("x", [43, 44])])


@pytest.mark.parametrize("kind", ["admit", "free", "step"])
def test_a_change_between_lookup_and_allocate_keeps_the_recheck(kind):
    ref, dev = primed()
    before_lookup((ref, dev), kind)
    req = NewRequest("a", [*PROMPT[:6], 9])
    c_dev, c_ref = dev.get_computed_blocks(req), ref.get_computed_blocks(req)
    between((ref, dev), kind)
    assert dev.allocate_slots(req, computed=c_dev) == ref.allocate_slots(req, computed=c_ref)
    assert dev.counters.d2h == 4  # the re-check's two reads, the step's, the new ids'
    assert_same(ref, dev)
    # Nothing changed after the next lookup: that admission skips it.
    req = NewRequest("b", [*PROMPT[:4], 8, 8, 8])
    c_dev, c_ref = dev.get_computed_blocks(req), ref.get_computed_blocks(req)
    assert dev.allocate_slots(req, computed=c_dev) == ref.allocate_slots(req, computed=c_ref)
    assert dev.counters.d2h == 2
    assert_same(ref, dev)


def test_a_change_that_evicts_the_hit_is_refused_after_the_lookup():
    ref, dev = primed()
    req = NewRequest("a", [*PROMPT[:6], 9])
    computed = [m.get_computed_blocks(req) for m in (ref, dev)]
    for m in (ref, dev):
        m.step(new=[NewRequest("x", list(range(100, 130)))])  # 15 blocks: evicts every cached one
    for m, c in zip((ref, dev), computed, strict=True):
        before = (m.free_queue(), m.request_ids())
        with pytest.raises(StaleComputedBlocksError, match="not what a lookup of this request finds now"):
            m.allocate_slots(req, computed=c)
        assert (m.free_queue(), m.request_ids()) == before
    assert_same(ref, dev)


def test_other_tokens_under_the_same_id_keep_the_recheck():
    ref, dev = primed()
    other = [1, 2, 3, 4, 0, 0, 0]  # its own third block cached too
    for m in (ref, dev):
        m.step(new=[NewRequest("q", other)])
        m.free("q")
    c_other = [m.get_computed_blocks(NewRequest("a", [*other[:6], 9])) for m in (ref, dev)]
    assert c_other[0] == c_other[1] == ComputedBlocks([[1, 2, 4]], 6)
    for m in (ref, dev):  # the last lookup: the same id and hit size, another third block
        assert m.get_computed_blocks(NewRequest("a", [*PROMPT[:6], 9])) == ComputedBlocks([[1, 2, 3]], 6)
    req = NewRequest("a", [*other[:6], 9])
    assert dev.allocate_slots(req, computed=c_other[1]) == ref.allocate_slots(req, computed=c_other[0])
    assert dev.counters.d2h == 4  # re-checked (it holds)
    assert_same(ref, dev)
    # Other tokens inside the hit: re-checked, refused, nothing changed.
    c_dev = dev.get_computed_blocks(NewRequest("b", [*PROMPT[:6], 9]))
    before = (dev.free_queue(), dev.request_ids())
    with pytest.raises(StaleComputedBlocksError):
        dev.allocate_slots(NewRequest("b", [*PROMPT[:4], 7, 7, 9]), computed=c_dev)
    assert (dev.free_queue(), dev.request_ids()) == before and not dev.failed


def test_another_salt_keeps_the_recheck_and_is_refused():
    _, dev = primed()
    c = dev.get_computed_blocks(NewRequest("a", [*PROMPT[:6], 9]))
    before = (dev.free_queue(), dev.request_ids())
    with pytest.raises(StaleComputedBlocksError):
        dev.allocate_slots(NewRequest("a", [*PROMPT[:6], 9], cache_salt="s"), computed=c)
    assert (dev.free_queue(), dev.request_ids()) == before and not dev.failed


@pytest.mark.parametrize(("forge", "reads"), [("ids", 0), ("in_place", 0), ("size", 2)])
def test_a_forged_hit_right_after_its_lookup_is_refused(forge, reads):
    _, dev = primed()
    req = NewRequest("a", [*PROMPT[:4], 0, 0, 9] if forge == "size" else [*PROMPT[:6], 9])
    c = dev.get_computed_blocks(req)
    assert c == (ComputedBlocks([[1, 2]], 4) if forge == "size" else ComputedBlocks([[1, 2, 3]], 6))
    if forge == "ids":
        c = ComputedBlocks([[1, 3, 2]], 6)
    elif forge == "in_place":  # the returned lists edited: the memo keeps its own copy
        c.block_ids[0][2] = 7
    else:  # longer than the remembered hit: not what it proves, re-checked
        c = ComputedBlocks([[1, 2, 3]], 6)
    before = (dev.free_queue(), dev.request_ids())
    with pytest.raises(StaleComputedBlocksError, match="not what a lookup of this request finds now"):
        dev.allocate_slots(req, computed=c)
    assert (dev.free_queue(), dev.request_ids()) == before and not dev.failed
    assert dev.counters.d2h == reads  # the ids refused from the remembered lookup, before any read


def test_a_sized_hit_larger_than_the_remembered_one_is_refused():
    _, dev = primed()
    req = NewRequest("a", [*PROMPT[:4], 0, 0, 0])
    assert dev.read_prefix_hit(req) == PrefixHit(4, 2)
    with pytest.raises(StaleComputedBlocksError):
        dev.admit(req, PrefixHit(6, 0))
    assert dev.request_ids() == [] and not dev.failed


def test_the_memo_covers_only_what_it_proves():
    tokens = np.array([1, 2, 3, 4, 5], dtype=np.int64)  # block size 2: at most 2 blocks hit
    memo = LookupMemo(7, NewRequest("a", tokens), 2, 2, 2)
    same = NewRequest("a", tokens.copy())
    assert memo.covers(same, 2, 7) is True
    assert memo.covers(same, 2, 8) is False  # something may have changed since
    assert memo.covers(same, 1, 7) is False  # a shorter hit: not this lookup's result
    assert memo.covers(NewRequest("b", tokens.copy()), 2, 7) is False
    assert memo.covers(NewRequest("a", np.array([1, 2, 3, 9, 5])), 2, 7) is False
    # Tokens past the hit's blocks are not looked at by a lookup capped there.
    assert memo.covers(NewRequest("a", np.array([1, 2, 3, 4, 9, 9, 9])), 2, 7) is True
    assert memo.covers(NewRequest("a", tokens.copy(), lora_id=3), 2, 7) is False
    assert memo.covers(NewRequest("a", tokens.copy(), cache_salt="s"), 2, 7) is False
    assert memo.covers(NewRequest("a", tokens.copy(), skip_prefix_cache=True), 2, 7) is False
    # Tokens left on the device: never compared on the host.
    assert memo.covers(NewRequest("a", torch.tensor([1, 2, 3, 4, 5])), 2, 7) is False
    assert LookupMemo(7, NewRequest("a", tokens), 1, 1, 2).covers(same, 2, 7) is False  # a bound below the cap
    assert LookupMemo(7, NewRequest("a", tokens), 2, 1, 2).covers(same, 1, 7) is True


def test_an_admission_compares_its_tokens_once(monkeypatch):
    """The memo that proved an admission's hit current (``_hit_current``)
    also gives its first touches: the hit's tokens are compared once an
    admission, through either entry point, and the answers are the
    reference's."""
    compared = []
    equal = np.array_equal
    monkeypatch.setattr(np, "array_equal", lambda a, b: compared.append(len(a)) or equal(a, b))
    ref, dev = primed()
    req = NewRequest("a", [*PROMPT[:6], 9])
    assert ref.admit(req, ref.read_prefix_hit(req)) is True  # (the reference compares tokens of its own)
    hit = dev.read_prefix_hit(req)
    compared.clear()
    assert dev.admit(req, hit) is True and compared == [6]
    assert dev.counters.d2h == 0  # (the touches known: no read)
    assert_same(ref, dev)
    for m in (ref, dev):
        m.free("a")
    c_ref = ref.get_computed_blocks(req)
    expected = ref.allocate_slots(req, computed=c_ref)
    c_dev = dev.get_computed_blocks(req)
    assert c_dev == c_ref
    compared.clear()
    assert dev.allocate_slots(req, computed=c_dev) == expected == [[4]]
    assert compared == [6]
    assert_same(ref, dev)


def test_a_lookup_of_the_cut_prompt_covers_the_whole_prompts_admission():
    # vLLM's adapter looks up the prompt cut one token after its last possible hit block, then admits it whole.
    ref, dev = primed()
    whole = [*PROMPT[:6], 9, 9, 9, 9]
    cut = NewRequest("a", whole[:9])
    c_dev, c_ref = dev.get_computed_blocks(cut), ref.get_computed_blocks(cut)
    assert c_dev == c_ref == ComputedBlocks([[1, 2, 3]], 6)
    req = NewRequest("a", whole)
    assert dev.allocate_slots(req, computed=c_dev) == ref.allocate_slots(req, computed=c_ref) == [[4, 5]]
    assert dev.counters.d2h == 2
    assert_same(ref, dev)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_tokens_on_the_device_keep_the_recheck():
    dev = DeviceManager(16, 2, hash_key=KEY, max_model_len=64, device="cuda")
    dev.step(new=[NewRequest("p", PROMPT)])
    dev.free("p")
    req = NewRequest("a", torch.tensor([*PROMPT[:6], 9], device="cuda"))
    c = dev.get_computed_blocks(req)
    assert c == ComputedBlocks([[1, 2, 3]], 6)
    assert dev._admission.memo is None  # nothing remembered: the host never reads these tokens
    assert dev.allocate_slots(req, computed=c) == [[4]]
    # The re-check's two reads (the hit with the tokens' verdict, its ids), the step's, the new ids'.
    assert dev.counters.d2h == 4



@pytest.mark.parametrize("taken", ["stats", "events"])
def test_stats_or_events_taken_between_keep_the_skip(taken):
    """Handing out the stats or the events changes no block, row or cache
    entry: the admission after them still skips its re-check."""
    ref = ReferenceManager(16, 2, hash_key=KEY, enable_kv_cache_events=True)
    dev = DeviceManager(16, 2, hash_key=KEY, max_model_len=64, enable_kv_cache_events=True)
    for m in (ref, dev):
        m.step(new=[NewRequest("p", PROMPT)])
        m.free("p")
    req = NewRequest("a", [*PROMPT[:6], 9, 9, 9])
    c_ref, c_dev = ref.get_computed_blocks(req), dev.get_computed_blocks(req)
    assert c_dev == c_ref == ComputedBlocks([[1, 2, 3]], 6)
    if taken == "stats":
        assert dev.make_prefix_cache_stats() == ref.make_prefix_cache_stats()
    else:
        events = [[b.events for b in m.take_events()] for m in (ref, dev)]
        assert events[0] == events[1] != []
    out, reads, _ = counted_allocate(dev, req, c_dev)
    assert out == ref.allocate_slots(req, computed=c_ref) == [[4, 5]]
    assert reads == 2  # the step's status and the new blocks' ids: no re-check's reads
    assert_same(ref, dev)
