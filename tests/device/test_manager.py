"""The device manager against the reference: the same random workloads, the
same results after every step (returned ids and hits, block tables, reference
counts, free-queue order, table contents, stats)."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpukv.core.requests import NewRequest, RunningUpdate
from gpukv.device.manager import DeviceManager
from gpukv.errors import InvalidInputError, InvalidTypeError, StaleComputedBlocksError, UnknownRequestError
from gpukv.reference.manager import ReferenceManager
from workload import assert_same, check, drive

KEY = bytes(range(16))


def pair(num_blocks, block_size, groups=1, uncached_first=True, max_model_len=256, windows=None):
    windows = windows or [None] * groups
    ref = ReferenceManager(num_blocks, block_size, sliding_windows=windows, uncached_first=uncached_first, hash_key=KEY)
    dev = DeviceManager(num_blocks, block_size, sliding_windows=windows, uncached_first=uncached_first, hash_key=KEY,
                        max_model_len=max_model_len)
    return ref, dev



@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**32 - 1), num_blocks=st.integers(6, 24), block_size=st.sampled_from([1, 2, 4]),
       uncached_first=st.booleans(), windows=st.sampled_from([[None], [None], [None, None], [None, 3], [None, 6]]))
def test_random_workloads_match_the_reference_step_by_step(seed, num_blocks, block_size, uncached_first, windows):
    ref, dev = pair(num_blocks * len(windows), block_size, uncached_first=uncached_first, windows=windows)
    drive([ref, dev], seed, 8, check, max_new=3)
    assert dev.make_prefix_cache_stats() == ref.make_prefix_cache_stats()
    assert dev.read_num_evictions() == ref.num_evictions


def test_hand_worked_batch_with_pending_hits_and_eviction():
    ref, dev = pair(10, 2)
    one = ReferenceManager(10, 2, hash_key=KEY)
    new = [NewRequest("a", list(range(300, 312))), NewRequest("b", [7, 8, 9]), NewRequest("c", list(range(300, 305)))]
    for m in (ref, dev, one):
        m.step(new=[NewRequest("p", [7, 8, 9]), NewRequest("r", [50, 51, 52, 53, 54, 55, 56])])
        m.step(finished=["p", "r"])
        # Freed tail first: the partial blocks 2 (p) and 6 (r) to the front,
        # the cached ones (1; 5, 4, 3) to the back.
        assert m.free_queue() == [6, 2, 7, 8, 9, 1, 5, 4, 3]
    for m in (ref, dev):
        res = m.step(new=new)
        # vLLM's order: a's six new blocks are popped before b is looked up,
        # and they evict p's cached block 1, so b hits nothing (the step
        # defers b and looks it up again after a's pops) and its two blocks
        # evict 5 and 4; c hits the two blocks a computed (and cached) in this
        # same step, and its new block evicts 3.
        assert (res.num_admitted, res.num_computed_tokens, res.num_new_tokens) == (3, [0, 0, 4], [12, 3, 1])
        assert m.get_block_ids("a") == [[6, 2, 7, 8, 9, 1]]
        assert m.get_block_ids("b") == [[5, 4]]
        assert m.get_block_ids("c") == [[6, 2, 3]]
        assert m.free_queue() == [] and m.read_num_evictions() == 4
    # The same, one request at a time (vLLM's get_computed_blocks + allocate_slots).
    for r in new:
        one.allocate_slots(r, computed=one.get_computed_blocks(r))
    assert [one.get_block_ids(r.request_id) for r in new] == [[[6, 2, 7, 8, 9, 1]], [[5, 4]], [[6, 2, 3]]]
    assert_same(ref, dev)
    assert dev.make_prefix_cache_stats() == ref.make_prefix_cache_stats() == one.make_prefix_cache_stats()


def test_a_deferred_request_is_refused_after_its_second_lookup():
    """b's cached hit is evicted by a's pops: it is looked up again, and then
    does not fit; its hit (the second lookup's) is reported, counted once."""
    ref, dev = pair(8, 2)
    for m in (ref, dev):
        m.step(new=[NewRequest("p", [7, 8, 9, 10, 11])])  # blocks 1, 2 cached, 3 partial
        m.step(finished=["p"])
        assert m.free_queue() == [3, 4, 5, 6, 7, 2, 1]
        res = m.step(new=[NewRequest("a", list(range(300, 312))), NewRequest("b", [7, 8, 9, 10, 11, 12])])
        # a pops 3, 4, 5, 6, 7, 2 (evicting p's block 2); b then hits block 1
        # only and needs 3 - 1 new blocks plus the touch of 1: 3 > 1 free.
        assert (res.num_admitted, res.refused_hit_tokens) == (1, 2)
        assert m.get_block_ids("a") == [[3, 4, 5, 6, 7, 2]] and m.free_queue() == [1]
    assert_same(ref, dev)
    stats = ref.make_prefix_cache_stats()
    assert dev.make_prefix_cache_stats() == stats and (stats.requests, stats.hit_blocks) == (3, 1)  # p, a and b once


def test_running_update_that_does_not_fit_changes_nothing_on_the_device():
    ref, dev = pair(4, 2)
    results = []
    for m in (ref, dev):
        m.step(new=[NewRequest("a", [1, 2]), NewRequest("b", [3, 4, 5])])
        results.append(m.step(running=[RunningUpdate("a", [6]), RunningUpdate("b", [7, 8])],
                              new=[NewRequest("c", [1])]))
    assert results[0] == results[1] and results[1].running_failed_at == 0
    assert_same(ref, dev)
    assert dev.make_prefix_cache_stats() == ref.make_prefix_cache_stats()


def test_get_computed_blocks_and_allocate_slots_match():
    ref, dev = pair(12, 2)
    for m in (ref, dev):
        m.step(new=[NewRequest("a", [1, 2, 3, 4, 5])])
        m.step(finished=["a"])
    req = NewRequest("b", [1, 2, 3, 4, 9, 9, 9])
    c_ref, c_dev = ref.get_computed_blocks(req), dev.get_computed_blocks(req)
    assert c_dev == c_ref
    assert dev.allocate_slots(req, computed=c_dev) == ref.allocate_slots(req, computed=c_ref)
    assert dev.allocate_slots("b", [10]) == ref.allocate_slots("b", [10]) == [[]]
    assert dev.allocate_slots("b", [11]) == ref.allocate_slots("b", [11]) == [[5]]
    assert_same(ref, dev)
    assert dev.make_prefix_cache_stats() == ref.make_prefix_cache_stats()


def test_reset_prefix_cache_matches():
    ref, dev = pair(8, 2)
    for m in (ref, dev):
        m.step(new=[NewRequest("a", [1, 2, 3])])
        assert m.reset_prefix_cache() is False
        m.free("a")
        assert m.reset_prefix_cache() is True
        assert m.step(new=[NewRequest("b", [1, 2, 3])]).num_computed_tokens == [0]
    assert_same(ref, dev)
    assert dev.make_prefix_cache_stats() == ref.make_prefix_cache_stats()


def test_decode_only_step_reads_nothing_from_the_device():
    _, dev = pair(32, 4)
    dev.step(new=[NewRequest("a", list(range(10))), NewRequest("b", list(range(5)))])
    assert dev.counters.syncs == 1  # the step with new requests reads its status once
    # a grows from 10 to 13 tokens: a fourth block, popped without asking the device.
    res = dev.step(running=[RunningUpdate("a", [1, 2, 3]), RunningUpdate("b", [2])])
    assert res.ok
    assert dev.counters.syncs == 0
    assert dev.counters.launches > 0
    dev.check_invariants()


@pytest.mark.parametrize("call, exc", [
    (lambda m: m.step(finished=["nope"]), KeyError),
    (lambda m: m.step(finished=["a", "a"]), ValueError),
    (lambda m: m.step(running=[RunningUpdate("a", [-1])]), ValueError),
    (lambda m: m.step(new=[NewRequest("a", [1])]), ValueError),
    (lambda m: m.step(new=[NewRequest("x", list(range(300)))]), ValueError),  # > max_model_len
])
def test_bad_input_changes_nothing_on_the_device(call, exc):
    ref, dev = pair(8, 2)
    for m in (ref, dev):
        m.step(new=[NewRequest("a", [1, 2, 3])])
    before = (dev.free_queue(), dev.pool.ref_counts(), dev.get_block_ids("a"))
    with pytest.raises(exc):
        call(dev)
    assert (dev.free_queue(), dev.pool.ref_counts(), dev.get_block_ids("a")) == before
    dev.check_invariants()


def test_sliding_window_hand_worked_case_matches():
    # tests/reference/test_reference.py::test_sliding_window_hits_and_skipped_blocks, on both.
    ref, dev = pair(20, 2, windows=[None, 4])
    tokens = list(range(1, 10))
    for m in (ref, dev):
        m.step(new=[NewRequest("a", tokens)])
        assert m.step(running=[RunningUpdate("a", [10])]).ok
        assert m.get_block_ids("a") == [[1, 2, 3, 4, 5], [0, 0, 0, 9, 10]]
        assert m.step(new=[NewRequest("b", tokens)]).num_computed_tokens == [8]
        assert m.get_block_ids("b") == [[1, 2, 3, 4, 11], [0, 0, 8, 9, 12]]
    assert_same(ref, dev)


def test_bad_window_is_refused():
    with pytest.raises(ValueError, match="sliding window must be >= 1"):
        DeviceManager(10, 2, sliding_windows=[None, 0])


@pytest.mark.parametrize("seed, windows, block_size", [(1, [None, 3], 1), (2, [None, 5], 2), (3, [5, None, 9], 2)])
def test_hybrid_sliding_window_workloads_match(seed, windows, block_size):
    ref, dev = pair(48 * len(windows), block_size, windows=windows)
    nulls = []

    def check_and_count(step, managers, results):
        check(step, managers, results)
        nulls.extend(rid for rid in ref.request_ids() if any(0 in g for g in ref.get_block_ids(rid)))

    drive([ref, dev], seed, 10, check_and_count, max_new=3)
    stats = dev.make_prefix_cache_stats()
    assert stats == ref.make_prefix_cache_stats()
    # The workload exercised what it is for: window hits and blocks released behind windows.
    assert stats.hits > 0 and nulls


def test_running_tokens_may_come_as_tensors():
    import torch

    ref, dev = pair(20, 2)
    for m in (ref, dev):
        m.step(new=[NewRequest("a", [1, 2, 3])])
        assert m.step(running=[RunningUpdate("a", torch.tensor([4, 5, 6], dtype=torch.int32))]).ok
    assert_same(ref, dev)
    with pytest.raises(TypeError, match="1-D int32 or int64"):
        dev.step(running=[RunningUpdate("a", torch.tensor([1.5]))])


def test_allocate_slots_with_stale_or_shorter_computed_blocks():
    from gpukv.reference.manager import ComputedBlocks

    ref, dev = pair(8, 2)
    for m in (ref, dev):
        m.step(new=[NewRequest("a", [1, 2, 3, 4, 5])])
        m.free("a")  # blocks 1, 2 cached, free
    req = NewRequest("b", [1, 2, 3, 4, 5, 6])
    computed = [m.get_computed_blocks(req) for m in (ref, dev)]
    assert computed[0] == computed[1] == ComputedBlocks([[1, 2]], 4)
    # A shorter prefix of a valid hit may be taken.
    short = ComputedBlocks([[1]], 2)
    assert ref.allocate_slots(req, computed=short) == dev.allocate_slots(req, computed=short) == [[3, 4]]
    assert_same(ref, dev)
    for m in (ref, dev):
        m.free("b")
        m.step(new=[NewRequest("x", list(range(100, 114)))])  # 7 blocks: evicts the cached ones
    for m in (ref, dev):
        before = (m.free_queue(), m.request_ids())
        with pytest.raises(StaleComputedBlocksError, match="not what a lookup of this request finds now"):
            m.allocate_slots(NewRequest("c", [1, 2, 3, 4, 5]), computed=ComputedBlocks([[1, 2]], 4))
        assert (m.free_queue(), m.request_ids()) == before
    assert_same(ref, dev)


def test_get_computed_blocks_gives_null_where_a_window_does_not_reach():
    ref, dev = pair(20, 2, windows=[None, 4])
    tokens = list(range(1, 10))
    for m in (ref, dev):
        m.step(new=[NewRequest("a", tokens)])
        m.free("a")
    req = NewRequest("b", tokens)
    assert dev.get_computed_blocks(req) == ref.get_computed_blocks(req)
    assert ref.get_computed_blocks(req).block_ids[1][:2] == [0, 0]


def test_free_count_bound_is_exact_after_a_read():
    _, dev = pair(32, 4)
    dev.step(new=[NewRequest("a", list(range(10)))])  # 3 blocks: 28 of 31 free, read with the step's status
    # 114 more tokens need exactly the 28 free blocks: the host's bound (exact
    # after that read) covers them, so the step reads nothing
    res = dev.step(running=[RunningUpdate("a", list(range(10, 124)))])
    assert res.ok and dev.counters.d2h == 0
    assert dev.read_num_free_blocks() == 0 and len(dev.get_block_ids("a")[0]) == 31


def test_pending_hit_from_the_first_request_that_computes_the_block():
    # Found in review: e0 hits position 6 of the window group with the null
    # block (its run is further right), so the block i needs there is the one
    # e1 computes; "the earliest request with the digest" (e0) would lose it.
    ref, dev = pair(64, 2, windows=[None, 3])
    t = list(range(100, 116))
    fillers = [NewRequest(f"X{k}", [1000 + k]) for k in range(5)]
    for m in (ref, dev):
        m.step(new=fillers)
        m.step(new=[NewRequest("A", t)])
        m.step(running=[RunningUpdate("A", [])])  # releases what A's window left behind
    n_uncached = ref.num_free_blocks - 7
    results = []
    for m in (ref, dev):
        m.step(new=[NewRequest("D", list(range(500, 500 + n_uncached + 1)))])  # evicts the window block at 6
        m.step(finished=[x.request_id for x in fillers])
        results.append(m.step(new=[NewRequest("e0", t + [7]), NewRequest("e1", t[:14]), NewRequest("i", t[:14] + [9])]))
    assert results[0] == results[1]
    assert results[0].num_computed_tokens == [16, 12, 14]
    assert_same(ref, dev)


def test_a_forged_digest_is_a_miss_on_both():
    ref, dev = pair(10, 2)
    for m in (ref, dev):
        m.step(new=[NewRequest("a", [1, 2, 3])])
    digests = ref.block_hashes("a")
    assert dev.block_hashes("a") == digests
    results = [m.step(new=[NewRequest("b", [7, 8, 9], block_hashes=digests)]) for m in (ref, dev)]
    assert results[0] == results[1] and results[0].num_computed_tokens == [0]
    assert dev.free_queue() == ref.free_queue() and dev.pool.table_entries() == ref.pool.table()
    dev.check_invariants(verify_digests=False)


def test_entry_layout_orders_by_request_group_position():
    from gpukv.device.manager import entry_layout

    req, grp, pos, call = entry_layout([[0, 2], [1, 1]], [[2, 3], [3, 1]])
    # request 0: group 0 positions 0, 1; group 1 position 2; request 1: group 0 positions 1, 2.
    assert req.tolist() == [0, 0, 0, 1, 1]
    assert grp.tolist() == [0, 0, 1, 0, 0]
    assert pos.tolist() == [0, 1, 2, 1, 2]
    assert call.tolist() == [0, 0, 1, 2, 2]
    _, _, pos, _ = entry_layout([0, 5], [3, 4], reverse=True)  # the second is empty
    assert pos.tolist() == [2, 1, 0]


# Chosen so that steps defer (look a request up again after the earlier
# ones' pops): 3, 3, 2 and 1 times.
@pytest.mark.parametrize(("seed", "num_blocks", "uncached_first", "budget"),
                         [(38, 20, True, None), (29, 20, False, None), (24, 10, True, None), (37, 10, False, 12)])
def test_a_batched_device_step_equals_vllms_waiting_loop_one_request_at_a_time(seed, num_blocks, uncached_first,
                                                                               budget):
    """Small pools and shared prefixes, so earlier requests' pops evict later
    ones' hits (the device's deferral rounds) in most steps."""
    import random

    from workload import random_steps, waiting_loop_one_at_a_time

    rng = random.Random(seed)
    dev = DeviceManager(num_blocks, 2, hash_key=KEY, uncached_first=uncached_first, max_model_len=256)
    one = ReferenceManager(num_blocks, 2, hash_key=KEY, uncached_first=uncached_first)
    for _, _, new, _ in random_steps(seed, 8, extras=False, max_new=4):
        new = [r for r in new if -(-len(r.token_ids) // 2) <= num_blocks - 1]
        res = dev.step(new=new, token_budget=budget)
        assert res.num_computed_tokens == waiting_loop_one_at_a_time(one, new, budget)
        for req in new[: res.num_admitted]:
            assert dev.get_block_ids(req.request_id) == one.get_block_ids(req.request_id)
        assert dev.free_queue() == one.free_queue()
        assert dev.make_prefix_cache_stats() == one.make_prefix_cache_stats()
        dev.check_invariants()
        for rid in dev.request_ids():
            if rng.random() < 0.6:
                dev.free(rid)
                one.free(rid)


def test_read_block_ids_reads_many_requests_spans_in_one_read():
    ref, dev = pair(40, 2)
    for m in (ref, dev):
        m.step(new=[NewRequest("a", list(range(9))), NewRequest("b", [1, 2, 3]), NewRequest("c", list(range(50, 57)))])
    assert [dev.num_blocks_held(r) for r in "abc"] == [ref.num_blocks_held(r) for r in "abc"] == [5, 2, 4]
    spans = [("c", 1, 3), ("a", 0, 5), ("b", 2, 2), ("a", 4, 5)]
    want = [ref.get_block_ids("c")[0][1:3], ref.get_block_ids("a")[0], [], ref.get_block_ids("a")[0][4:5]]
    before = dev.counters.d2h
    assert dev.read_block_ids(spans) == ref.read_block_ids(spans) == want
    assert dev.counters.d2h == before + 1
    assert dev.read_block_ids([("b", 0, 0)]) == [[]] and dev.counters.d2h == before + 1  # nothing to read
    for m in (ref, dev):
        for bad, text in [([("a", 0, 6)], "not inside"), ([("a", 3, 2)], "not inside"), ([("z", 0, 1)], "'z'"),
                          ([("a", 0)], "tuple"), ("a", "tuple"), ([("a", -1, 2)], ">= 0")]:
            with pytest.raises((InvalidInputError, InvalidTypeError, UnknownRequestError)) as info:
                m.read_block_ids(bad)
            assert text in str(info.value), (bad, str(info.value))
        with pytest.raises(InvalidInputError, match="group 1 does not exist"):
            m.read_block_ids(spans, group=1)


def test_a_model_runners_accessors_are_the_managers_own_rows():
    """``block_table``, ``request_rows`` and ``blocks_held_per_row`` (what
    gpukv's vLLM worker reads between calls): the tensor and counts
    themselves, and a live, read-only view of the rows."""
    dev = DeviceManager(16, 2, hash_key=KEY, max_model_len=8, max_num_reqs=4)
    rows = dev.step(new=[NewRequest("a", [1, 2, 3]), NewRequest("b", [4])]).rows
    view = dev.request_rows
    assert rows == [0, 1] and dict(view) == {"a": 0, "b": 1}
    assert dev.blocks_held_per_row.tolist() == [2, 1, 0, 0]
    assert dev.block_table.shape == (1, 4, 4)
    assert dev.block_table[0, 0, :2].tolist() == dev.get_block_ids("a")[0]
    assert dev.block_table[0, 1, :1].tolist() == dev.get_block_ids("b")[0]
    dev.free("a")
    assert dict(view) == {"b": 1} and dev.blocks_held_per_row.tolist() == [0, 1, 0, 0]
    with pytest.raises(TypeError):
        view["c"] = 2  # type: ignore[index]
    assert dev.request_ids() == ["b"]
