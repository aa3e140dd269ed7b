"""``gpukv.RunningBatch`` (``gpukv/core/running_batch.py``): a step's running requests as
arrays, ragged new tokens, chunks and lookahead per row, on both managers;
and what a step hands back with it (``block_ids``, ``prefix_of``:
``gpukv/device/outputs.py`` on the device), each against the reference and against
what the managers' own queries say afterwards.

The bad inputs are in ``tests/differential/test_catalogue.py`` (``batch-*``, ``step-*``).
"""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest

from gpukv.core import manager_base as shared_api
from gpukv.core.requests import NewRequest, RunningUpdate
from gpukv.core.running_batch import RunningBatch, prechecked_batch
from gpukv.device.manager import DeviceManager
from gpukv.errors import InvalidInputError
from gpukv.reference.manager import ReferenceManager
from workload import KEY, state_of


def managers(num_blocks=16, block_size=4, windows=(None,), max_model_len=64):
    return [cls(num_blocks, block_size, sliding_windows=list(windows), hash_key=KEY, max_model_len=max_model_len,
                uncached_first=False) for cls in (ReferenceManager, DeviceManager)]


# ---------------------------------------------------------------- hand-worked

def test_a_ragged_batch_with_chunks_and_lookahead_by_hand():
    # Block size 4, 15 usable blocks, free queue 1..15. "a" (6 tokens) takes
    # blocks 1, 2; "b" (4 tokens) block 3; "c" (9 tokens, a chunk of 5) 4, 5.
    for m in managers():
        res = m.step(new=[NewRequest("a", [1, 2, 3, 4, 5, 6]), NewRequest("b", [7, 8, 9, 10]),
                          NewRequest("c", list(range(20, 29)), num_tokens_to_compute=5)], block_ids=True)
        assert res.rows == [0, 1, 2]
        assert res.admitted_block_ids == [[[1, 2], [3], [4, 5]]]
        # "a" decodes one token (7 known, all computed: 2 blocks, none new);
        # "b" takes three draft tokens and 2 lookahead slots (7 computed + 2:
        # 3 blocks, 2 new); "c" continues its prefill by 3 tokens (8 of 9
        # computed: 2 blocks, none new) and appends nothing.
        batch = RunningBatch(res.rows, [30, 31, 32, 33], num_new_tokens=[1, 3, 0], num_tokens_to_compute=[1, 3, 3],
                             num_lookahead_tokens=[0, 2, 0])
        out = m.step(running=batch, block_ids=True, prefix_of="b")
        assert out.ok and out.running_block_ids == [[[], [6, 7], []]]
        assert m.get_block_ids("b") == [[3, 6, 7]]
        assert m.row_token_counts(res.rows)[0].tolist() == [7, 7, 9]
        assert m.row_token_counts(res.rows)[1].tolist() == [7, 7, 8]
        assert out.prefix_ref_counts == [[1, 1, 1]]
        assert out.num_common_prefix_blocks(1) == [3] and out.num_common_prefix_blocks(2) == [0]
        # The same work as RunningUpdates leaves the same state (a second pair).
        m.check_invariants()


def test_the_batch_and_the_updates_leave_the_same_state():
    forms = []
    for use_batch in (False, True):
        m = ReferenceManager(16, 4, hash_key=KEY, max_model_len=64, uncached_first=False)
        res = m.step(new=[NewRequest("a", [1, 2, 3, 4, 5, 6]), NewRequest("b", [7, 8, 9, 10])])
        if use_batch:
            m.step(running=RunningBatch(res.rows, [30, 31, 32, 33], num_new_tokens=[1, 3],
                                        num_lookahead_tokens=[0, 2]))
        else:
            m.step(running=[RunningUpdate("a", [30]), RunningUpdate("b", [31, 32, 33], None, 2)])
        forms.append((m.free_queue(), m.pool.ref_cnt, m.pool.table(), m.get_block_ids("a"), m.get_block_ids("b"),
                      m.row_token_counts(res.rows)[0].tolist()))
    assert forms[0] == forms[1]


