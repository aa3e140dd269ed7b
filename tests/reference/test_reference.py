"""Hand-worked examples of the reference block manager's semantics.

Every expected value below is worked out in the comments; block ids follow
from the free queue starting as 1..N-1.
"""

import copy

import pytest

from gpukv.core.hashing import MMItem
from gpukv.core.requests import NewRequest, RunningUpdate
from gpukv.reference.manager import BlockPool, NoFreeBlocksError, ReferenceManager

KEY = bytes(range(16))


def mgr(num_blocks, block_size=2, **kw):
    return ReferenceManager(num_blocks, block_size, hash_key=KEY, **kw)


def admit(m, rid, tokens, **kw):
    res = m.step(new=[NewRequest(rid, tokens, **kw)])
    assert res.num_admitted == 1, f"{rid} was not admitted"
    m.check_invariants()
    return res.num_computed_tokens[0]


def snapshot(m):
    return (
        list(m.pool.ref_cnt), m.free_queue(), m.pool.table(), {r: m.get_block_ids(r) for r in m.request_ids()},
        copy.deepcopy(m.stats),
    )


# ------------------------------------------------------------------ BlockPool

def test_pool_starts_with_every_block_but_null_free_in_order():
    pool = BlockPool(5)
    assert pool.free_queue() == [1, 2, 3, 4]
    assert pool.num_free_blocks == 4
    assert pool.allocate(2) == [1, 2]
    assert pool.ref_cnt[:3] == [0, 1, 1]
    pool.check_invariants()


def test_pool_allocate_more_than_free_raises_and_changes_nothing():
    pool = BlockPool(3)
    with pytest.raises(NoFreeBlocksError, match="only 2 are free"):
        pool.allocate(3)
    assert pool.free_queue() == [1, 2]


def test_pool_double_free_raises_and_changes_nothing():
    pool = BlockPool(4)
    pool.allocate(2)
    with pytest.raises(ValueError, match="double free"):
        pool.free([2, 1, 1])
    assert pool.ref_cnt == [0, 1, 1, 0] and pool.free_queue() == [3]


def test_pool_uncached_blocks_freed_in_one_call_keep_their_order_at_the_front():
    pool = BlockPool(6)
    pool.allocate(3)  # 1, 2, 3; queue [4, 5]
    pool.free([3, 2, 1])  # all uncached: front, in this order
    assert pool.free_queue() == [3, 2, 1, 4, 5]


def test_pool_bad_sizes():
    with pytest.raises(ValueError, match="num_blocks must be >= 2"):
        BlockPool(1)
    with pytest.raises(TypeError):
        BlockPool(2.5)


# ------------------------------------------------------------ eviction order

def test_free_order_reverse_uncached_front_cached_back():
    m = mgr(6)
    # 5 tokens, block size 2: blocks [1, 2, 3]; 1 and 2 are full and cached.
    admit(m, "a", [10, 11, 12, 13, 14])
    assert m.get_block_ids("a") == [[1, 2, 3]]
    assert m.free_queue() == [4, 5]
    m.step(finished=["a"])
    # Freed tail first: 3 (uncached) to the front, then 2 and 1 (cached) to the back.
    assert m.free_queue() == [3, 4, 5, 2, 1]
    m.check_invariants()


def test_free_order_all_to_the_back_without_uncached_first():
    m = mgr(6, uncached_first=False)
    admit(m, "a", [10, 11, 12, 13, 14])
    m.step(finished=["a"])
    assert m.free_queue() == [4, 5, 3, 2, 1]


def test_uncached_blocks_of_later_free_calls_go_in_front_of_earlier_ones():
    m = mgr(8)
    admit(m, "a", [1])  # block 1, uncached
    admit(m, "b", [2])  # block 2, uncached
    m.step(finished=["a", "b"])  # a's free call, then b's: 2 lands in front of 1
    assert m.free_queue() == [2, 1, 3, 4, 5, 6, 7]


def test_touch_takes_a_hit_out_of_the_middle_of_the_free_queue():
    m = mgr(6)
    admit(m, "a", [10, 11, 12, 13, 14])
    m.step(finished=["a"])  # queue [3, 4, 5, 2, 1]
    # Same first 4 tokens + 1: at most (5-1)//2 = 2 blocks hit: 1 and 2.
    assert admit(m, "b", [10, 11, 12, 13, 99]) == 4
    # The hits left the middle/back; the new block popped from the front.
    assert m.get_block_ids("b") == [[1, 2, 3]]
    assert m.free_queue() == [4, 5]
    assert m.pool.ref_cnt[1:4] == [1, 1, 1]


