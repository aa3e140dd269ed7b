"""The device block-hash table (gpukv/kernels/hash_table.py) against a tiny
pure-Python multimap model: key -> blocks in insertion order, lookup = first.

On a machine without CUDA the kernels run under Triton's interpreter (programs
one after another, atomics lane by lane), so thread races are simulated with
the launcher's ``_lane_perm`` hook, and programs run out of order under
``GPUKV_PROGRAM_ORDER`` (``tests/helpers/program_order.py``); the ``gpu``-marked
tests run real races.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gpukv._runtime  # noqa: F401  (before triton: interpreter on CPU)
from gpukv.kernels import hash_table as ht

DEVICE = gpukv._runtime.default_device()
I32, I64 = torch.int32, torch.int64
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------


def _t(values, dtype, device=DEVICE):
    return torch.tensor(list(values), dtype=dtype, device=device)


def do_insert(table, entries, valid=None, **kw):
    """entries: [((lo, hi, group), block), ...] in batch order."""
    dev = table.device
    keys = [k for k, _ in entries]
    ht.insert(table, _t((k[0] for k in keys), I64, dev), _t((k[1] for k in keys), I64, dev),
              _t((k[2] for k in keys), I32, dev), _t((b for _, b in entries), I32, dev),
              None if valid is None else _t(valid, torch.bool, dev), **kw)


def do_find(table, keys, valid=None):
    dev = table.device
    out = ht.find_oldest(table, _t((k[0] for k in keys), I64, dev), _t((k[1] for k in keys), I64, dev),
                         _t((k[2] for k in keys), I32, dev),
                         None if valid is None else _t(valid, torch.bool, dev))
    return out.cpu().tolist()


def do_erase(table, blocks, valid=None):
    dev = table.device
    ht.erase(table, _t(blocks, I32, dev), None if valid is None else _t(valid, torch.bool, dev))


class Model:
    """The reference multimap (BlockPool._table, reduced to the table)."""

    def __init__(self):
        self.table: dict = {}
        self.key_of: dict = {}

    def insert(self, entries, valid=None):
        for i, (key, b) in enumerate(entries):
            if valid is None or valid[i]:
                assert b not in self.key_of
                self.table.setdefault(key, []).append(b)
                self.key_of[b] = key

    def erase(self, blocks, valid=None):
        for i, b in enumerate(blocks):
            if (valid is None or valid[i]) and b in self.key_of:
                key = self.key_of.pop(b)
                self.table[key].remove(b)
                if not self.table[key]:
                    del self.table[key]

    def find(self, keys, valid=None):
        return [self.table[k][0] if (valid is None or valid[i]) and k in self.table else -1
                for i, k in enumerate(keys)]

    def clear(self):
        self.table.clear()
        self.key_of.clear()


def assert_same(table, model):
    table.check_invariants()
    assert table.entries() == model.table
    assert table.read_counters()["errors"] == 0


# --------------------------------------------------------------------------
# hand cases
# --------------------------------------------------------------------------

A = (0x1234, -0x5678, 0)
B = (0x1234, -0x5678, 1)  # same digest as A, other group: another key


def test_create_layout():
    t = ht.HashTable.create(10, DEVICE)
    assert t.capacity == 32 and t.num_blocks == 10
    assert t.slot_block.dtype == I32 and t.slot_lo.dtype == I64 and t.slot_group.dtype == I32
    assert t.block_slot.shape == (10,) and t.block_seq.dtype == I64 and t.counters.shape == (4,)
    assert (t.slot_block == ht.EMPTY).all() and (t.block_slot == ht.NO_SLOT).all()
    assert (ht.EMPTY, ht.TOMBSTONE, ht.NO_SLOT) == (-1, -2, -1)
    assert ht.HashTable.create(16, DEVICE).capacity == 32
    with pytest.raises(ValueError):
        ht.HashTable.create(0, DEVICE)
    with pytest.raises(ValueError):
        ht.HashTable.create(4, DEVICE, capacity=12)


def test_duplicates_oldest_first_and_erase():
    t = ht.HashTable.create(8, DEVICE)
    do_insert(t, [(A, 5), (A, 2), (A, 7)])
    assert t.entries() == {A: [5, 2, 7]}
    assert do_find(t, [A]) == [5]
    do_erase(t, [5])
    assert do_find(t, [A]) == [2]
    do_erase(t, [2])
    assert do_find(t, [A]) == [7]
    do_erase(t, [7])
    assert do_find(t, [A]) == [-1]
    assert t.entries() == {}
    t.check_invariants()


def test_erase_middle_and_reinsert_order():
    t = ht.HashTable.create(8, DEVICE)
    do_insert(t, [(A, 1), (A, 2)])
    do_insert(t, [(A, 3)])
    do_erase(t, [2])  # a hole inside the key's run of slots
    do_insert(t, [(A, 4)])  # may reuse the hole: still the newest
    assert t.entries() == {A: [1, 3, 4]}
    do_erase(t, [1])
    assert do_find(t, [A]) == [3]
    t.check_invariants()


def test_groups_are_separate_keys():
    t = ht.HashTable.create(8, DEVICE)
    do_insert(t, [(A, 1), (B, 2), (A, 3)])
    assert do_find(t, [A, B]) == [1, 2]
    do_erase(t, [1])
    assert do_find(t, [A, B]) == [3, 2]
    assert t.entries() == {A: [3], B: [2]}


def test_absent_invalid_and_edge_keys():
    t = ht.HashTable.create(16, DEVICE)
    zero = (0, 0, 0)
    neg = (-1, -1, 0)
    ext = (INT64_MIN, INT64_MAX, 3)
    do_insert(t, [(zero, 0), (neg, 1), (ext, 2), ((0, 0, 2), 3)])
    assert do_find(t, [zero, neg, ext, (0, 0, 2), (0, 0, 1), (1, 0, 0), (INT64_MAX, INT64_MIN, 3)]) == \
        [0, 1, 2, 3, -1, -1, -1]
    assert do_find(t, [zero, neg], valid=[False, True]) == [-1, 1]
    t.check_invariants()


def test_insert_valid_flags_and_int_group():
    t = ht.HashTable.create(8, DEVICE)
    lo = _t([7, 7, 7, 8], I64)
    hi = _t([1, 1, 1, 1], I64)
    ht.insert(t, lo, hi, 2, _t([4, 5, 6, 7], I32), _t([0, 1, 1, 0], I32))
    assert t.entries() == {(7, 1, 2): [5, 6]}
    assert ht.find_oldest(t, lo, hi, 2).cpu().tolist() == [5, 5, 5, -1]
    assert t.read_counters()["next_seq"] == 2  # only valid entries take numbers


def test_strided_digest_views_and_out():
    t = ht.HashTable.create(8, DEVICE)
    digests = _t([10, -10, 11, -11, 10, -10], I64).view(3, 2)
    ht.insert(t, digests[:, 0], digests[:, 1], 0, _t([1, 2, 3], I32))
    assert t.entries() == {(10, -10, 0): [1, 3], (11, -11, 0): [2]}
    out = torch.full((3,), 99, dtype=I32, device=DEVICE)
    r = ht.find_oldest(t, digests[:, 0], digests[:, 1], _t([0, 0, 1], I32), out=out)
    assert r is out and out.cpu().tolist() == [1, 2, -1]


def test_clear():
    t = ht.HashTable.create(8, DEVICE)
    do_insert(t, [(A, 1), (B, 2), (A, 3)])
    do_erase(t, [2])
    ht.clear(t)
    assert t.entries() == {}
    assert do_find(t, [A, B]) == [-1, -1]
    c = t.read_counters()
    assert c["live"] == 0 and c["tombstones"] == 0
    t.check_invariants()
    do_insert(t, [(B, 1), (A, 2)])  # blocks can be cached again
    assert do_find(t, [A, B]) == [2, 1]
    t.check_invariants()


def test_erase_ignores_uncached_and_invalid():
    t = ht.HashTable.create(8, DEVICE)
    do_insert(t, [(A, 1), (A, 2)])
    do_erase(t, [3, 1, 2], valid=[True, False, True])
    assert t.entries() == {A: [1]}
    assert t.read_counters()["errors"] == 0
    t.check_invariants()


def test_error_flags():
    t = ht.HashTable.create(4, DEVICE)
    do_insert(t, [(A, 1)])
    do_insert(t, [(B, 1), (B, 2), (B, 2)])  # 1 already cached, 2 given twice
    assert t.read_counters()["errors"] == ht.ERR_DOUBLE_INSERT
    assert t.entries() == {A: [1], B: [2]}
    t.check_invariants()
    do_insert(t, [(B, 4), (B, -1)])
    do_erase(t, [9])
    assert t.read_counters()["errors"] == ht.ERR_DOUBLE_INSERT | ht.ERR_BAD_BLOCK
    assert t.entries() == {A: [1], B: [2]}
    ht.clear_errors(t)
    assert t.read_counters()["errors"] == 0
    t.check_invariants()


@pytest.mark.parametrize("tile", [None, 1])
def test_table_full_flag(tile):
    """Six blocks for four slots: four are cached, two dropped. Which four is
    a race (lanes, and with ``tile=1`` programs, claim slots in any order on a
    GPU; the interpreter's order gives the first four), so any four will do."""
    t = ht.HashTable.create(6, DEVICE, capacity=4)
    do_insert(t, [((i, 0, 0), i) for i in range(6)], **({} if tile is None else {"tile": tile}))
    c = t.read_counters()
    assert c["errors"] == ht.ERR_FULL and c["live"] == 4
    ent = t.entries()
    cached = sorted(b for bs in ent.values() for b in bs)
    assert len(cached) == 4 and ent == {(b, 0, 0): [b] for b in cached}
    t.check_invariants()
    # a full table (no EMPTY slot) still answers lookups by scanning it all
    assert do_find(t, [(i, 0, 0) for i in range(6)]) == [i if i in cached else -1 for i in range(6)]


# --------------------------------------------------------------------------
# contention: one launch, many entries on few keys
# --------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["batch", "shuffled", "reversed"])
def test_contention_order_is_batch_order(schedule):
    rng = random.Random(7)
    n_blocks, k = 512, 400
    keys = [(rng.getrandbits(64) - (1 << 63), rng.getrandbits(64) - (1 << 63), g % 2)
            for g in range(8)]
    blocks = rng.sample(range(n_blocks - 1), k)
    entries = [(keys[rng.randrange(len(keys))], b) for b in blocks]
    valid = [rng.random() < 0.9 for _ in range(k)]
    perm = list(range(k))
    if schedule == "shuffled":
        rng.shuffle(perm)
    elif schedule == "reversed":
        perm.reverse()
    t = ht.HashTable.create(n_blocks, DEVICE)
    first = [(keys[0], n_blocks - 1)]
    do_insert(t, first)  # cached before the batch: stays the oldest
    m = Model()
    m.insert(first)
    do_insert(t, entries, valid, _lane_perm=_t(perm, I32))
    m.insert(entries, valid)
    assert_same(t, m)
    # The schedule really scrambled placement: along some key's probe path
    # its blocks sit in another order than the batch order. (In batch order
    # nothing is promised either: programs and lanes race for the slots on a
    # GPU; only the interpreter's order places a key's blocks in batch order.)
    slot_of = t.block_slot.cpu().tolist()
    cap = t.capacity
    by_place = {key: sorted(bs, key=lambda b: (slot_of[b] - ht.home_slot(*key, cap)) % cap)
                for key, bs in m.table.items()}
    if schedule != "batch":
        assert by_place != m.table
    queries = keys + [(3, 3, 0), (3, 3, 1)]
    assert do_find(t, queries) == m.find(queries)


# --------------------------------------------------------------------------
# random batches against the model
# --------------------------------------------------------------------------

# Keys: edge values, one digest in two groups, and keys whose home slots
# collide in a 32-slot table (lo differing by a multiple of 32, hi = group = 0).
KEYS = [(0, 0, 0), (0, 0, 1), (-1, -1, 0), (INT64_MIN, INT64_MAX, 2),
        (5, 0, 0), (5 + 32, 0, 0), (5 + 64, 0, 0), (0x7F, -0x7F, 1)]
ABSENT = [(1, 2, 3), (5 + 96, 0, 0)]
N_BLOCKS = 16


@st.composite
def _ops(draw):
    return draw(st.lists(st.sampled_from(
        ["insert", "insert", "insert", "erase", "erase", "find", "clear", "rebuild", "maybe"]),
        min_size=1, max_size=10))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=_ops(), data=st.data())
