"""vLLM 0.34's new prefix-cache rules, hand-worked on every scheduler class
(vLLM's own and gpukv's): hits bounded by a prompt-logprob request's first
scored token, and cache-aware admission. Skipped where vLLM lacks them (0.33)."""

from __future__ import annotations

import pytest

from .harness import (
    HAS_CACHE_AWARE_ADMISSION,
    HIT_LIMIT,
    Engine,
    make_requests,
    make_scheduler,
    scheduler_params,
    vllm_version,
)

PREFIX = list(range(1000, 1048))  # three full blocks of 16


def _warm(cls, **options):
    """A scheduler whose cache holds PREFIX's three blocks (request 0 ran and finished)."""
    scheduler = make_scheduler(cls, num_blocks=24, **options)
    engine = Engine(scheduler)
    engine.add(make_requests(1, prompt=lambda _: PREFIX + [1, 2], max_tokens=1))
    engine.run_until_idle()
    return scheduler, engine


@pytest.mark.parametrize("cls", scheduler_params())
@pytest.mark.parametrize(("start", "hit"), [(20, 16), (32, 32), (47, 32), (0, 0), (None, 0)])
def test_a_prompt_logprob_request_hits_only_before_its_first_scored_token(cls, start, hit):
    """Prompt logprobs from token ``start`` on: the hit stops at the last whole
    block before it (None: the whole prompt is scored, no hit at all)."""
    if not HIT_LIMIT:
        pytest.skip(f"vLLM {vllm_version()} has no prefix-cache hit limit")
    scheduler, engine = _warm(cls)
    (request,) = make_requests(1, prompt=lambda _: PREFIX + [7, 8, 9], first_id=1, max_tokens=1,
                               prompt_logprobs=1, prompt_logprob_start=start)
    engine.add([request])
    out = engine.step()
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == hit
    assert out.num_scheduled_tokens == {"1": 51 - hit}
    engine.run_until_idle()


@pytest.mark.parametrize("cls", scheduler_params())
def test_cache_aware_admission_takes_the_cached_prompt_first(cls):
    """Window 4, from any usage: of two waiting prompts, the one whose 48
    tokens are cached is admitted before the one that arrived first, when only
    one fits the token budget."""
    if not HAS_CACHE_AWARE_ADMISSION:
        pytest.skip(f"vLLM {vllm_version()} has no cache-aware admission")
    scheduler, engine = _warm(cls, cache_aware_window=4, max_num_batched_tokens=64)
    cold = make_requests(1, prompt=lambda _: list(range(5000, 5060)), first_id=1, max_tokens=1)
    warm = make_requests(1, prompt=lambda _: PREFIX + [3, 4, 5], first_id=2, max_tokens=1)
    engine.add(cold + warm)
    out = engine.step()
    assert [(n.req_id, n.num_computed_tokens) for n in out.scheduled_new_reqs][0] == ("2", 48)
    assert out.num_scheduled_tokens["2"] == 3


def _resident(cls, window: int, num_blocks: int = 5, threshold: float = 0.0):
    """vLLM 0.34's own set-up for its cache-aware tests, written anew: a
    48-token prompt ran and was aborted, so its 3 blocks are cached; a 5-block
    pool (4 usable) cannot hold it and a cold 48-token prompt both."""
    if not HAS_CACHE_AWARE_ADMISSION:
        pytest.skip(f"vLLM {vllm_version()} has no cache-aware admission")
    scheduler = make_scheduler(cls, num_blocks=num_blocks, cache_aware_window=window,
                               cache_aware_threshold=threshold)
    engine = Engine(scheduler)
    engine.add(make_requests(1, prompt=lambda _: PREFIX, max_tokens=1))
    engine.run_until_idle()
    (warm,) = make_requests(1, prompt=lambda _: PREFIX, first_id=2, max_tokens=1)
    (cold,) = make_requests(1, prompt=lambda _: list(range(7000, 7048)), first_id=1, max_tokens=1)
    return scheduler, engine, warm, cold


@pytest.mark.parametrize("cls", scheduler_params())
@pytest.mark.parametrize("window", [0, 4])
def test_cache_aware_admission_keeps_the_resident_prefix_from_eviction(cls, window):
    """Window 4: the warm prompt goes first, on its 32 cached tokens (all but
    its last block's, as the last token is always computed); window 0 (the
    control): arrival order, the cold prompt first, and the warm one's prefix
    is evicted under it."""
    scheduler, engine, warm, cold = _resident(cls, window)
    assert scheduler.kv_cache_manager.get_num_cached_tokens(warm) == 32
    engine.add([cold, warm])
    out = engine.step()
    if window:
        assert [(n.req_id, n.num_computed_tokens) for n in out.scheduled_new_reqs][0] == ("2", 32)
        assert out.num_scheduled_tokens["2"] == 16
    else:
        assert [n.req_id for n in out.scheduled_new_reqs][0] == "1"
        assert scheduler.kv_cache_manager.get_num_cached_tokens(warm) < 32


@pytest.mark.parametrize("cls", scheduler_params())
@pytest.mark.parametrize(("window", "threshold"), [(1, 0.0), (4, 0.9)])
def test_cache_aware_admission_keeps_arrival_order_past_its_window_or_below_its_threshold(cls, window, threshold):
    scheduler, engine, warm, cold = _resident(cls, window, num_blocks=24, threshold=threshold)
    engine.add([cold, warm])
    out = engine.step()
    assert [n.req_id for n in out.scheduled_new_reqs] == ["1", "2"]
