"""Chunked prefill and lookahead slots, on both managers.

Hand-worked cases with their exact block ids, and the device manager checked
against the reference step by step over random chunk sizes, lookahead slots
and token budgets (``step``, ``decode`` and ``allocate_slots``). The bad
inputs are in ``test_catalogue.py``; the comparison with vLLM 0.8.5's own
manager in ``test_vllm_chunked.py``.
"""

from __future__ import annotations

import pytest

from gpukv.core.requests import NewRequest, RunningUpdate
from gpukv.device.manager import DeviceManager
from gpukv.reference.manager import ReferenceManager
from workload import chunked_session

KEY = bytes(range(16))
PROMPT = list(range(12))


def make(kind: str, num_blocks: int = 16, block_size: int = 4, windows=(None,)):
    cls = ReferenceManager if kind == "reference" else DeviceManager
    return cls(num_blocks, block_size, sliding_windows=list(windows), hash_key=KEY, max_model_len=64)


BOTH = pytest.mark.parametrize("kind", ["reference", "device"])


# ------------------------------------------------------------ hand-worked

@BOTH
def test_a_prompt_computed_in_chunks_caches_each_block_once_it_is_computed(kind):
    m = make(kind)
    res = m.step(new=[NewRequest("a", list(range(10)), num_tokens_to_compute=5)])
    # 5 tokens computed: blocks for them only; block 1 (tokens 0-3) is full
    # and computed, so cached; block 2 holds token 4.
    assert (res.num_admitted, res.num_computed_tokens) == (1, [0])
    assert m.get_block_ids("a") == [[1, 2]]
    assert m.num_computed_tokens("a") == 5
    # 3 more with 2 lookahead slots: tokens 5-7 fill block 2; slots 8-9 get block 3.
    assert m.step(running=[RunningUpdate("a", (), 3, num_lookahead_tokens=2)]).ok
    assert m.get_block_ids("a") == [[1, 2, 3]]
    assert m.num_computed_tokens("a") == 8
    # The same prompt hits the two computed blocks (its own last token is
    # always computed), and a block of its own for tokens 8-9.
    res = m.step(new=[NewRequest("b", list(range(10)))])
    assert res.num_computed_tokens == [8]
    assert m.get_block_ids("b") == [[1, 2, 4]]
    # a's lookahead block is kept and filled: no new block for token 10.
    assert m.step(running=[RunningUpdate("a", [99])]).ok
    assert m.get_block_ids("a") == [[1, 2, 3]]
    assert m.num_computed_tokens("a") == 11
    m.check_invariants()


@BOTH
def test_a_later_request_of_the_step_hits_only_the_chunk_an_earlier_one_computes(kind):
    m = make(kind)
    res = m.step(new=[NewRequest("a", PROMPT, num_tokens_to_compute=5), NewRequest("b", PROMPT)])
    # a computes tokens 0-4: only its first block is full and computed, so b
    # hits that one (pending in the step) and computes the rest itself.
    assert res.num_computed_tokens == [0, 4]
    assert m.get_block_ids("a") == [[1, 2]]
    assert m.get_block_ids("b") == [[1, 3, 4]]
    assert (m.num_computed_tokens("a"), m.num_computed_tokens("b")) == (5, 12)
    m.check_invariants()


@BOTH
def test_the_chunk_counts_beyond_the_hit(kind):
    m = make(kind)
    m.step(new=[NewRequest("a", PROMPT)])
    res = m.step(new=[NewRequest("c", PROMPT, num_tokens_to_compute=2)])
    # The longest hit is 2 blocks (the last token is computed): 8 tokens.
    # As vLLM counts num_new_tokens, the chunk of 2 comes on top: 10 tokens
    # computed, a new block for tokens 8-9 (the front of the free queue).
    assert (res.num_computed_tokens, res.num_new_tokens) == ([8], [2])
    assert m.get_block_ids("c") == [[1, 2, 4]]
    assert m.num_computed_tokens("c") == 10
    assert m.step(running=[RunningUpdate("c", (), 2)]).ok
    assert m.get_block_ids("c") == [[1, 2, 4]]
    assert m.num_computed_tokens("c") == 12
    # A chunk longer than what the hit leaves computes what is left.
    res = m.step(new=[NewRequest("d", PROMPT, num_tokens_to_compute=12)])
    assert (res.num_computed_tokens, res.num_new_tokens) == ([8], [4])
    assert m.num_computed_tokens("d") == 12
    m.check_invariants()