def test_lazy_eviction_when_a_cached_block_is_reused():
    m = mgr(4)
    admit(m, "a", [10, 11, 12, 13])  # blocks 1, 2, both full and cached
    m.step(finished=["a"])  # queue [3, 2, 1]
    assert m.free_queue() == [3, 2, 1]
    assert len(m.pool.table()) == 2
    admit(m, "c", [50, 51, 52])  # 2 blocks: pops 3, then 2, whose hash leaves the table
    assert m.get_block_ids("c") == [[3, 2]]
    assert m.num_evictions == 1
    # c's first block is full and cached under c's hash; a's block 1 is still cached.
    assert sorted(b for blocks in m.pool.table().values() for b in blocks) == [1, 3]
    # a's tokens again: (4-1)//2 = 1 block can hit, and block 1 still serves it.
    m.step(finished=["c"])
    assert admit(m, "d", [10, 11, 12, 13]) == 2
    assert m.get_block_ids("d")[0][0] == 1


# ---------------------------------------------------------- last-token rule

@pytest.mark.parametrize("n_tokens, expected_hit", [(4, 2), (5, 4), (6, 4), (7, 6), (1, 0), (2, 0), (3, 2)])
def test_last_token_is_always_computed(n_tokens, expected_hit):
    m = mgr(20)
    tokens = list(range(100, 108))
    admit(m, "warm", tokens)  # 4 full blocks cached
    assert admit(m, "x", tokens[:n_tokens]) == expected_hit  # floor((n-1)/2) blocks at most


# --------------------------------------------------------------- duplicates

def test_duplicate_hash_serves_hits_after_the_original_is_evicted():
    m = mgr(8)
    admit(m, "a", [1, 2, 3, 4])  # blocks [1, 2], both cached
    # Same tokens: only 1 block may hit (last-token rule), so b computes its
    # second block again: block 3, a duplicate of block 2's hash.
    assert admit(m, "b", [1, 2, 3, 4]) == 2
    assert m.get_block_ids("b") == [[1, 3]]
    h2 = m.pool.cached_info(2).digest
    assert m.pool.table()[(h2, 0)] == [2, 3]  # insertion order: oldest first
    assert m.pool.lookup(h2, 0) == 2
    m.step(finished=["a"])  # frees 2 (back), 1 stays with b: queue [4, 5, 6, 7, 2]
    m.step(finished=["b"])  # frees 3, 1 (back): queue [4, 5, 6, 7, 2, 3, 1]
    assert m.free_queue() == [4, 5, 6, 7, 2, 3, 1]
    admit(m, "x", list(range(200, 210)))  # 5 blocks: pops 4, 5, 6, 7, 2 (2 is evicted)
    assert m.get_block_ids("x") == [[4, 5, 6, 7, 2]]
    assert m.pool.table()[(h2, 0)] == [3]
    m.step(finished=["x"])
    # The duplicate (block 3) serves the hit now.
    assert admit(m, "e", [1, 2, 3, 4, 5]) == 4
    assert m.get_block_ids("e")[0][:2] == [1, 3]


def test_skip_prefix_cache_reads_nothing_but_still_caches():
    m = mgr(10)
    admit(m, "a", [1, 2, 3, 4, 5])  # blocks 1, 2 cached
    m.make_prefix_cache_stats()
    assert admit(m, "s", [1, 2, 3, 4, 5], skip_prefix_cache=True) == 0
    assert m.get_block_ids("s") == [[4, 5, 6]]
    stats = m.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (1, 0, 0)
    # Its full blocks were cached as duplicates behind a's.
    h1 = m.pool.cached_info(1).digest
    assert m.pool.table()[(h1, 0)] == [1, 4]


# ------------------------------------------------------------ hit verification

def test_a_digest_match_with_other_tokens_is_a_miss():
    m = mgr(10)
    forged = [7, 8, 9]
    digests = m.step(new=[NewRequest("a", [1, 2, 3])]) and m.block_hashes("a")
    # A request that claims a's digest for different tokens does not hit.
    assert admit(m, "b", forged, block_hashes=digests) == 0


# ----------------------------------------------------- batched admission

