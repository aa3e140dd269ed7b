"""``WindowReleases``, the host's record of what a window model's running
calls release (``gpukv/vllm/v0_33/window_releases.py``), on hand-worked
counts: a full-attention group, then a 17-token window, blocks of 16."""

from __future__ import annotations

import pytest

from gpukv.core.windows import policies

from .harness import gpukv033

WindowReleases = gpukv033.window_releases.WindowReleases
processed_tokens = gpukv033.window_releases.processed_tokens


def _releases(caching: bool = True) -> WindowReleases:
    releases = WindowReleases(policies([None, 17], 16), 16, caching)
    releases.note("a", (0, 1))  # (a hit's first block before the window: the null block)
    return releases


def test_a_release_behind_the_processed_tokens_by_hand():
    releases = _releases()
    # (17-token window: 48 processed tokens skip (48 - 16) // 16 = 2 blocks; the first is null already)
    assert releases.release_at["a"] == 48
    assert releases.stops_after("a", 47, 5) is None
    assert releases.stops_after("a", 48, 5) == [0, 2]
    assert releases.stops_after("a", 80, 5) == [0, 4]
    assert releases.stops_after("a", 200, 3) == [0, 3]  # (never past the blocks held)
    assert releases.stops_after("a", 200, 1) is None  # (the one block held is null already)


def test_only_blocks_full_of_computed_tokens_count_as_cached():
    releases = _releases()
    assert releases.all_cached([0, 2], 32) and releases.all_cached([0, 2], 40)
    assert not releases.all_cached([0, 2], 31)  # (block 1 not full of computed tokens: never cached)
    assert not _releases(caching=False).all_cached([0, 2], 1000)


def test_the_record_follows_the_manager_and_says_where_it_does_not():
    releases = _releases()
    releases.check("a", (0, 1))
    releases.note("a", [0, 2])
    assert releases.release_at["a"] == 64
    with pytest.raises(AssertionError, match="'a'"):
        releases.check("a", (0, 1))
    releases.forget("a")
    assert "a" not in releases.release_at and "a" not in releases.null_blocks


class _Request:
    def __init__(self, num_computed_tokens: int, num_in_flight_tokens: int) -> None:
        self.num_computed_tokens, self.num_in_flight_tokens = num_computed_tokens, num_in_flight_tokens


def test_processed_tokens_are_the_computed_ones_less_those_in_flight():
    assert processed_tokens(_Request(40, 0), 512) == 40
    assert processed_tokens(_Request(40, 3), 512) == 37
    assert processed_tokens(_Request(600, 3), 512) == 509  # (the computed tokens capped at max_model_len first)
    assert processed_tokens(_Request(2, 5), 512) == 0
