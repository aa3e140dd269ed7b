"""``gpukv.device.releases``: a release's size buckets and kept launches."""

import pytest

from gpukv.core.requests import NewRequest
from gpukv.device.manager import DeviceManager
from gpukv.kernels import capture

KEY = bytes(range(16))


def test_releases_pad_to_a_bucket_and_replay_its_launches():
    m = DeviceManager(64, 2, hash_key=KEY, max_model_len=128, max_num_reqs=4, device="cpu")
    m.step(new=[NewRequest("a", list(range(5))), NewRequest("b", list(range(100, 105)))])  # 3 blocks each
    m.step(finished=["a"])
    assert list(m._releases.buffers) == [16]  # 3 entries, padded to 16
    kept = m._releases.buffers[16].prepared["release"][1]
    before = capture.launches()
    m.step(finished=["b"])
    assert m._releases.buffers[16].prepared["release"][1] is kept  # replayed, not prepared anew
    assert capture.launches() - before == len(kept)
    assert m.read_num_free_blocks() == 63 and m.request_ids() == []
    m.step(new=[NewRequest("c", list(range(40)))])  # 20 blocks
    m.step(finished=["c"])
    assert sorted(m._releases.buffers) == [16, 32]


def test_a_release_frees_tail_first_and_forgets_the_request():
    m = DeviceManager(8, 2, hash_key=KEY, max_model_len=32, max_num_reqs=2, device="cpu", enable_caching=False)
    m.step(new=[NewRequest("a", [1, 2, 3, 4, 5])])
    assert m.get_block_ids("a") == [[1, 2, 3]] and m.free_queue() == [4, 5, 6, 7]
    with m._counting():  # (a step's staging)
        m._releases.requests(["a"])
    assert m.free_queue() == [3, 2, 1, 4, 5, 6, 7]  # uncached blocks to the front, tail first
    assert m.request_ids() == [] and not m._rows.in_use.any() and m._row_ids == {}


def test_the_rows_check_counts_every_held_entry_and_catches_a_wrong_one():
    """``DeviceRows.check_against`` (``check_invariants``): a reference count
    one off, or a row in use that no request holds, is caught."""
    m = DeviceManager(16, 2, hash_key=KEY, max_model_len=32, max_num_reqs=4, device="cpu",
                      sliding_windows=[None, 4])
    m.step(new=[NewRequest("a", list(range(9))), NewRequest("b", list(range(9)))])  # b shares a's full blocks
    m.check_invariants()
    m.pool.ref_cnt[m.get_block_ids("a")[0][0]] += 1
    with pytest.raises(AssertionError, match="reference counts disagree"):
        m.check_invariants()
    m.pool.ref_cnt[m.get_block_ids("a")[0][0]] -= 1
    m._rows.in_use[3] = True
    with pytest.raises(AssertionError, match="row leak"):
        m.check_invariants()