def _batched_vs_one_setup():
    m = mgr(10)
    admit(m, "p", [7, 8, 9])  # blocks [1, 2]: 1 cached
    admit(m, "r", [50, 51, 52, 53, 54, 55, 56])  # blocks [3, 4, 5, 6]: 3, 4, 5 cached
    m.step(finished=["p", "r"])
    # p: 2 to the front, 1 to the back; r: 6 to the front, 5, 4, 3 to the back.
    assert m.free_queue() == [6, 2, 7, 8, 9, 1, 5, 4, 3]
    a = NewRequest("a", list(range(300, 312)))  # 6 new blocks
    b = NewRequest("b", [7, 8, 9])  # hits block 1
    return m, a, b


def test_batched_admission_loses_a_hit_as_one_at_a_time_admission_does():
    # One at a time (vLLM's order): a pops 6, 2, 7, 8, 9, 1 and evicts 1; b then misses.
    m, a, b = _batched_vs_one_setup()
    assert m.step(new=[a]).num_admitted == 1
    res = m.step(new=[b])
    assert res.num_computed_tokens == [0]
    assert m.get_block_ids("a") == [[6, 2, 7, 8, 9, 1]]
    assert m.get_block_ids("b") == [[5, 4]]
    m.check_invariants()
    one = (m.free_queue(), m.make_prefix_cache_stats())

    # Batched, the same: b's hit (block 1) is among a's pops, so b is looked
    # up again after them (a second round) and misses.
    m, a, b = _batched_vs_one_setup()
    res = m.step(new=[a, b])
    assert res.num_admitted == 2 and res.num_computed_tokens == [0, 0]
    assert m.get_block_ids("a") == [[6, 2, 7, 8, 9, 1]]
    assert m.get_block_ids("b") == [[5, 4]]
    assert (m.free_queue(), m.make_prefix_cache_stats()) == one == ([3], one[1])
    m.check_invariants()


def test_admission_stops_at_the_first_request_that_does_not_fit():
    m = mgr(6)  # 5 free blocks
    res = m.step(new=[
        NewRequest("a", list(range(6))),  # 3 blocks
        NewRequest("b", list(range(10, 16))),  # 3 blocks: does not fit
        NewRequest("c", [99]),  # would fit, but admission is a prefix
    ])
    assert res.num_admitted == 1
    assert m.request_ids() == ["a"]
    stats = m.make_prefix_cache_stats()
    assert stats.requests == 2  # a and the refused b; c was not looked at
    assert stats.queries == 6 + 6  # tokens
    assert stats.query_blocks == 3 + 3


def test_a_re_admission_after_preemption_counts_apart():
    m = mgr(10)
    m.step(new=[NewRequest("a", list(range(6)))])
    m.step(finished=["a"])
    m.make_prefix_cache_stats()
    res = m.step(new=[NewRequest("a", list(range(6)), num_preemptions=1), NewRequest("b", list(range(5)))])
    assert res.num_computed_tokens == [4, 4]
    stats = m.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits, stats.query_blocks, stats.hit_blocks) == (1, 5, 4, 3, 2)
    assert (stats.preempted_requests, stats.preempted_queries, stats.preempted_hits) == (1, 6, 4)


def test_a_later_request_hits_blocks_an_earlier_one_computes_in_the_same_step():
    m = mgr(10)
    res = m.step(new=[NewRequest("a", [1, 2, 3, 4, 5]), NewRequest("b", [1, 2, 3, 4, 9, 9, 9])])
    assert res.num_computed_tokens == [0, 4]
    assert m.get_block_ids("a") == [[1, 2, 3]]
    assert m.get_block_ids("b") == [[1, 2, 4, 5]]
    assert m.pool.ref_cnt[1:6] == [2, 2, 1, 1, 1]
    m.check_invariants()


def test_running_update_that_does_not_fit_is_reported_and_changes_nothing():
    m = mgr(4)  # 3 free blocks
    admit(m, "a", [1, 2])  # block 1
    admit(m, "b", [3, 4, 5])  # blocks 2, 3
    before = snapshot(m)
    res = m.step(running=[RunningUpdate("a", [6]), RunningUpdate("b", [7, 8])], new=[NewRequest("c", [1])])
    # a needs a second block: none is free.
    assert res.running_failed_at == 0 and res.num_admitted == 0
    assert snapshot(m)[:4] == before[:4]
    assert m.stats.requests == before[4].requests  # c was not looked at