def test_random_batches_match_model(ops, data):
    t = ht.HashTable.create(N_BLOCKS, DEVICE)
    m = Model()
    for op in ops:
        if op == "insert":
            free = [b for b in range(N_BLOCKS) if b not in m.key_of]
            if not free:
                continue
            blocks = data.draw(st.permutations(free))[: data.draw(st.integers(1, min(10, len(free))))]
            entries = [(data.draw(st.sampled_from(KEYS)), b) for b in blocks]
            valid = data.draw(st.lists(st.booleans(), min_size=len(blocks), max_size=len(blocks)))
            perm = data.draw(st.permutations(range(len(blocks))))
            do_insert(t, entries, valid, _lane_perm=_t(perm, I32), tile=4)
            m.insert(entries, valid)
        elif op == "erase":
            blocks = data.draw(st.lists(st.integers(0, N_BLOCKS - 1), min_size=1, max_size=10, unique=True))
            valid = data.draw(st.lists(st.booleans(), min_size=len(blocks), max_size=len(blocks)))
            do_erase(t, blocks, valid)
            m.erase(blocks, valid)
        elif op == "find":
            keys = data.draw(st.lists(st.sampled_from(KEYS + ABSENT), min_size=1, max_size=12))
            valid = data.draw(st.lists(st.booleans(), min_size=len(keys), max_size=len(keys)))
            assert do_find(t, keys, valid) == m.find(keys, valid)
        elif op == "clear":
            ht.clear(t)
            m.clear()
        elif op == "rebuild":
            ht.rebuild(t)
            assert t.read_counters()["tombstones"] == 0
        else:
            ht.maybe_rebuild(t, data.draw(st.integers(-1, 4)))
        assert_same(t, m)
    assert do_find(t, KEYS) == m.find(KEYS)


