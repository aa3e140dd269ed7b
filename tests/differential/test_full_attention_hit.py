"""Hand-worked examples of the full-attention hit, on both managers: the
longest prefix (whole blocks, in tokens) a model's full-attention groups
alone could serve, reported by every lookup next to the hit.

Every model here has block size 2; the hybrid one is a full-attention group
and a 4-token sliding window, which needs the last ceil(3 / 2) = 2 blocks
before a hit boundary. Block ids follow from the free queue starting as
1..N-1. ``T`` (tokens 1..11) has 6 blocks, 5 of them full, and its lookup
may hit at most (11 - 1) // 2 = 5 blocks.
"""

import pytest

from gpukv.core.requests import NewRequest, PrefixHit, RunningUpdate
from gpukv.device.manager import DeviceManager
from gpukv.reference.manager import ReferenceManager

KEY = bytes(range(16))
HYBRID = [None, 4]
T = list(range(1, 12))
_MANAGER = [ReferenceManager]  # (the manager class under test: ``manager_class``)


@pytest.fixture(autouse=True, params=["reference", "device"])
def manager_class(request):
    _MANAGER[0] = ReferenceManager if request.param == "reference" else DeviceManager
    yield
    _MANAGER[0] = ReferenceManager


def mgr(num_blocks, sliding_windows=(None,), **kw):
    extra = {"max_num_reqs": 8} if _MANAGER[0] is DeviceManager else {}
    return _MANAGER[0](num_blocks, 2, hash_key=KEY, sliding_windows=sliding_windows, **kw, **extra)


def admit(m, rid, tokens, **kw):
    res = m.step(new=[NewRequest(rid, tokens, **kw)])
    assert res.num_admitted == 1, f"{rid} was not admitted"
    return res


def lookup(m, request):
    """The lookup's hit and full-attention hit, in tokens."""
    computed = m.get_computed_blocks(request)
    return computed.num_tokens, computed.full_attention_hit_tokens


# ------------------------------------------------------------------- states

def full_attention_state(sliding_windows):
    """a = [1..5] caches its 2 full blocks; a request sharing 4 tokens hits both."""
    m = mgr(16, sliding_windows)
    admit(m, "a", [1, 2, 3, 4, 5])
    return m, NewRequest("b", [1, 2, 3, 4, 9, 9, 9])


def window_only_state():
    """A lone 4-token window, whose position 3 is evicted: the hit is 3 blocks.

    a = T holds blocks 1..6 (queue 7..12). Its decode releases the 4 blocks
    behind the window, cached, tail first to the back: queue 7..12, 4, 3, 2, 1.
    x (14 tokens, 7 blocks) pops 7..12 and 4, evicting position 3; finished,
    its 7 full blocks go to the back. T's lookup: positions 0, 1, 2 and 4 are
    cached, 3 is not; the window's last run of 2 ends at 3 blocks (6 tokens),
    and 3 blocks is all a full-attention group would have, too.
    """
    m = mgr(13, [4])
    admit(m, "a", T)
    assert m.step(running=[RunningUpdate("a", [12])]).ok
    assert m.get_block_ids("a") == [[0, 0, 0, 0, 5, 6]]
    admit(m, "x", list(range(500, 514)))
    m.step(finished=["x"])
    assert m.free_queue() == [3, 2, 1, 4, 12, 11, 10, 9, 8, 7]
    return m


def hybrid_state():
    """The window group lost positions 2 and 3; the full-attention group holds all 5.

    a = T takes 1..6 (full attention) and 7..12 (window). Its decode releases
    the window's first 4 blocks, cached, tail first to the back: queue 10, 9,
    8, 7. x = [500] pops 10 and 9 (one block per group), evicting the window's
    positions 3 and 2; then a finishes, all its cached blocks to the back.
    """
    m = mgr(13, HYBRID)
    admit(m, "a", T)
    assert m.step(running=[RunningUpdate("a", [12])]).ok
    assert m.get_block_ids("a") == [[1, 2, 3, 4, 5, 6], [0, 0, 0, 0, 11, 12]]
    assert m.free_queue() == [10, 9, 8, 7]
    admit(m, "x", [500])
    m.step(finished=["a"])
    assert m.free_queue() == [8, 7, 6, 5, 4, 3, 2, 1, 12, 11]
    return m