def test_decode_appends_tokens_allocates_and_caches_full_blocks():
    m = mgr(10)
    admit(m, "a", [1, 2, 3])  # blocks 1, 2; block 1 cached
    assert m.step(running=[RunningUpdate("a", [4])]).ok  # block 2 full now: cached
    assert m.get_block_ids("a") == [[1, 2]]
    assert len(m.pool.table()) == 2
    assert m.step(running=[RunningUpdate("a", [5])]).ok  # a third block
    assert m.get_block_ids("a") == [[1, 2, 3]]
    assert m.num_computed_tokens("a") == 5


# ------------------------------------------------------------------- salts

def test_cache_salt_isolates_requests():
    m = mgr(20)
    tokens = [1, 2, 3, 4, 5]
    admit(m, "a", tokens, cache_salt="tenant-1")
    assert admit(m, "b", tokens, cache_salt="tenant-2") == 0
    assert admit(m, "c", tokens) == 0
    assert admit(m, "d", tokens, cache_salt="tenant-1") == 4


def test_lora_and_mm_items_are_part_of_the_hash():
    m = mgr(30)
    tokens = [1, 2, 3, 4, 5, 6, 7]
    admit(m, "a", tokens, lora_id=1)
    assert admit(m, "b", tokens, lora_id=2) == 0
    assert admit(m, "c", tokens, lora_id=1) == 6
    admit(m, "mm", tokens, mm_items=(MMItem(2, 2, "img-A"),))
    # The item covers tokens 2..3 = block 1: block 0 (no extra keys, cached by
    # "mm") is shared, block 1 differs.
    assert admit(m, "mm2", tokens, mm_items=(MMItem(2, 2, "img-B"),)) == 2
    assert admit(m, "mm3", tokens, mm_items=(MMItem(2, 2, "img-A"),)) == 6


# ----------------------------------------------------------- sliding window

def test_sliding_window_hits_and_skipped_blocks():
    # Groups: full attention and a 4-token sliding window; block size 2, so a
    # hit boundary must see ceil((4-1)/2) = 2 blocks of the window group.
    m = mgr(20, sliding_windows=[None, 4])
    tokens = list(range(1, 10))  # 9 tokens: 5 blocks per group, 4 full
    admit(m, "a", tokens)
    assert m.get_block_ids("a") == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]
    # Decode one token: 10 computed before it... computed = 9, so tokens before
    # 9 - 4 + 1 = 6 (blocks 0..2) are out of the window: freed, set to null.
    assert m.step(running=[RunningUpdate("a", [10])]).ok
    assert m.get_block_ids("a") == [[1, 2, 3, 4, 5], [0, 0, 0, 9, 10]]
    assert m.free_queue() == list(range(11, 20)) + [8, 7, 6]  # cached: to the back, tail first
    # Same 9 tokens: full group hits 4 blocks; the window group needs blocks
    # 2 and 3 (8 free but cached, 9 held by a) and uses null before them.
    assert admit(m, "b", tokens) == 8
    assert m.get_block_ids("b") == [[1, 2, 3, 4, 11], [0, 0, 8, 9, 12]]
    m.check_invariants()


def test_sliding_window_hit_shrinks_to_the_last_window_run():
    m = mgr(30, sliding_windows=[None, 4])
    tokens = list(range(1, 12))  # 11 tokens: 6 blocks per group, 5 full
    admit(m, "a", tokens)
    assert m.get_block_ids("a") == [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]]
    m.step(finished=["a"])
    # Group 0 frees 6 (front), 5..1 (back); group 1 frees 12 (front), 11..7 (back).
    assert m.free_queue() == [12, 6] + list(range(13, 30)) + [5, 4, 3, 2, 1, 11, 10, 9, 8, 7]
    # Put block 10 (the window group's position 3) first in line, so the next
    # allocation evicts exactly it.
    m.pool._free.move_to_end(10, last=False)
    admit(m, "x", [500])
    assert m.get_block_ids("x") == [[10], [12]]
    # Full group: 5 blocks could hit ((11-1)//2). Window group within 5: the
    # run ending at 5 breaks at position 3; the last run of 2 is positions
    # 1..2, so the hit is 3 blocks, and the full group is cut to 3 as well.
    assert admit(m, "b", tokens) == 6
    # Hits are touched first (1, 2, 3 and 8, 9), then 3 new blocks per group.
    assert m.get_block_ids("b") == [[1, 2, 3, 6, 13, 14], [0, 8, 9, 15, 16, 17]]


# ------------------------------------------------------------------- reset

