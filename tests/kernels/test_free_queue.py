"""The device free queue (gpukv/kernels/free_queue.py) against a pure-Python
OrderedDict model of the same semantics (the reference pool's free queue)."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gpukv._runtime  # noqa: F401  (before triton: interpreter on CPU)
from gpukv.kernels import free_queue as fq
from gpukv.kernels import toolkit

DEVICE = gpukv._runtime.default_device()
BACK, FRONT, SKIP = fq.WHERE_BACK, fq.WHERE_FRONT, fq.WHERE_SKIP


def i32(xs) -> torch.Tensor:
    return torch.tensor(list(xs), dtype=torch.int32, device=DEVICE)


def i64(xs) -> torch.Tensor:
    return torch.tensor(list(xs), dtype=torch.int64, device=DEVICE)


def make(n: int, *, tile: int = 4, capacity=None) -> fq.FreeQueue:
    return fq.FreeQueue.create(n, DEVICE, tile=tile, capacity=capacity)


def do_pop(q: fq.FreeQueue, k: int, m: int | None = None) -> list[int]:
    m = k if m is None else m
    before = q.counter_values()["last_pop"]
    out = fq.pop(q, i64([k]), torch.empty(m, dtype=torch.int32, device=DEVICE))
    got = out.tolist()
    n = q.counter_values()["last_pop"]
    if k == 0:  # a pop of none changes no counter, the last pop's count included
        assert n == before
        n = 0
    assert all(b == -1 for b in got[n:]), f"out[{n}:] not padded with -1: {got}"
    return got[:n]


class Model:
    """The free queue as the reference keeps it: an OrderedDict of block ids."""

    def __init__(self, n: int) -> None:
        self.q: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, n))

    def remove(self, blocks) -> None:
        for b in blocks:
            self.q.pop(b, None)

    def pop(self, k: int) -> list[int]:
        return [self.q.popitem(last=False)[0] for _ in range(min(k, len(self.q)))]

    def push(self, blocks, where, call) -> None:
        """Call by call (runs of equal ids): back-goers appended in entry order,
        then the call's front-goers prepended as a group in entry order."""
        i = 0
        while i < len(blocks):
            j = i
            while j < len(blocks) and call[j] == call[i]:
                j += 1
            front = []
            for b, w in zip(blocks[i:j], where[i:j], strict=True):
                if w == BACK:
                    self.q[b] = None
                elif w == FRONT:
                    front.append(b)
            for b in reversed(front):
                self.q[b] = None
                self.q.move_to_end(b, last=False)
            i = j

    def order(self) -> list[int]:
        return list(self.q)


# --------------------------------------------------------------------------
# Hand cases
# --------------------------------------------------------------------------


def test_initial_order_and_layout():
    q = make(10)
    assert q.capacity == 32 and q.ring.dtype == torch.int32 and q.pos.dtype == torch.int64
    assert q.counters.shape == (fq.NUM_COUNTERS,)
    assert q.to_list() == list(range(1, 10))
    assert q.read_num_free() == 9
    c = q.counter_values()
    assert c["head"] == fq.BASE and c["tail"] == fq.BASE + 9 and c["num_tomb"] == 0
    view = q.counter("num_free")  # a device view, live
    assert view.tolist() == [9] and fq.COUNTER_SLOTS["num_free"] == int(fq.NUM_FREE)
    fq.remove(q, i32([4]))
    assert view.tolist() == [8]
    q.check_invariants()


def test_pop_three_then_rest():
    q = make(10)
    out = fq.pop(q, i32([3]), max_count=5)
    assert out.tolist() == [1, 2, 3, -1, -1]
    assert q.to_list() == list(range(4, 10))
    assert q.pos[1:4].tolist() == [-1, -1, -1]
    q.check_invariants()
    assert do_pop(q, 6, m=8) == list(range(4, 10))
    assert q.to_list() == [] and q.read_num_free() == 0
    q.check_invariants()


def test_pop_zero_and_host_int_count():
    q = make(6)
    assert fq.pop(q, 0, max_count=3).tolist() == [-1, -1, -1]
    assert fq.pop(q, 2, max_count=2).tolist() == [1, 2]
    assert q.to_list() == [3, 4, 5]
    q.check_invariants()


def test_remove_middle_then_pop_skips_it():
    q = make(10)
    fq.remove(q, i32([4, 2]))
    assert q.to_list() == [1, 3, 5, 6, 7, 8, 9]
    assert q.counter_values()["num_tomb"] == 2
    q.check_invariants()
    assert do_pop(q, 3) == [1, 3, 5]
    c = q.counter_values()
    assert c["num_tomb"] == 0 and c["head"] == fq.BASE + 5  # passed the tombstones
    q.check_invariants()