def two_request_state():
    """The window group lost positions 2 and 3, and p holds positions 0 and 1 of both groups.

    a = T takes 1..6 and 7..12; p = [1..5] hits a's first 2 blocks of each group
    and takes 13 and 14; f (4 tokens) takes 15..18, the last free blocks. a's
    decode releases the window's 10 and 9 (p still holds 7 and 8); a finishes:
    queue 10, 9, 6, 5, 4, 3, 12, 11. x = [500] pops 10 and 9, evicting the
    window's positions 3 and 2; f finishes behind everything.
    """
    m = mgr(19, HYBRID)
    admit(m, "a", T)
    admit(m, "p", [1, 2, 3, 4, 5])
    admit(m, "f", [900, 901, 902, 903])
    assert m.get_block_ids("p") == [[1, 2, 13], [7, 8, 14]]
    assert m.step(running=[RunningUpdate("a", [12])]).ok
    m.step(finished=["a"])
    admit(m, "x", [500])
    m.step(finished=["f"])
    assert m.free_queue() == [6, 5, 4, 3, 12, 11, 16, 15, 18, 17]
    return m


# ------------------------------------------------------- one kind of group

@pytest.mark.parametrize("sliding_windows", [[None], [None, None]])
def test_full_attention_only_reports_none(sliding_windows):
    # (one kind of group: the full-attention hit would be the hit, and is not reported)
    m, b = full_attention_state(sliding_windows)
    assert lookup(m, b) == (4, None)
    # [1, 2, 7, ...] shares a's first block only.
    assert lookup(m, NewRequest("c", [1, 2, 7, 7, 7])) == (2, None)
    res = admit(m, "b", b.token_ids)
    assert (res.num_computed_tokens, res.full_attention_hit_tokens) == ([4], None)
    m.check_invariants()


def test_window_only_reports_none():
    m = window_only_state()
    b = NewRequest("b", T)
    computed = m.get_computed_blocks(b)
    assert computed.block_ids == [[0, 2, 3]]  # (the window starts at position 1)
    assert (computed.num_tokens, computed.full_attention_hit_tokens) == (6, None)
    # b touches 3 and 2 and takes 3 new blocks: 1, then 4 and 12.
    res = admit(m, "b", T)
    assert (res.num_computed_tokens, res.full_attention_hit_tokens) == ([6], None)
    assert m.get_block_ids("b") == [[0, 2, 3, 1, 4, 12]]
    m.check_invariants()


# ------------------------------------------------------------ a hybrid model

def test_hybrid_lookup_reports_what_the_full_attention_group_alone_holds():
    # The window group has positions 0, 1 and 4: its last run of 2 ends at 2
    # blocks, so the hit is 4 tokens; the full-attention group alone holds all
    # 5 blocks T may hit: 10 tokens.
    m = hybrid_state()
    b = NewRequest("b", T)
    computed = m.get_computed_blocks(b)
    assert computed.block_ids == [[1, 2], [7, 8]]
    assert (computed.num_tokens, computed.full_attention_hit_tokens) == (4, 10)
    # A step of b alone reports the same (no earlier request pops anything).
    # It computes one token: 1 + 1 new blocks, besides touching 1, 2, 7 and 8.
    res = admit(m, "b", T, num_tokens_to_compute=1)
    assert (res.num_computed_tokens, res.full_attention_hit_tokens) == ([4], [10])
    assert m.get_block_ids("b") == [[1, 2, 6], [7, 8, 5]]
    m.check_invariants()


def test_a_full_attention_group_shorter_than_the_limit_ends_the_full_attention_hit():
    # b = [1..8, 20, 20, 20] shares 4 full blocks with T: the full-attention
    # group serves those 4 (8 tokens) of the 5 b may hit; the window group,
    # as for T, 2.
    m = hybrid_state()
    assert lookup(m, NewRequest("b", [*range(1, 9), 20, 20, 20])) == (4, 8)


def test_skipping_the_prefix_cache_reports_zero():
    m = hybrid_state()
    b = NewRequest("b", T, skip_prefix_cache=True, num_tokens_to_compute=1)
    assert lookup(m, b) == (0, 0)
    assert m.read_prefix_hit(b) == PrefixHit(0, 0, 0)
    res = m.step(new=[b])
    assert (res.num_admitted, res.num_computed_tokens, res.full_attention_hit_tokens) == (1, [0], [0])
    m.check_invariants()


def test_caching_off_reports_zero():
    m = mgr(13, HYBRID, enable_caching=False)
    admit(m, "a", T)
    m.step(finished=["a"])
    assert lookup(m, NewRequest("b", T)) == (0, 0)
    res = admit(m, "b", T)
    assert (res.num_computed_tokens, res.full_attention_hit_tokens) == ([0], [0])