def test_reset_prefix_cache_only_when_everything_is_free():
    m = mgr(10)
    admit(m, "a", [1, 2, 3])
    assert m.reset_prefix_cache() is False
    assert len(m.pool.table()) == 1
    m.step(finished=["a"])
    assert m.reset_prefix_cache() is True
    assert m.pool.table() == {}
    assert m.make_prefix_cache_stats().reset is True
    assert admit(m, "b", [1, 2, 3]) == 0


# ------------------------------------------------------------------- stats

def test_stats_count_blocks_and_tokens_per_attempt():
    m = mgr(20)
    admit(m, "a", [1, 2, 3, 4, 5])  # 3 blocks asked, 0 hit
    admit(m, "b", [1, 2, 3, 4, 5, 6])  # 3 asked, 2 hit
    s = m.make_prefix_cache_stats()
    assert (s.requests, s.queries, s.hits) == (2, 11, 4)  # tokens, as vLLM counts them
    assert (s.query_blocks, s.hit_blocks) == (6, 2)
    assert (s.query_tokens, s.hit_tokens) == (11, 4)  # the older names
    assert m.make_prefix_cache_stats().requests == 0


def test_get_computed_blocks_then_allocate_slots_equals_a_step_of_one():
    m1, m2 = mgr(12), mgr(12)
    for m in (m1, m2):
        admit(m, "a", [1, 2, 3, 4, 5])
        m.step(finished=["a"])
    req = NewRequest("b", [1, 2, 3, 4, 9, 9, 9])
    computed = m1.get_computed_blocks(req)
    assert computed.block_ids == [[1, 2]] and computed.num_tokens == 4
    new = m1.allocate_slots(req, computed=computed)
    m2.step(new=[req])
    assert new == [[3, 4]]
    assert snapshot(m1)[:4] == snapshot(m2)[:4]
    assert m1.allocate_slots("b", [10]) == [[]]  # 8 tokens fit in 4 blocks
    assert m1.allocate_slots("b", [11]) == [[5]]


# -------------------------------------------------------------- bad input

@pytest.mark.parametrize("call, exc, match", [
    (lambda m: m.step(finished=["nope"]), KeyError, "unknown request id 'nope'"),
    (lambda m: m.step(finished=["a", "a"]), ValueError, "double free"),
    (lambda m: m.free("nope"), KeyError, "unknown request id"),
    (lambda m: m.step(running=[RunningUpdate("zz", [1])]), KeyError, "unknown request id"),
    (lambda m: m.step(running=[RunningUpdate("a", [1.5])]), TypeError, "position 0"),
    (lambda m: m.step(new=[NewRequest("n", [1, -2])]), ValueError, "position 1"),
    (lambda m: m.step(new=[NewRequest("n", [1, 2**32])]), ValueError, "outside"),
    (lambda m: m.step(new=[NewRequest("n", ["x"])]), TypeError, "must be ints"),
    (lambda m: m.step(new=[NewRequest("n", [True])]), TypeError, "must be ints"),
    (lambda m: m.step(new=[NewRequest("n", [])]), ValueError, "no tokens"),
    (lambda m: m.step(new=[NewRequest("a", [1])]), ValueError, "already in use"),
    (lambda m: m.step(new=[NewRequest("n", [1]), NewRequest("n", [2])]), ValueError, "already in use"),
    (lambda m: m.step(new=[NewRequest("n", list(range(40)))]), ValueError, "more than the whole pool"),
    (lambda m: m.step(finished=["a"], running=[RunningUpdate("a", [1])]), ValueError, "both finished and running"),
    # A valid finish followed by an invalid new request: the finish must not happen either.
    (lambda m: m.step(finished=["a"], new=[NewRequest("n", [-1])]), ValueError, "position 0"),
])
def test_bad_input_raises_clearly_and_changes_nothing(call, exc, match):
    m = mgr(8)
    admit(m, "a", [1, 2, 3])
    before = snapshot(m)
    with pytest.raises(exc, match=match):
        call(m)
    assert snapshot(m)[:4] == before[:4]
    m.check_invariants()


def test_bad_manager_arguments():
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        ReferenceManager(10, 0)
    with pytest.raises(ValueError, match="num_blocks must be >= 2"):
        ReferenceManager(-3, 16)
    with pytest.raises(ValueError, match="sliding window must be >= 1"):
        ReferenceManager(10, 16, sliding_windows=[None, -4])