@BOTH
def test_the_token_budget_stops_admission_where_vllms_waiting_loop_stops(kind):
    m = make(kind)
    new = [NewRequest(r, list(range(100 * i, 100 * i + 10))) for i, r in enumerate("abc", 1)]
    res = m.step(new=new, token_budget=15)
    # a takes its 10 tokens, b the 5 left; the budget is then spent, so c is
    # not even looked up (vLLM's ``while token_budget > 0``): 2 requests in
    # the stats, c refused with no row.
    assert (res.num_admitted, res.num_computed_tokens, res.num_new_tokens) == (2, [0, 0], [10, 5])
    assert m.get_block_ids("a") == [[1, 2, 3]] and m.get_block_ids("b") == [[4, 5]]
    assert (m.num_computed_tokens("a"), m.num_computed_tokens("b")) == (10, 5)
    assert m.make_prefix_cache_stats().requests == 2
    # A budget of 0 admits nothing and looks nothing up.
    res = m.step(new=[new[2]], token_budget=0)
    assert res.num_admitted == 0 and m.make_prefix_cache_stats().requests == 0
    m.check_invariants()


@BOTH
def test_the_budget_charges_only_the_tokens_past_the_hit(kind):
    m = make(kind)
    res = m.step(new=[NewRequest("a", PROMPT), NewRequest("b", PROMPT)], token_budget=13)
    # a computes its 12 tokens (1 left in the budget) and caches its full
    # blocks as it is admitted, as vLLM does, so b hits two of them (its last
    # token is always computed) at no charge and computes 1 more token.
    assert (res.num_computed_tokens, res.num_new_tokens) == ([0, 8], [12, 1])
    assert m.get_block_ids("a") == [[1, 2, 3]] and m.get_block_ids("b") == [[1, 2, 4]]
    assert (m.num_computed_tokens("a"), m.num_computed_tokens("b")) == (12, 9)
    m.check_invariants()


@BOTH
def test_a_chunk_and_a_budget_together(kind):
    m = make(kind)
    res = m.step(new=[NewRequest("a", PROMPT, num_tokens_to_compute=5), NewRequest("b", PROMPT)], token_budget=13)
    # a computes 5 (its chunk): block 1 is full and cached. b hits it and
    # gets the 8 tokens left in the budget, which are all it has left.
    assert (res.num_computed_tokens, res.num_new_tokens) == ([0, 4], [5, 8])
    assert m.get_block_ids("a") == [[1, 2]] and m.get_block_ids("b") == [[1, 3, 4]]
    assert (m.num_computed_tokens("a"), m.num_computed_tokens("b")) == (5, 12)
    m.check_invariants()


@BOTH
def test_a_sliding_window_releases_by_computed_tokens_while_a_prompt_is_half_computed(kind):
    m = make(kind, block_size=2, windows=(None, 4))
    m.step(new=[NewRequest("a", PROMPT, num_tokens_to_compute=6)])
    assert m.get_block_ids("a") == [[1, 2, 3], [4, 5, 6]]
    # Before computing 4 more, the window group drops what token 6 onwards
    # cannot see: (6 - 4 + 1) // 2 = 1 block (not the 12 known tokens' 4).
    assert m.step(running=[RunningUpdate("a", (), 4)]).ok
    assert m.get_block_ids("a") == [[1, 2, 3, 7, 8], [0, 5, 6, 9, 10]]
    assert m.num_computed_tokens("a") == 10
    assert m.free_queue() == [11, 12, 13, 14, 15, 4]
    # A token appended and computed with everything left, 3 lookahead slots:
    # 13 computed + 3 slots = 8 blocks per group; the window now drops 3.
    assert m.step(running=[RunningUpdate("a", [50], None, 3)]).ok
    assert m.get_block_ids("a") == [[1, 2, 3, 7, 8, 11, 12, 13], [0, 0, 0, 9, 10, 14, 15, 4]]
    assert m.free_queue() == [6, 5]
    # The same 13 tokens, chunk 3: the hit is 6 blocks (the window's last two
    # real), and the chunk counts beyond it: the one token left is computed,
    # in a new block per group (the last two free ones).
    res = m.step(new=[NewRequest("b", PROMPT + [50], num_tokens_to_compute=3)])
    assert (res.num_computed_tokens, res.num_new_tokens) == ([12], [1])
    assert m.get_block_ids("b") == [[1, 2, 3, 7, 8, 11, 6], [0, 0, 0, 0, 10, 14, 5]]
    assert m.num_computed_tokens("b") == 13
    m.check_invariants()


