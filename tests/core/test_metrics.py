import pytest

from gpukv.core.metrics import PrefixCacheStats, PrefixCachingMetrics


def stats(requests, queries, hits, reset=False):
    return PrefixCacheStats(requests=requests, queries=queries, hits=hits, reset=reset)


def test_window_keeps_at_least_the_last_n_requests():
    m = PrefixCachingMetrics(max_recent_requests=4)
    m.observe(stats(2, 10, 5))
    m.observe(stats(2, 10, 0))
    assert (m.aggregated_requests, m.hit_rate) == (4, 0.25)
    # A third interval of 2: dropping the first still leaves 4 requests.
    m.observe(stats(2, 10, 10))
    assert (m.aggregated_requests, m.aggregated_queries, m.aggregated_hits) == (4, 20, 10)
    assert m.hit_rate == 0.5


def test_an_interval_larger_than_the_window_stands_alone():
    m = PrefixCachingMetrics(max_recent_requests=3)
    m.observe(stats(1, 4, 4))
    m.observe(stats(5, 10, 1))
    assert (m.aggregated_requests, m.hit_rate) == (5, 0.1)


def test_reset_empties_the_window_and_empty_intervals_are_ignored():
    m = PrefixCachingMetrics(max_recent_requests=10)
    m.observe(stats(3, 9, 9))
    m.observe(stats(0, 0, 0))
    assert m.aggregated_requests == 3
    m.observe(stats(1, 4, 1, reset=True))
    assert (m.aggregated_requests, m.hit_rate) == (1, 0.25)


def test_no_queries_is_a_zero_hit_rate():
    assert PrefixCachingMetrics().hit_rate == 0.0
    assert PrefixCacheStats().hit_rate == 0.0


def test_stats_record_and_merge():
    a = PrefixCacheStats()
    a.record(num_tokens=60, num_hit_tokens=32, num_blocks=4, num_hit_blocks=2)
    b = PrefixCacheStats(reset=True)
    b.record(num_tokens=5, num_hit_tokens=0, num_blocks=1, num_hit_blocks=0)
    # a re-admission counts apart
    b.record(num_tokens=40, num_hit_tokens=16, num_blocks=3, num_hit_blocks=1, preempted=True)
    a.merge(b)
    assert (a.requests, a.queries, a.hits, a.query_blocks, a.hit_blocks, a.reset) == (2, 65, 32, 5, 2, True)
    assert (a.preempted_requests, a.preempted_queries, a.preempted_hits) == (1, 40, 16)
    assert (a.query_tokens, a.hit_tokens) == (65, 32)
    assert a.hit_rate == 32 / 65 and a.block_hit_rate == 2 / 5


@pytest.mark.parametrize("bad", [0, -1, 2.5, "10"])
def test_bad_window(bad):
    with pytest.raises(ValueError, match="max_recent_requests"):
        PrefixCachingMetrics(bad)


def test_vllm085_block_counts():
    """vLLM 0.8.5's units: (tokens - 1) // block_size asked, re-admissions
    included (what ``record`` gets: num_blocks = ceil(tokens / block_size))."""
    s = PrefixCacheStats()
    s.record(num_tokens=32, num_hit_tokens=16, num_blocks=2, num_hit_blocks=1)  # aligned: the last block not asked
    s.record(num_tokens=40, num_hit_tokens=32, num_blocks=3, num_hit_blocks=2)
    s.record(num_tokens=40, num_hit_tokens=16, num_blocks=3, num_hit_blocks=1, preempted=True)
    s.record(num_tokens=0, num_hit_tokens=0, num_blocks=0, num_hit_blocks=0)  # skip_prefix_cache
    assert (s.vllm085_query_blocks, s.vllm085_hit_blocks) == (1 + 2 + 2, 1 + 2 + 1)
    assert (s.query_blocks, s.hit_blocks) == (5, 3)
    s.merge(s)
    assert (s.vllm085_query_blocks, s.vllm085_hit_blocks) == (10, 8)


def test_vllm085_block_counts_of_a_manager():
    from gpukv.core.requests import NewRequest
    from gpukv.reference.manager import ReferenceManager

    m = ReferenceManager(64, 16, hash_key=bytes(16))
    m.step(new=[NewRequest("a", list(range(32)))])
    m.step(new=[NewRequest("b", list(range(40))), NewRequest("c", list(range(33)), num_preemptions=1)])
    s = m.make_prefix_cache_stats()
    # a: 31 // 16 = 1 asked, no hit; b: 39 // 16 = 2 asked, 2 hit; c (a re-admission): 2 asked, 2 hit
    assert (s.vllm085_query_blocks, s.vllm085_hit_blocks) == (5, 4)