def test_a_batch_that_does_not_fit_changes_no_later_row_and_admits_nothing():
    # 7 usable blocks of 2 tokens: "a" and "b" hold 2 blocks each (3 tokens),
    # 3 free. The batch grows "a" by 5 tokens (2 blocks) and "b" by 5 (2
    # blocks): "b" does not fit; the new request is not looked at.
    for m in managers(num_blocks=8, block_size=2):
        res = m.step(new=[NewRequest("a", [1, 2, 3]), NewRequest("b", [4, 5, 6])])
        before = m.get_block_ids("b"), m.free_queue()
        out = m.step(running=RunningBatch(res.rows, [7, 8, 9, 7, 8] * 2, num_new_tokens=[5, 5]),
                     new=[NewRequest("c", [1])], block_ids=True, prefix_of="a")
        assert out.running_failed_at == 1 and out.num_admitted == 0
        assert out.running_block_ids == [[m.get_block_ids("a")[0][2:]]] and out.admitted_block_ids == [[]]
        assert m.get_block_ids("b") == before[0] and len(m.free_queue()) == len(before[1]) - 2
        assert m.row_token_counts([res.rows[1]])[0].tolist() == [3]
        assert out.prefix_ref_counts == [[1, 1, 1, 1]]


def test_the_prefix_of_a_request_the_step_admits():
    # vLLM's first running request is the first one admitted when none ran.
    for m in managers():
        m.step(new=[NewRequest("a", [1, 2, 3, 4, 5])])
        m.step(finished=["a"])
        out = m.step(new=[NewRequest("b", [1, 2, 3, 4, 6]), NewRequest("c", [1, 2, 3, 4, 7])], prefix_of="b")
        assert out.num_computed_tokens == [4, 4]
        assert out.prefix_ref_counts == [[2, 1]] and out.num_common_prefix_blocks(2) == [1]
        refused = m.step(new=[NewRequest("d", list(range(200, 260)))], prefix_of="d")
        assert refused.num_admitted == 0 and refused.prefix_ref_counts is None
        with pytest.raises(ValueError, match="prefix_of"):
            refused.num_common_prefix_blocks(1)


# ---------------------------------------------------------------- one read

def test_the_device_reads_once_a_step_with_everything_it_hands_back():
    ref, dev = managers(num_blocks=64)
    for m in (ref, dev):
        m.step(new=[NewRequest(f"r{i}", list(range(10 * i, 10 * i + 7))) for i in range(4)], block_ids=True,
               prefix_of="r0")
    assert dev.counters.d2h == 1
    for k in range(3):  # decodes (token 8 crosses a block) with a finish and an admission each step
        finished = [f"r{k}"]
        live = [r for r in ref.request_ids() if r not in finished]
        new = [NewRequest(f"n{k}", [5, 6, 7, 8, 9])]
        outs = [m.step(finished, RunningBatch([m.row_of(r) for r in live], [k] * len(live)), new, block_ids=True,
                       prefix_of=live[0]) for m in (ref, dev)]
        assert outs[0] == outs[1] and outs[0].num_admitted == 1
        assert dev.counters.d2h == 1, k
    no_new = [m.step(running=RunningBatch([m.row_of("n2")], [1]), block_ids=True, prefix_of="n2") for m in (ref, dev)]
    assert no_new[0] == no_new[1] and dev.counters.d2h == 1


# ---------------------------------------------------------------- random sessions

def _batch_step(rng, m, held, next_id):
    """A random step in both forms: finished ids, a RunningBatch, the same
    as RunningUpdates, new requests, the prefix request."""
    ids = list(held)
    finished = [r for r in ids if rng.random() < 0.15]
    rows, tokens, counts, chunks, lookahead, updates = [], [], [], [], [], []
    for rid in ids:
        if rid in finished or rng.random() < 0.2:
            continue
        known, computed = (int(x[0]) for x in m.row_token_counts([m.row_of(rid)]))
        grow = known == computed or rng.random() < 0.5  # (a row mid-prefill may append nothing)
        add = [rng.randint(0, 2) for _ in range(rng.choice([1, 1, 3]))] if grow else []
        if known + len(add) > 56:
            continue
        chunk = rng.randint(1, known + len(add) - computed)
        la = rng.choice([0, 0, 3])
        rows.append(m.row_of(rid))
        tokens += add
        counts.append(len(add))
        chunks.append(chunk)
        lookahead.append(la)
        updates.append(RunningUpdate(rid, add, chunk, la))
    new = []
    for _ in range(rng.randint(0, 3)):
        n = rng.randint(1, 30)
        new.append(NewRequest(f"r{next_id}", [rng.randint(0, 2) for _ in range(n)],
                              num_tokens_to_compute=rng.choice([None, rng.randint(1, n)])))
        next_id += 1
    live = [r for r in ids if r not in finished]
    prefix = live[0] if live else (new[0].request_id if new else None)
    batch = RunningBatch(rows, tokens, num_new_tokens=counts, num_tokens_to_compute=chunks,
                         num_lookahead_tokens=lookahead)
    return finished, batch, updates, new, prefix, next_id