@BOTH
def test_a_sliding_window_releases_behind_the_processed_tokens_it_is_given(kind):
    # vLLM 0.33 with tokens in flight: allocate_slots releases behind
    # num_computed_tokens - num_in_flight_tokens, handed in as
    # num_processed_tokens (None: behind the computed tokens, as above).
    m = make(kind, block_size=2, windows=(None, 4))
    m.step(new=[NewRequest("a", PROMPT, num_tokens_to_compute=6)])
    assert m.get_block_ids("a") == [[1, 2, 3], [4, 5, 6]]
    # Nothing processed yet: nothing released (None would drop block 4).
    assert m.allocate_slots("a", (), num_tokens=4, num_processed_tokens=0) == [[7, 8], [9, 10]]
    assert m.get_block_ids("a") == [[1, 2, 3, 7, 8], [4, 5, 6, 9, 10]]
    assert m.free_queue() == [11, 12, 13, 14, 15]
    # 6 processed: (6 - 4 + 1) // 2 = 1 block released (block 4, to the
    # queue's tail), before the fit check, and taken again by this call.
    assert m.allocate_slots("a", [50], num_lookahead_tokens=3, num_processed_tokens=6) == [[11, 12, 13],
                                                                                          [14, 15, 4]]
    assert m.get_block_ids("a") == [[1, 2, 3, 7, 8, 11, 12, 13], [0, 5, 6, 9, 10, 14, 15, 4]]
    assert m.free_queue() == [] and m.num_computed_tokens("a") == 13
    # 13 processed: 5 blocks behind the window, tail first in one free call.
    assert m.allocate_slots("a", (), num_processed_tokens=13) == [[], []]
    assert m.get_block_ids("a") == [[1, 2, 3, 7, 8, 11, 12, 13], [0, 0, 0, 0, 0, 14, 15, 4]]
    assert m.free_queue() == [10, 9, 6, 5]
    # A step's RunningUpdate carries it too; nothing more to release.
    assert m.step(running=[RunningUpdate("a", [7], None, 0, 13)]).ok
    assert m.get_block_ids("a")[1] == [0, 0, 0, 0, 0, 14, 15, 4]
    assert m.free_queue() == [10, 9, 6, 5] and m.num_computed_tokens("a") == 14
    m.check_invariants()


@BOTH
def test_a_release_behind_processed_tokens_stops_at_the_blocks_held(kind):
    # 12 processed tokens skip 4 blocks of the window group, which holds 2
    # before the call: vLLM's remove_skipped_blocks releases those 2 (the
    # skip is capped at the blocks held), and the blocks allocated now stay.
    m = make(kind, block_size=2, windows=(None, 4))
    m.step(new=[NewRequest("a", PROMPT, num_tokens_to_compute=4)])
    assert m.get_block_ids("a") == [[1, 2], [3, 4]]
    assert m.allocate_slots("a", (), num_tokens=8, num_processed_tokens=12) == [[5, 6, 7, 8], [9, 10, 11, 12]]
    assert m.get_block_ids("a") == [[1, 2, 5, 6, 7, 8], [0, 0, 9, 10, 11, 12]]
    assert m.free_queue() == [13, 14, 15, 4, 3]
    # The next release catches up behind the same 12 tokens: 9 and 10.
    assert m.allocate_slots("a", [50], num_processed_tokens=12) == [[13], [14]]
    assert m.get_block_ids("a") == [[1, 2, 5, 6, 7, 8, 13], [0, 0, 0, 0, 11, 12, 14]]
    assert m.free_queue() == [15, 4, 3, 10, 9]
    m.check_invariants()