def test_remove_duplicates_absent_null_and_padding():
    q = make(12, tile=2)
    do_pop(q, 2)  # 1, 2 leave the queue
    fq.remove(q, i32([5, 5, 0, -1, 1, 7, 5, 7, 2]))
    assert q.to_list() == [3, 4, 6, 8, 9, 10, 11]
    c = q.counter_values()
    assert c["num_free"] == 7 and c["num_tomb"] == 2 and c["error"] == 0
    q.check_invariants()


def test_remove_valid_mask_and_device_count():
    q = make(10)
    fq.remove(q, i32([2, 3, 4, 5]), torch.tensor([True, False, True, True], device=DEVICE),
              count=i32([3]))
    assert q.to_list() == [1, 3, 5, 6, 7, 8, 9]
    fq.remove(q, i32([6, 7]), i32([0, 1]))
    assert q.to_list() == [1, 3, 5, 6, 8, 9]
    q.check_invariants()


def test_remove_bad_id_sets_flag():
    q = make(6)
    fq.remove(q, i32([6, 3]))
    assert q.read_error_flags() == fq.ERR_BAD_BLOCK
    assert q.to_list() == [1, 2, 4, 5]
    q.check_invariants(allow_errors=True)


def test_push_two_calls_back_and_front():
    q = make(12)
    held = do_pop(q, 10)  # the queue is [11]
    assert held == list(range(1, 11))
    fq.push(q, i32([7, 5, 6, 9, 8]), i32([FRONT, BACK, FRONT, FRONT, BACK]), i32([0, 0, 0, 1, 1]))
    assert q.to_list() == [9, 7, 6, 11, 5, 8]
    q.check_invariants()


def test_push_example_against_old_queue():
    # call 0: [7 front, 5 back, 6 front], call 1: [9 front, 8 back]
    q = make(14)
    fq.remove(q, i32([5, 6, 7, 8, 9]))
    old = q.to_list()
    fq.push(q, i32([7, 5, 6, 9, 8]), i32([2, 1, 2, 2, 1]), i64([0, 0, 0, 1, 1]))
    assert q.to_list() == [9, 7, 6] + old + [5, 8]
    q.check_invariants()


def test_push_single_call_skip_entries_and_int8_where():
    q = make(10)
    do_pop(q, 6)  # queue [7, 8, 9]
    where = torch.tensor([FRONT, SKIP, BACK, FRONT, SKIP], dtype=torch.int8, device=DEVICE)
    fq.push(q, i32([3, 8, 1, 5, 9]), where)  # the skipped 8 and 9 are in the queue: untouched
    assert q.to_list() == [3, 5, 7, 8, 9, 1]
    q.check_invariants()


