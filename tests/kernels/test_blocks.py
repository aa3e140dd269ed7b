"""Block kernels: release order, touch, allocate/place, record, by hand."""

import torch

import gpukv._runtime  # noqa: F401
from gpukv.kernels import blocks
from gpukv.kernels import free_queue as fq_ops
from gpukv.kernels import hash_table as table_ops

i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731


def setup(num_blocks=8, rows=2, M=4):
    fq = fq_ops.FreeQueue.create(num_blocks, "cpu")
    table = table_ops.HashTable.create(num_blocks, "cpu")
    ref = torch.zeros(num_blocks, dtype=torch.int32)
    bt = torch.zeros(1, rows, M, dtype=torch.int32)
    return fq, table, ref, bt


def test_allocate_places_popped_blocks_in_entry_order():
    fq, table, ref, bt = setup()
    want = i32([1, 0, 1, 1])
    blocks.allocate(torch.tensor([3]), want, i32([0, 0, 0, 0]), i32([0, 0, 1, 1]), i32([0, 1, 0, 1]),
                    block_table=bt, ref_cnt=ref, fq=fq, table=table, evictions=torch.zeros(1, dtype=torch.int64))
    assert bt[0].tolist() == [[1, 0, 0, 0], [2, 3, 0, 0]]
    assert ref.tolist() == [0, 1, 1, 1, 0, 0, 0, 0]
    assert fq.to_list() == [4, 5, 6, 7]


def test_release_uses_the_last_occurrence_and_sends_cached_back_uncached_front():
    fq, table, ref, bt = setup()
    ev = torch.zeros(1, dtype=torch.int64)
    # Row 0 holds [1, 2], row 1 holds [1, 3]: block 1 is shared.
    blocks.allocate(torch.tensor([3]), i32([1, 1, 1]), i32([0, 0, 0]), i32([0, 0, 1]), i32([0, 1, 1]),
                    block_table=bt, ref_cnt=ref, fq=fq, table=table, evictions=ev)
    bt[0, 1, 0] = 1
    ref[1] += 1
    # Block 2 is cached.
    table_ops.insert(table, torch.tensor([5]), torch.tensor([6]), 0, i32([2]), i32([1]))
    last = torch.full((8,), -1, dtype=torch.int64)
    # Free row 0 (tail first: 2, 1) as call 0, then row 1 (3, 1) as call 1.
    blocks.release(bt, i32([0, 0, 0, 0]), i32([0, 0, 1, 1]), i32([1, 0, 1, 0]), i32([0, 0, 1, 1]),
                   ref_cnt=ref, last_seen=last, fq=fq, table=table, uncached_first=True)
    # Call 0: 2 (cached) to the back; 1 still held. Call 1: 3 (uncached) and 1
    # (uncached, now free) to the front, in that order.
    assert fq.to_list() == [3, 1, 4, 5, 6, 7, 2]
    assert ref.tolist() == [0] * 8
    fq.check_invariants()


def test_touch_takes_free_blocks_out_once_and_counts_every_hit():
    fq, table, ref, bt = setup()
    blocks.touch(i32([4, 4, 6, 0]), i32([1, 1, 1, 1]), ref_cnt=ref, fq=fq)
    assert ref.tolist() == [0, 0, 0, 0, 2, 0, 1, 0]
    assert fq.to_list() == [1, 2, 3, 5, 7]
    assert fq.read_error_flags() == 0


def test_touch_across_programs_takes_each_free_block_out_once_where_its_count_left_0():
    """600 entries (three programs of 256): the free blocks 1..199 hit two or
    three times (entries far apart, in different programs), the held blocks
    200..219 once more (never queued), the null block and padding, invalid
    entries: each block's count grows by its valid entries, each block that
    was free leaves the queue exactly once, the rest keep their order."""
    N = 1024
    fq, table, ref, bt = setup(num_blocks=N)
    fq_ops.remove(fq, i32(list(range(200, 220))))  # held: out of the queue, count 1
    ref[200:220] = 1
    ids = list(range(1, 200)) * 2 + list(range(200, 220)) + [0, -1] + list(range(1, 181))
    valid = [1] * len(ids)
    valid[0] = 0  # block 1's first entry does not count (its two others do)
    valid[400] = 0  # nor held block 202's
    blocks.touch(i32(ids), i32(valid), ref_cnt=ref, fq=fq)
    want = [0] * N
    want[200:220] = [1] * 20
    for b, v in zip(ids, valid, strict=True):
        if v and b > 0:
            want[b] += 1
    assert len(ids) == 600 and want[1] == 2 and want[2] == 3 and want[199] == 2 and want[202] == 1
    assert ref.tolist() == want
    assert fq.to_list() == list(range(220, N))
    fq.check_invariants()