@pytest.mark.parametrize("windows", [(None,), (None, 8)], ids=["full", "window"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_batches_match_the_updates_and_the_device(seed, windows):
    """Three managers on the same random steps: the reference with
    RunningUpdates, the reference and the device manager with the same work
    as a RunningBatch and the outputs asked for; every result (outputs left
    aside for the first), block table, count and the free queue equal after
    every step, and the outputs equal what the managers say afterwards."""
    rng = random.Random(seed)
    by_updates, ref, dev = (cls(24, 4, sliding_windows=list(windows), hash_key=KEY, max_model_len=64,
                                uncached_first=False) for cls in (ReferenceManager, ReferenceManager, DeviceManager))
    next_id = 0
    for step in range(14):
        finished, batch, updates, new, prefix, next_id = _batch_step(rng, ref, ref.request_ids(), next_id)
        before = {rid: len(ref.get_block_ids(rid)[0]) for rid in ref.request_ids()}
        plain = by_updates.step(finished, updates, new)
        outs = [m.step(finished, batch, new, block_ids=True, prefix_of=prefix) for m in (ref, dev)]
        assert outs[0] == outs[1], step
        got = outs[0]
        assert (plain.running_failed_at, plain.num_admitted, plain.num_computed_tokens, plain.num_new_tokens,
                plain.rows) == (got.running_failed_at, got.num_admitted, got.num_computed_tokens, got.num_new_tokens,
                                got.rows), step
        for m in (by_updates, dev):
            assert m.free_queue() == ref.free_queue(), step
            for rid in ref.request_ids():
                assert m.get_block_ids(rid) == ref.get_block_ids(rid), (step, rid)
        fit = len(updates) if got.running_failed_at is None else got.running_failed_at
        for g in range(len(windows)):
            assert got.running_block_ids[g] == [ref.get_block_ids(u.request_id)[g][before[u.request_id]:]
                                                for u in updates[:fit]], step
            assert got.admitted_block_ids[g] == [ref.get_block_ids(r.request_id)[g] for r in new[: got.num_admitted]]
        if prefix is not None and prefix in ref.request_ids():
            for n in (1, 2, len(ref.request_ids())):
                assert got.num_common_prefix_blocks(n) == ref.get_num_common_prefix_blocks(prefix, n), step
        for m in (by_updates, ref, dev):
            m.check_invariants()


def test_a_known_block_that_fills_beyond_the_chunk_is_hashed_then():
    # Found with the batches above: a row appending tokens that fill a block
    # while its chunk computes none of that block skipped the hashing phase,
    # so the block was cached later under its row's stale digest slot.
    for m in managers(block_size=4):
        (row,) = m.step(new=[NewRequest("a", [1, 2])]).rows
        m.decode([row], [[3, 4, 5]], num_tokens_to_compute=[1])  # known 5 (block 0 full), computed 3
        m.decode([row], None, num_tokens_to_compute=[2])  # computed 5: block 0 cached now
        m.check_invariants()
        probe = m.get_computed_blocks(NewRequest("probe", [1, 2, 3, 4, 9]))
        assert probe.num_tokens == 4


def test_a_row_with_nothing_left_takes_a_chunk_of_0_and_its_lookahead_slots():
    # An async scheduler's row whose sampled token is still in flight: nothing
    # appended, every known token computed; it reserves 3 slots past its 6
    # tokens (9: a third block) beside a row that decodes a token.
    for m in managers():
        res = m.step(new=[NewRequest("a", [1, 2, 3, 4, 5, 6]), NewRequest("b", [7, 8, 9, 10])], block_ids=True)
        assert res.admitted_block_ids == [[[1, 2], [3]]]
        out = m.step(running=RunningBatch(res.rows, [11], num_new_tokens=[0, 1], num_tokens_to_compute=[0, 1],
                                          num_lookahead_tokens=[3, 0]), block_ids=True)
        assert out.running_block_ids == [[[4], [5]]]
        assert m.row_token_counts(res.rows)[1].tolist() == [6, 5]
        m.check_invariants()


def test_the_free_blocks_lower_bound_never_passes_the_free_blocks():
    # The reference's is exact; the device's is what its last read said less
    # what it has taken since (no read of its own).
    for m in managers():
        rows = m.step(new=[NewRequest("a", [1, 2, 3, 4, 5, 6]), NewRequest("b", [7, 8, 9, 10])]).rows
        assert m.free_blocks_lower_bound() == m.read_num_free_blocks() == 12
        m.decode(rows, [[11, 12, 13]] * 2)  # a: 9 tokens, 3 blocks; b: 7 tokens, 2 blocks
        assert m.free_blocks_lower_bound() == 10 == m.read_num_free_blocks()
        m.free("a")
        assert m.free_blocks_lower_bound() <= m.read_num_free_blocks() == 13
        m.check_invariants()


def _held_state(m: DeviceManager) -> tuple:
    """What a step that gives a request nothing must leave as it was: the
    pool (reference counts, free queue, hash table, cached blocks' records)
    and every request row (tokens, digests, extra keys, block tables, the
    host's counts)."""
    rows, counters = m._rows, m.pool.free_queue.counters  # (all of them, the last pop's count included)
    return (state_of(m.pool.ref_cnt), state_of(counters), m.free_queue(), m.pool.table_entries(),
            [state_of(getattr(m.pool.table, f)) for f in ("slot_lo", "slot_hi", "slot_group", "slot_block",
                                                           "block_slot", "block_seq", "counters")],
            [state_of(t) for t in (m.pool.blk_parent, m.pool.blk_tokens, m.pool.blk_extra)],
            [state_of(t) for t in (rows.tokens, rows.digests, rows.extras, rows.block_table, rows.lora)],
            [x.tolist() for x in (rows.num_tokens, rows.num_computed, rows.num_held, rows.null_until)])


@pytest.mark.parametrize("form", ["updates", "batch"])
def test_a_running_request_that_does_not_fit_changes_nothing(form):
    # A running update reported as not fitting writes none of its row's tokens
    # and digests and leaves the free queue's counters where they were.
    dev = managers(num_blocks=6, block_size=2)[1]  # 5 usable blocks
    dev.step(new=[NewRequest("a", [1, 2, 3]), NewRequest("b", [4, 5, 6])])  # 2 blocks each, 1 free
    before = _held_state(dev)
    if form == "updates":
        res = dev.step(running=[RunningUpdate("a", [7, 8, 9, 10])])  # 7 tokens: 2 more blocks
    else:
        res = dev.step(running=RunningBatch([dev.row_of("a")], [7, 8, 9, 10], num_new_tokens=[4]))
    assert res.running_failed_at == 0
    assert _held_state(dev) == before
    dev.check_invariants()


# ---------------------------------------------------------------- prechecked

def _prechecked_pair(m):
    """``m`` holding "a" (6 tokens) and "b" (4 tokens), and a prechecked
    batch built from its counts: "a" decodes one token, "b" three (a
    ragged pair), each computing all it knows."""
    res = m.step(new=[NewRequest("a", [1, 2, 3, 4, 5, 6]), NewRequest("b", [7, 8, 9, 10])])
    rows = np.array(res.rows, dtype=np.int64)
    known = m.row_token_counts(rows)[0]
    counts = np.array([1, 3], dtype=np.int64)
    return rows, prechecked_batch(rows, np.array([30, 31, 32, 33], dtype=np.int64), counts, known, counts,
                                  np.zeros(2, dtype=np.int64))


@pytest.mark.parametrize("kind", [0, 1], ids=["reference", "device"])
def test_a_prechecked_batch_is_taken_without_a_second_normalisation(kind, monkeypatch):
    m = managers()[kind]
    rows, batch = _prechecked_pair(m)

    def refused(*_args, **_kwargs):
        raise AssertionError("normalize_running ran on a prechecked batch")

    monkeypatch.setattr(shared_api, "normalize_running", refused)
    assert m.step(running=batch, block_ids=True).running_block_ids == [[[], [4]]]
    assert m.row_token_counts(rows)[0].tolist() == [7, 7]
    assert m.get_block_ids("b") == [[3, 4]]
    m.check_invariants()


@pytest.mark.parametrize("kind", [0, 1], ids=["reference", "device"])
@pytest.mark.parametrize("wrong", ["known", "row", "negative", "past the last", "twice", "token", "processed < 0",
                                   "processed past the known", "processed int32"])
def test_a_prechecked_batch_that_is_not_the_managers_changes_nothing(kind, wrong):
    m = managers()[kind]
    rows, batch = _prechecked_pair(m)
    run = batch.normalized
    argument = "running"
    if wrong == "known":  # built from stale counts: gpukv knows one token more of "a" than the batch says
        stale = replace(run, num_tokens=run.num_tokens - [1, 0])
        batch, match = replace(batch, normalized=stale), "known tokens are not the manager's"
    elif wrong == "row":  # a row no request holds
        batch, match = replace(batch, normalized=replace(run, rows=rows + [0, 5])), "row no running request holds"
    elif wrong in ("negative", "past the last"):  # a row outside the manager's rows
        outside = rows + ([0, -1000] if wrong == "negative" else [0, 10**6])
        batch, match = replace(batch, normalized=replace(run, rows=outside)), "row no running request holds"
    elif wrong == "twice":  # one row named twice ("a"'s, with "a"'s count)
        twice = replace(run, rows=rows[[0, 0]], num_tokens=run.num_tokens[[0, 0]])
        batch, match = replace(batch, normalized=twice), "names a row twice"
    elif wrong.startswith("processed"):  # a release behind tokens no row has, or not int64[B]
        processed = {"processed < 0": [-1, 0], "processed past the known": [7, 8], "processed int32": [1, 1]}[wrong]
        dtype = np.int32 if wrong == "processed int32" else np.int64
        batch = replace(batch, normalized=replace(run, processed=np.array(processed, dtype=dtype)))
        match = "processed tokens must be int64"
    else:  # a token id gpukv cannot hold (the adapter's screening bypassed): refused, whoever built the batch
        batch = prechecked_batch(rows, np.array([30, 31, -3, 33], dtype=np.int64), run.counts, run.num_tokens,
                                 run.counts, np.zeros(2, dtype=np.int64))
        match, argument = "outside", "new_token_ids"
    before = state_of(m)
    with pytest.raises(InvalidInputError, match=match) as err:
        m.step(running=batch)
    assert err.value.argument == argument
    assert state_of(m) == before
    assert m.row_token_counts(rows)[0].tolist() == [6, 4]
    m.check_invariants()


@pytest.mark.parametrize("kind", [0, 1], ids=["reference", "device"])
def test_a_prechecked_batchs_window_releases_behind_its_processed_tokens(kind):
    # A 5-token window, blocks of 4: 12 known tokens, "a" at 3 blocks. Behind 12 computed tokens the window
    # skips (12 - 4) // 4 = 2 blocks; behind 8 processed ones (4 in flight) only 1.
    m = managers(windows=(5,))[kind]
    res = m.step(new=[NewRequest("a", list(range(1, 13)))])
    rows = np.array(res.rows, dtype=np.int64)
    known = m.row_token_counts(rows)[0]
    one = np.ones(1, dtype=np.int64)
    batch = prechecked_batch(rows, np.array([50], dtype=np.int64), None, known, one, 0, np.array([8], np.int64))
    assert m.step(running=batch, block_ids=True).running_block_ids == [[[4]]]
    assert m.num_null_blocks("a") == (1,)
    assert m.get_block_ids("a") == [[0, 2, 3, 4]]
    m.check_invariants()


def _decode_batch_of_two(m, tokens: list[int]):
    """Two requests admitted on ``m`` ("a" with 6 tokens, "b" with 4), and a
    prechecked decode batch appending ``tokens`` (one a row, no counts)."""
    res = m.step(new=[NewRequest("a", [1, 2, 3, 4, 5, 6]), NewRequest("b", [7, 8, 9, 10])])
    rows = np.array(res.rows, dtype=np.int64)
    known = m.row_token_counts(rows)[0]
    return rows, prechecked_batch(rows, np.array(tokens, dtype=np.int64), None, known, np.ones(2, dtype=np.int64),
                                  np.zeros(2, dtype=np.int64))


@pytest.mark.parametrize("kind", [0, 1], ids=["reference", "device"])
def test_a_prechecked_decode_batch_has_one_token_a_row_and_no_counts(kind):
    # counts None: one token per row ([B, 1], as vLLM's decodes), the step as with counts of ones.
    m = managers()[kind]
    rows, batch = _decode_batch_of_two(m, [30, 31])
    assert batch.normalized.tokens.tolist() == [[30], [31]]
    assert batch.normalized.counts is None
    assert m.step(running=batch, block_ids=True).running_block_ids == [[[], [4]]]  # ("b"'s 5th token: a block)
    assert m.row_token_counts(rows)[0].tolist() == [7, 5]
    assert m.get_block_ids("b") == [[3, 4]]
    m.check_invariants()


@pytest.mark.parametrize("kind", [0, 1], ids=["reference", "device"])
def test_a_prechecked_decode_batch_with_a_token_out_of_range_changes_nothing(kind):
    m = managers()[kind]
    _, batch = _decode_batch_of_two(m, [30, 2**32])
    before = state_of(m)
    with pytest.raises(InvalidInputError, match="outside") as err:
        m.step(running=batch)
    assert err.value.argument == "new_token_ids"
    assert state_of(m) == before
    m.check_invariants()
