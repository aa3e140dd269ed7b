"""The window rules (``gpukv.core.windows``): where a request's next release
starts, held to ``released_until`` itself."""

from __future__ import annotations

import pytest

from gpukv.core.windows import FullAttention, SlidingWindow, first_release_at, policies


def test_release_at_by_hand():
    # A 17-token window, blocks of 16: a token sees the 16 before it, so 64 processed tokens skip
    # (64 - 16) // 16 = 3 blocks, 63 only 2.
    window = SlidingWindow(17, 16)
    assert window.release_at(0) == 32  # (the first block goes once 32 tokens are processed: (32 - 16) // 16 = 1)
    assert window.release_at(2) == 64
    assert int(window.skipped(63)) == 2 and int(window.skipped(64)) == 3
    assert FullAttention().release_at(5) is None


@pytest.mark.parametrize("window", [2, 16, 17, 20, 24, 33, 100])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_release_at_is_the_first_count_whose_release_passes_the_nulls(window, block_size):
    policy = SlidingWindow(window, block_size)
    for num_null in range(6):
        held = num_null + 3  # (blocks past the nulls to release)
        frees = [int(policy.released_until(p, held)) > num_null for p in range(0, 12 * block_size + 2 * window)]
        assert frees.index(True) == policy.release_at(num_null), num_null
        assert all(frees[policy.release_at(num_null):])  # (the release only grows with the processed tokens)


def test_first_release_at_takes_the_earliest_window_group():
    group_policies = policies([None, 17, 40], 16)
    # 17-token window with 1 null block: 2 * 16 + 16 = 48; 40-token window with none: 16 + 39 = 55.
    assert first_release_at(group_policies, (0, 1, 0)) == 48
    assert first_release_at(group_policies, (0, 3, 0)) == 55
    with pytest.raises(ValueError, match="no group has a sliding window"):
        first_release_at(policies([None, None], 16), (0, 0))