def test_touch_flags_a_block_id_outside_the_pool_and_counts_nothing_for_it():
    """Ids 8 and 100 in a pool of 8: flagged, and no count written past the
    pool's (the counts are the head of a larger tensor here, whose tail must
    stay 0)."""
    fq, table, _, bt = setup()
    counts = torch.zeros(128, dtype=torch.int32)
    ref = counts[:8]
    blocks.touch(i32([3, 8, 100]), i32([1, 1, 1]), ref_cnt=ref, fq=fq)
    assert ref.tolist() == [0, 0, 0, 1, 0, 0, 0, 0]
    assert not counts[8:].any()
    assert fq.to_list() == [1, 2, 4, 5, 6, 7]
    assert fq.read_error_flags() == fq_ops._BAD
    fq.check_invariants(allow_errors=True)


def test_allocate_evicts_cached_blocks_it_pops():
    fq, table, ref, bt = setup()
    table_ops.insert(table, torch.tensor([1, 2]), torch.tensor([1, 2]), 0, i32([1, 3]), i32([1, 1]))
    ev = torch.zeros(1, dtype=torch.int64)
    blocks.allocate(torch.tensor([2]), i32([1, 1]), i32([0, 0]), i32([0, 0]), i32([0, 1]),
                    block_table=bt, ref_cnt=ref, fq=fq, table=table, evictions=ev)
    assert ev.tolist() == [1]
    assert list(table.entries().values()) == [[3]]


def test_allocate_erases_the_popped_blocks_hashes_as_it_places_them_across_programs():
    """The place kernel erases each placed block's table entry (the pop's
    evictions): 600 wanted entries among 800 (three programs of 256), the
    first 600 free blocks popped, 1..700 cached before."""
    N, E = 1024, 800
    fq, table, ref, bt = setup(num_blocks=N, rows=8, M=100)
    cached = torch.arange(1, 701, dtype=torch.int32)
    keys = cached.to(torch.int64) * 7919
    table_ops.insert(table, keys, keys + 1, 0, cached, torch.ones(700, dtype=torch.int32))
    want = (torch.arange(E) % 4 != 3).to(torch.int32)
    e = torch.arange(E, dtype=torch.int32)
    ev = torch.zeros(1, dtype=torch.int64)
    blocks.allocate(torch.tensor([600]), want, torch.zeros(E, dtype=torch.int32), e // 100, e % 100,
                    block_table=bt, ref_cnt=ref, fq=fq, table=table, evictions=ev)
    assert ev.tolist() == [600]
    assert sorted(b for blks in table.entries().values() for b in blks) == list(range(601, 701))
    table.check_invariants()
    placed = bt[0].reshape(-1)[want.bool()]
    assert placed.tolist() == list(range(1, 601))  # in entry order
    assert bt[0].reshape(-1)[~want.bool()].tolist() == [0] * 200
    assert ref[1:601].tolist() == [1] * 600 and ref[601:].tolist() == [0] * (N - 601)
    assert fq.to_list() == list(range(601, N))


def test_record_copies_inputs_and_inserts_in_order():
    fq, table, ref, bt = setup()
    bt[0, 0, :2] = i32([5, 6])
    tokens = torch.tensor([[1, 2, 3, 4, 0, 0, 0, 0], [0] * 8], dtype=torch.int32)
    digests = torch.zeros(2, 4, 2, dtype=torch.int64)
    digests[0, 0] = torch.tensor([7, 7])
    digests[0, 1] = torch.tensor([8, 8])
    extras = torch.zeros(2, 4, 2, dtype=torch.int64)
    blk_tokens = torch.zeros(8, 2, dtype=torch.int32)
    blk_parent = torch.zeros(8, 2, dtype=torch.int64)
    blk_extra = torch.zeros(8, 2, dtype=torch.int64)
    blocks.record(i32([0, 0]), i32([0, 0]), i32([0, 1]), torch.tensor([True, True]), block_table=bt, tokens=tokens,
                  digests=digests, extras=extras, root=(1, 2), blk_tokens=blk_tokens, blk_parent=blk_parent,
                  blk_extra=blk_extra, table=table)
    assert blk_tokens[5].tolist() == [1, 2] and blk_tokens[6].tolist() == [3, 4]
    assert blk_parent[5].tolist() == [1, 2] and blk_parent[6].tolist() == [7, 7]
    assert table.entries() == {(7, 7, 0): [5], (8, 8, 0): [6]}