@pytest.mark.parametrize(("state", "hit", "full_attention_hit", "num_unheld"), [
    # full attention: a holds blocks 1 and 2
    (lambda: full_attention_state([None]), 4, None, 0),
    # window: b hits 2 and 3 (position 0 is the null block), both free
    (lambda: (window_only_state(), NewRequest("b", T)), 6, None, 2),
    # hybrid: b hits 1, 2, 7 and 8, all free since a finished
    (lambda: (hybrid_state(), NewRequest("b", T)), 4, 10, 4),
], ids=["full-attention", "window", "hybrid"])
def test_read_prefix_hit_reports_what_get_computed_blocks_does(state, hit, full_attention_hit, num_unheld):
    m, b = state()
    assert m.read_prefix_hit(b) == PrefixHit(hit, num_unheld, full_attention_hit)
    assert lookup(m, b) == (hit, full_attention_hit)


# ---------------------------------------------------- two new requests a step

def test_an_earlier_requests_pops_end_the_full_attention_hit():
    # Looked up alone, b = T hits p's blocks (4 tokens); the full-attention
    # group holds positions 2, 3 and 4 as well (3, 4, 5: free, cached), so 10.
    m = two_request_state()
    b = NewRequest("b", T)
    assert lookup(m, b) == (4, 10)
    # Admitted after A = [100], which pops 6 and 5 (one block per group):
    # position 4's block (5) is evicted before vLLM looks b up, so b's
    # full-attention hit ends there: 4 blocks, 8 tokens. b's own hit is held
    # by p, so A's pops defer nothing.
    res = m.step(new=[NewRequest("A", [100]), b])
    assert res.num_admitted == 2
    assert res.num_computed_tokens == [0, 4]
    assert res.full_attention_hit_tokens == [0, 8]
    assert m.get_block_ids("A") == [[6], [5]]
    assert m.get_block_ids("b") == [[1, 2, 4, 3, 12, 11], [7, 8, 16, 15, 18, 17]]
    m.check_invariants()


def test_an_earlier_request_computing_the_popped_blocks_keeps_them():
    # A = [1..10, 200] shares T's first 5 blocks: it hits 2 (4 tokens; its
    # full-attention hit is 10 tokens, nothing popped before it) and computes
    # positions 2..5, popping 6, 5, 4, 3 (full attention) and 12, 11, 16, 15
    # (window): the old copies of positions 2..4 go, but A caches its own.
    # vLLM looks b up after that and finds A's copies in both groups: b hits
    # all 5 blocks, so neither its hit nor its full-attention hit ends at
    # the evicted positions.
    m = two_request_state()
    res = m.step(new=[NewRequest("A", [*range(1, 11), 200]), NewRequest("b", T)])
    assert res.num_admitted == 2
    assert res.num_computed_tokens == [4, 10]
    assert res.full_attention_hit_tokens == [10, 10]
    assert m.get_block_ids("A") == [[1, 2, 6, 5, 4, 3], [7, 8, 12, 11, 16, 15]]
    assert m.get_block_ids("b") == [[1, 2, 6, 5, 4, 18], [0, 0, 0, 11, 16, 17]]
    m.check_invariants()


def test_a_popped_block_with_another_cached_copy_keeps_the_full_attention_hit():
    # a = T and s = T (skipping the cache) hold two copies of every block:
    # a's 1..6 / 7..12 and s's 13..18 / 19..24. Both decode: the window
    # releases a's 10, 9, 8, 7 and s's 22, 21, 20, 19; a finishes (6..1 and
    # 12, 11 to the back); x (8 tokens) pops all 8 released window blocks.
    m = mgr(25, HYBRID)
    admit(m, "a", T)
    admit(m, "s", T, skip_prefix_cache=True)
    assert m.step(running=[RunningUpdate("a", [12]), RunningUpdate("s", [12])]).ok
    m.step(finished=["a"])
    admit(m, "x", list(range(500, 508)))
    assert m.free_queue() == [6, 5, 4, 3, 2, 1, 12, 11]
    # The window group has neither copy of positions 0..3: b hits nothing;
    # the full-attention group holds positions 0..4 (a's copies, the oldest).
    b = NewRequest("b", T, num_tokens_to_compute=1)
    assert lookup(m, b) == (0, 10)
    # A = [100] pops 6 and 5, evicting a's copy of position 4; s still holds
    # its copy (17), which vLLM's lookup of b then finds: still 10 tokens.
    res = m.step(new=[NewRequest("A", [100]), b])
    assert res.full_attention_hit_tokens == [0, 10]