# --------------------------------------------------------------------------
# tombstones and rebuild
# --------------------------------------------------------------------------


@pytest.mark.parametrize("n, programs", [(64, None), (256, 1), (256, 3)])
def test_tombstone_pileup_then_maybe_rebuild(n, programs, monkeypatch):
    """With fewer rebuild programs than tiles (256 blocks: 512 slots, 4
    tiles), each program strides over several tiles; the result is the same."""
    if programs is not None:
        monkeypatch.setattr(ht, "_REBUILD_PROGRAMS", programs)
    rng = random.Random(3)
    t = ht.HashTable.create(n, DEVICE)  # 2n slots, threshold n / 2
    m = Model()
    keys = [(rng.getrandbits(63), -rng.getrandbits(63), rng.randrange(2)) for _ in range(12)]
    # Fill, then churn: erase some, insert fresh blocks, until tombstones pile
    # up past the default bar. How many a round leaves depends on where blocks
    # land, which depends on the order programs claim slots: loop until then.
    for rounds in range(1, 41):
        free = [b for b in range(n) if b not in m.key_of]
        entries = [(rng.choice(keys), b) for b in rng.sample(free, min(len(free), 24 * n // 64))]
        do_insert(t, entries)
        m.insert(entries)
        cached = list(m.key_of)
        gone = rng.sample(cached, len(cached) // 2)
        do_erase(t, gone)
        m.erase(gone)
        ht.maybe_rebuild(t, 10 ** 9)  # never: the launches exit at once
        assert_same(t, m)
        c = t.read_counters()
        if rounds >= 12 and c["tombstones"] > t.capacity // 4:
            break
    assert c["tombstones"] > t.capacity // 4, c
    before_slots = t.slot_block.clone()
    ht.maybe_rebuild(t, c["tombstones"])  # not above the bar: nothing moves
    assert torch.equal(t.slot_block, before_slots)
    before = t.entries()
    ht.maybe_rebuild(t)  # default bar: capacity // 4
    c2 = t.read_counters()
    assert c2["tombstones"] == 0 and c2["live"] == c["live"] and c2["next_seq"] == c["next_seq"]
    assert t.entries() == before == m.table  # same blocks, same order per key
    assert_same(t, m)
    assert do_find(t, keys) == m.find(keys)
    # the table keeps working after the rebuild
    free = [b for b in range(n) if b not in m.key_of][:5]
    entries = [(keys[0], b) for b in free]
    do_insert(t, entries)
    m.insert(entries)
    assert_same(t, m)
    assert do_find(t, keys) == m.find(keys)


def test_erase_before_empty_leaves_no_tombstone():
    t = ht.HashTable.create(8, DEVICE)
    do_insert(t, [(A, 1)])
    do_erase(t, [1])  # its next slot is EMPTY: the slot becomes EMPTY again
    assert t.read_counters()["tombstones"] == 0
    t.check_invariants()


# --------------------------------------------------------------------------
# CUDA: real races (deselected by default; run with -m gpu on a GPU machine)
# --------------------------------------------------------------------------


def _gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return torch.device("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("n_keys", [10, 1000])
def test_gpu_many_inserts_one_launch(n_keys):
    dev = _gpu()
    k = 100_000
    g = torch.Generator(device="cpu").manual_seed(n_keys)
    key_lo = torch.randint(INT64_MIN, INT64_MAX, (n_keys,), dtype=I64, generator=g)
    key_hi = torch.randint(INT64_MIN, INT64_MAX, (n_keys,), dtype=I64, generator=g)
    which = torch.randint(0, n_keys, (k,), generator=g)
    blocks = torch.randperm(k, generator=g).to(I32)
    valid = torch.rand(k, generator=g) < 0.95
    t = ht.HashTable.create(k, dev)
    args = [x.to(dev) for x in (key_lo[which], key_hi[which], blocks, valid, key_lo, key_hi)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # the launchers never sync
    try:
        ht.insert(t, args[0], args[1], 0, args[2], args[3])
        found = ht.find_oldest(t, args[4], args[5], 0)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    expect: dict = {}
    for i in range(k):
        if valid[i]:
            expect.setdefault((int(key_lo[which[i]]), int(key_hi[which[i]]), 0), []).append(int(blocks[i]))
    assert t.read_counters()["errors"] == 0
    assert t.entries() == expect
    first = [expect.get((int(a), int(b), 0), [-1])[0] for a, b in zip(key_lo, key_hi, strict=True)]
    assert found.cpu().tolist() == first
    t.check_invariants()


@pytest.mark.gpu
def test_gpu_random_steps_match_model():
    dev = _gpu()
    rng = random.Random(11)
    n = 4096
    t = ht.HashTable.create(n, dev)
    m = Model()
    keys = [(rng.getrandbits(64) - (1 << 63), rng.getrandbits(64) - (1 << 63), rng.randrange(3))
            for _ in range(300)]
    for step in range(60):
        free = [b for b in range(n) if b not in m.key_of]
        entries = [(rng.choice(keys), b) for b in rng.sample(free, min(len(free), rng.randrange(1, 400)))]
        valid = [rng.random() < 0.9 for _ in entries]
        gone = rng.sample(range(n), rng.randrange(1, 300))
        ins = (_t((k[0] for k, _ in entries), I64, dev), _t((k[1] for k, _ in entries), I64, dev),
               _t((k[2] for k, _ in entries), I32, dev), _t((b for _, b in entries), I32, dev),
               _t(valid, torch.bool, dev))
        er = _t(gone, I32, dev)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # the launchers never sync
        try:
            ht.insert(t, *ins)
            m.insert(entries, valid)
            ht.erase(t, er)
            m.erase(gone)
            ht.maybe_rebuild(t)
            if step == 40:
                ht.clear(t)
                m.clear()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert do_find(t, keys) == m.find(keys)
        if step % 10 == 9:
            assert_same(t, m)
    assert_same(t, m)
