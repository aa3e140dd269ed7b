"""``gpukv.device.decode``: the decode path's plan on its own (its bucket,
totals, phases and uploaded arrays, worked by hand) and its layout."""

import numpy as np
import pytest

from gpukv.core.requests import NewRequest
from gpukv.device.decode import as_0d, decode_layout, decode_phases
from gpukv.device.manager import DeviceManager

KEY = bytes(range(16))


def _admitted():
    # Pool of 5 blocks (4 usable), block size 2: "a" holds [1] (token 10),
    # "b" holds [2, 3] (tokens 20, 21, 22); block 4 is free.
    m = DeviceManager(5, 2, hash_key=KEY, max_model_len=16, max_num_reqs=4, device="cpu")
    m.step(new=[NewRequest("a", [10]), NewRequest("b", [20, 21, 22])])
    return m


def test_the_layout_of_a_bucket_lists_the_uploaded_arrays_first():
    assert decode_layout((8, 1, 0, 1, 1), 1, 0) == [
        ("rows", 8), ("ntok", 8), ("nnew", 8), ("comp0", 8), ("comp1", 8), ("held", 8), ("need", 8), ("cum", 8),
        ("h_start", 8), ("h_count", 8), ("alloc", 40), ("record", 32)]
    # A window group adds its releases (W=1 group, L=2 per row) right after the counts.
    names = [n for n, _ in decode_layout((8, 1, 2, 1, 1), 2, 1)]
    assert names[8:13] == ["r_grp", "r_row", "r_pos", "r_call", "r_valid"]
    assert dict(decode_layout((8, 1, 2, 1, 1), 2, 1))["r_grp"] == 16


def test_a_decode_that_fills_blocks_needs_none_and_plans_only_its_phases():
    m = _admitted()
    m.step()  # (the read above set the host's bound of free blocks: 1)
    with m._counting():
        plan = m._decode.plan(np.array([0, 1]), 1)
        assert plan.bucket == (8, 1, 0, 1, 1)
        assert (plan.num_new_blocks, plan.cum.tolist(), plan.held.tolist()) == (0, [0, 0], [1, 2])
        assert (plan.num_tokens.tolist(), plan.computed.tolist(), plan.fits_known) == ([2, 4], [2, 4], True)
        assert plan.phases == decode_phases(False, False, True, True) == frozenset({"fit", "hash", "cache"})
        v = m._decode.host_plan(plan.bucket)
        assert v["rows"].tolist() == [0, 1, -1, -1, -1, -1, -1, -1]
        assert (v["ntok"][:2].tolist(), v["nnew"][:2].tolist(), v["comp1"][:2].tolist()) == ([1, 3], [1, 1], [2, 4])


def test_a_decode_that_needs_a_block_counts_it_against_the_bound():
    m = _admitted()
    assert m.decode([0, 1], [[11], [23]]).ok  # "a" [10, 11], "b" [20..23]: both blocks full, none new
    with m._counting():
        plan = m._decode.plan(np.array([0, 1]), 1)
    # Each needs one more block; the host knows one free block: not enough to skip the read.
    assert (plan.num_new_blocks, plan.cum.tolist(), plan.held.tolist()) == (2, [1, 2], [2, 3])
    assert plan.phases == frozenset({"fit", "allocate"}) and not plan.fits_known
    assert plan.blocks_popped(1) == 1 and plan.blocks_popped(0) == 0


def test_finish_brings_the_rows_mirror_up_to_date():
    m = _admitted()
    with m._counting():
        plan, bufs = m._decode.launch_running(m._normalize_running(_batch([0], [[11]])))
        res = m._decode.finish(plan, bufs)
    assert res.ok
    assert m._rows.num_tokens[[0, 1]].tolist() == [2, 3] and m._rows.num_held[[0, 1]].tolist() == [1, 2]
    assert m.get_block_ids("a") == [[1]]


def _batch(rows, tokens):
    from gpukv.core.running_batch import RunningBatch
    return RunningBatch(rows, tokens, None, None, 0)


def test_shared_0d_constants_are_read_only():
    """``as_0d`` hands every caller the same array: none may change it."""
    seven = as_0d(7)
    assert seven is as_0d(7) and seven.shape == () and int(seven) == 7
    with pytest.raises(ValueError, match="read-only"):
        seven[()] = 8
    assert int(as_0d(7)) == 7