def test_push_front_groups_across_tiles_and_calls():
    n = 40
    q = make(n, tile=2)
    blocks = do_pop(q, n - 1)
    where = [FRONT if b % 3 else BACK for b in blocks]
    call = [b // 7 for b in blocks]
    fq.push(q, i32(blocks), i32(where), i32(call))
    m = Model(n)
    m.pop(n - 1)
    m.push(blocks, where, call)
    assert q.to_list() == m.order()
    q.check_invariants()


def test_push_present_block_sets_flag_and_keeps_it_in_place():
    q = make(8)
    do_pop(q, 2)  # [3..7]
    fq.push(q, i32([1, 4, 2]), i32([FRONT, BACK, BACK]))
    assert q.read_error_flags() == fq.ERR_PRESENT
    assert q.to_list() == [1, 3, 4, 5, 6, 7, 2]
    q.check_invariants(allow_errors=True)
    q.clear_errors()
    fq.push(q, i32([0, 8, -3]), i32([BACK, FRONT, BACK]))
    assert q.read_error_flags() == fq.ERR_BAD_BLOCK
    assert q.to_list() == [1, 3, 4, 5, 6, 7, 2]
    q.check_invariants(allow_errors=True)


def test_pop_more_than_free_sets_flag_and_pops_what_there_is():
    q = make(6)
    fq.remove(q, i32([2]))
    assert do_pop(q, 7, m=7) == [1, 3, 4, 5]
    c = q.counter_values()
    assert c["error"] == fq.ERR_SHORT and c["last_pop"] == 4 and c["num_free"] == 0
    q.check_invariants(allow_errors=True)
    q.clear_errors()
    q2 = make(6)
    assert do_pop(q2, 4, m=2) == [1, 2]  # out too short: also a short pop
    assert q2.read_error_flags() == fq.ERR_SHORT and q2.to_list() == [3, 4, 5]


def test_input_validation():
    q = make(6)
    with pytest.raises(ValueError):
        fq.remove(q, torch.tensor([1], dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError):
        fq.push(q, i32([1]), i32([1, 2]))
    with pytest.raises(ValueError):
        fq.pop(q, i32([1]))  # neither out nor max_count
    with pytest.raises(ValueError):
        fq.pop(q, i32([1, 2]), max_count=2)
    with pytest.raises(ValueError):
        fq.FreeQueue.create(8, DEVICE, capacity=8)
    with pytest.raises(ValueError):
        fq.FreeQueue.create(1, DEVICE)
    with pytest.raises(ValueError):
        fq.FreeQueue.create(8, DEVICE, tile=3)


# --------------------------------------------------------------------------
# Compaction
# --------------------------------------------------------------------------


def test_compact_keeps_order():
    q = make(30, tile=4)
    fq.remove(q, i32(range(2, 30, 3)))
    do_pop(q, 2)
    before = q.to_list()
    fq.compact(q)
    c = q.counter_values()
    assert q.to_list() == before
    assert c["num_tomb"] == 0 and c["tail"] - c["head"] == len(before) and c["compactions"] == 1
    q.check_invariants()
    assert do_pop(q, 5) == before[:5]
    q.check_invariants()


def test_maybe_compact_is_a_device_side_no_op_unless_needed():
    q = make(16)
    fq.remove(q, i32([3, 5, 7]))
    snap = (q.ring.clone(), q.pos.clone(), q.counters.clone())
    fq.maybe_compact(q, incoming=4)  # window 15 + 4 <= 32, 3 tombstones <= 16
    assert torch.equal(q.ring, snap[0]) and torch.equal(q.pos, snap[1])
    assert torch.equal(q.counters, snap[2])
    before = q.to_list()
    fq.maybe_compact(q, incoming=20)  # 15 + 20 > 32
    assert q.counter_values()["compactions"] == 1 and q.to_list() == before
    q.check_invariants()
    fq.remove(q, i32([9, 10]))
    fq.maybe_compact(q, tomb_limit=1)
    c = q.counter_values()
    assert c["compactions"] == 2 and c["num_tomb"] == 0 and q.to_list() == [b for b in before if b not in (9, 10)]
    q.check_invariants()


def test_push_compacts_by_itself_and_head_stays_bounded():
    # Each round pops the front block and prepends it again, and takes two
    # blocks out of the middle and pushes them back (front, back): two new
    # tombstones per round, so pushes must compact (and re-base) again and again.
    n = 9
    q = make(n, tile=4)
    cap = q.capacity
    m = Model(n)
    for r in range(40):
        b = do_pop(q, 1)
        assert b == m.pop(1)
        order = m.order()
        victims = [order[r % len(order)], order[(r + 3) % len(order)]]
        fq.remove(q, i32(victims))
        m.remove(victims)
        entries = b + victims
        where = [FRONT, FRONT, FRONT] if r % 2 else [BACK, FRONT, BACK]  # head drifts down
        call = [0, 1, 1]
        fq.push(q, i32(entries), i32(where), i32(call))
        m.push(entries, where, call)
        assert q.to_list() == m.order()
    c = q.counter_values()
    assert c["compactions"] >= 3
    assert fq.BASE - cap <= c["head"] < fq.BASE + 2 * cap  # re-based, not drifting
    q.check_invariants()


# --------------------------------------------------------------------------
# Random sequences against the model
# --------------------------------------------------------------------------


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_batches_match_model(data):
    n = data.draw(st.integers(2, 24), label="num_blocks")
    tile = data.draw(st.sampled_from([1, 2, 4, 16]), label="tile")
    cap = data.draw(st.sampled_from([None, 4]), label="capacity")
    cap = None if cap is None else toolkit.pow2_at_least(2 * n) * cap
    q = make(n, tile=tile, capacity=cap)
    m = Model(n)
    for _ in range(data.draw(st.integers(1, 8), label="batches")):
        op = data.draw(st.sampled_from(["remove", "pop", "push", "push", "compact"]), label="op")
        if op == "remove":
            ids = data.draw(st.lists(st.integers(-1, n - 1), max_size=10), label="ids")
            fq.remove(q, i32(ids))
            m.remove(ids)
        elif op == "pop":
            k = data.draw(st.integers(0, len(m.q)), label="k")
            extra = data.draw(st.integers(0, 3), label="slack")
            assert do_pop(q, k, m=k + extra) == m.pop(k)
        elif op == "push":
            held = sorted(set(range(1, n)) - set(m.q))
            blocks = data.draw(st.permutations(held), label="order")
            blocks = blocks[: data.draw(st.integers(0, len(blocks)), label="e")]
            where = [data.draw(st.sampled_from([BACK, FRONT, FRONT, SKIP]), label="where") for _ in blocks]
            # a few skipped entries naming blocks that are in the queue
            extra = data.draw(st.lists(st.sampled_from(list(m.q) or [0]), max_size=2), label="skipped")
            for b in extra:
                at = data.draw(st.integers(0, len(blocks)), label="at")
                blocks = blocks[:at] + [b] + blocks[at:]
                where = where[:at] + [SKIP] + where[at:]
            steps = [data.draw(st.integers(0, 1), label="step") for _ in blocks]
            call = [sum(steps[: i + 1]) for i in range(len(blocks))]
            fq.push(q, i32(blocks), i32(where), i32(call))
            m.push(blocks, where, call)
        else:
            if data.draw(st.booleans(), label="force"):
                fq.compact(q)
            else:
                fq.maybe_compact(q, incoming=data.draw(st.integers(0, 2 * n), label="incoming"),
                                 tomb_limit=data.draw(st.integers(0, n), label="limit"))
        assert q.to_list() == m.order()
        q.check_invariants()


# --------------------------------------------------------------------------
# CUDA: big queues, contention, determinism
# --------------------------------------------------------------------------


def _big_sequence(n: int, seed: int, rounds: int, dev: torch.device, hot: int = 64,
                  dups: int = 20_000) -> fq.FreeQueue:
    """One seeded random sequence on ``dev`` checked against the model after
    every round: removes with heavy duplication of a few hot blocks (spread
    over many programs), a pop, a push of every held block, maybe_compact."""
    g = torch.Generator().manual_seed(seed)
    q = fq.FreeQueue.create(n, dev)
    m = Model(n)
    for _ in range(rounds):
        hot_ids = torch.randint(1, n, (hot,), generator=g)
        ids = hot_ids[torch.randint(0, hot, (dups,), generator=g)].to(torch.int32)
        fq.remove(q, ids.to(dev))
        m.remove(hot_ids.tolist())
        k = int(torch.randint(0, len(m.q) + 1, (1,), generator=g))
        out = fq.pop(q, torch.tensor([k], device=dev), max_count=n)
        assert out[:k].tolist() == m.pop(k)
        held = sorted(set(range(1, n)) - set(m.q))
        blocks = [held[i] for i in torch.randperm(len(held), generator=g).tolist()]
        where = torch.randint(0, 3, (len(blocks),), generator=g).tolist()
        call = torch.cumsum(torch.randint(0, 2, (len(blocks),), generator=g), 0).tolist()
        fq.push(q, torch.tensor(blocks, dtype=torch.int32, device=dev),
                torch.tensor(where, dtype=torch.int32, device=dev),
                torch.tensor(call, dtype=torch.int32, device=dev))
        m.push(blocks, where, call)
        fq.maybe_compact(q)
        assert q.to_list() == m.order()
    q.check_invariants()
    return q


def _big_compaction(n: int, rounds: int, dev: torch.device) -> fq.FreeQueue:
    """Remove a random half of the queue and push it back, round after round:
    tombstones pile up until pushes must compact."""
    g = torch.Generator().manual_seed(7)
    q = fq.FreeQueue.create(n, dev)
    m = Model(n)
    for _ in range(rounds):
        live = m.order()
        take = [live[i] for i in torch.randperm(len(live), generator=g)[: len(live) // 2].tolist()]
        fq.remove(q, torch.tensor(take, dtype=torch.int32, device=dev))
        m.remove(take)
        where = torch.randint(1, 3, (len(take),), generator=g).tolist()
        call = (torch.arange(len(take)) // 1000).tolist()
        fq.push(q, torch.tensor(take, dtype=torch.int32, device=dev),
                torch.tensor(where, dtype=torch.int32, device=dev),
                torch.tensor(call, dtype=torch.int32, device=dev))
        m.push(take, where, call)
        assert q.to_list() == m.order()
    assert q.counter_values()["compactions"] >= 1
    q.check_invariants()
    return q


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_contention_matches_model_and_is_deterministic():
    dev = torch.device("cuda")
    a = _big_sequence(50_000, seed=1, rounds=6, dev=dev)
    b = _big_sequence(50_000, seed=1, rounds=6, dev=dev)
    assert torch.equal(a.ring, b.ring) and torch.equal(a.pos, b.pos)
    assert torch.equal(a.counters, b.counters)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_pushes_compact_big_queues():
    q = _big_compaction(100_000, rounds=5, dev=torch.device("cuda"))  # checks the order against the model
    assert q.counter_values()["compactions"] >= 1 and q.read_error_flags() == 0