@BOTH
def test_lookahead_blocks_are_never_cached(kind):
    m = make(kind)
    m.step(new=[NewRequest("a", PROMPT[:4], num_lookahead_tokens=4)])
    assert m.get_block_ids("a") == [[1, 2]]
    m.step(running=[RunningUpdate("a", PROMPT[4:8], 2)])  # two of the four appended tokens
    # Block 2 holds tokens 4-7, but only 4-5 are computed: not cached, so a
    # request with the same 9 tokens hits block 1 alone.
    res = m.step(new=[NewRequest("b", PROMPT[:9])])
    assert res.num_computed_tokens == [4]
    m.step(running=[RunningUpdate("a", (), 2)])
    res = m.step(new=[NewRequest("c", PROMPT[:9])])
    assert res.num_computed_tokens == [8]
    m.check_invariants()


@BOTH
def test_decode_continues_chunks_and_reserves_lookahead(kind):
    m = make(kind)
    rows = m.step(new=[NewRequest("a", PROMPT, num_tokens_to_compute=3),
                       NewRequest("b", list(range(100, 106)))]).rows
    assert m.get_block_ids("a") == [[1]] and m.get_block_ids("b") == [[2, 3]]
    # Row a continues its prefill (no new token) to 8 tokens: one more block.
    res = m.decode(rows[:1], None, num_tokens_to_compute=[5])
    assert res.ok and m.num_computed_tokens("a") == 8
    assert m.get_block_ids("a") == [[1, 4]]
    # Both append a token; a computes all it knows (13), b 7, with 2 slots each.
    assert m.decode(rows, [[60], [61]], num_lookahead_tokens=2).ok
    assert (m.num_computed_tokens("a"), m.num_computed_tokens("b")) == (13, 7)
    assert m.get_block_ids("a") == [[1, 4, 5, 6]]
    assert m.get_block_ids("b") == [[2, 3, 7]]
    m.check_invariants()


@BOTH
def test_allocate_slots_takes_vllm_num_tokens_and_lookahead(kind):
    m = make(kind)
    m.step(new=[NewRequest("a", PROMPT)])
    req = NewRequest("b", PROMPT + [77, 78])
    computed = m.get_computed_blocks(req)
    assert computed.num_tokens == 12
    # vLLM's num_tokens counts beyond the hit: 1 token, 3 lookahead slots.
    assert m.allocate_slots(req, computed=computed, num_tokens=1, num_lookahead_tokens=3) == [[4]]
    assert m.num_computed_tokens("b") == 13
    assert m.allocate_slots("b", [79], num_tokens=2) == [[]]  # the lookahead block holds them
    assert m.num_computed_tokens("b") == 15
    assert m.get_block_ids("b") == [[1, 2, 3, 4]]
    m.check_invariants()


# ------------------------------------------------------- device vs reference

@pytest.mark.parametrize("seed", range(6))
def test_device_equals_reference_full_attention(seed):
    chunked_session(seed, (None,))


@pytest.mark.parametrize("seed", range(6, 12))
def test_device_equals_reference_with_a_sliding_window(seed):
    chunked_session(seed, (None, 6))


# ------------------------------------------------- allocate_slots with a hit

@BOTH
def test_a_hit_looked_up_after_a_shorter_lookup_of_the_same_id_is_accepted(kind):
    # The reference once completed a recalled, shorter digest list only when
    # it had none, and failed on this valid call (a stop, not a refusal).
    m = make(kind, num_blocks=32)
    prompt = list(range(17))
    m.step(new=[NewRequest("a", prompt)])
    m.get_computed_blocks(NewRequest("x", prompt[:9]))
    hit = m.get_computed_blocks(NewRequest("y", prompt))
    assert hit.num_tokens == 16
    assert m.allocate_slots(NewRequest("x", prompt), computed=hit) == [[6]]
    assert not m.failed
    m.check_invariants()


@BOTH
def test_a_window_hit_stays_valid_when_the_cache_grows_after_the_lookup(kind):
    # The device once compared the hit with a longer lookup's, whose window
    # put the null block elsewhere, and called a valid hit stale.
    m = make(kind, num_blocks=40, windows=(None, 4))
    prompt = list(range(13))
    m.step(new=[NewRequest("a", prompt[:9])])
    hit = m.get_computed_blocks(NewRequest("x", prompt))
    assert hit.block_ids == [[1, 2], [0, 5]]
    m.step(new=[NewRequest("c", prompt)])  # now 3 blocks of the prefix are cached
    assert m.allocate_slots(NewRequest("x", prompt), computed=hit) == [[11, 12], [13, 14]]
    m.check_invariants()
