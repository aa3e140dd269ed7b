"""Every token hashed once: vLLM's engine builds no request block hasher for
gpukv's scheduler (``gpukv.vllm.v0_33.engine_hashing``), and gpukv's hits
stay exact whatever vLLM hashes a request carries."""

from __future__ import annotations

import pytest

# isort: off
from . import harness  # noqa: F401  (first: it skips this module where vLLM 0.33 is not importable)
# isort: on
from gpukv.vllm.v0_33 import engine_hashing

from .harness import Engine, make_requests, make_scheduler, scheduler_params

GPUKV = [p for p in scheduler_params() if p.id.startswith("gpukv")]
VLLM = [p for p in scheduler_params() if p.id.startswith("vllm")]
PREFIX = list(range(3000, 3048))  # three full blocks of 16


def test_the_installed_engine_builds_its_hasher_after_the_scheduler_on_the_flag():
    # (the order the hand-over needs; a vLLM that changes it keeps hashing twice, and this test says so)
    assert engine_hashing.engine_builds_hasher_after_scheduler() is True


@pytest.mark.parametrize("cls", GPUKV)
def test_gpukv_clears_the_flag_for_the_engine_and_sets_it_back_at_the_first_request(cls):
    scheduler = make_scheduler(cls, num_blocks=16)
    assert scheduler.cache_config.enable_prefix_caching is False  # (what EngineCore.__init__ reads next)
    assert scheduler.engine_hashes_blocks is False and scheduler.harness_hasher is None
    assert scheduler.kv_cache_manager.enable_caching is True  # gpukv still caches
    scheduler.add_request(make_requests(1, 20, scheduler=scheduler)[0])
    assert scheduler.cache_config.enable_prefix_caching is True


@pytest.mark.parametrize("cls", VLLM)
def test_vllms_own_scheduler_keeps_the_engines_hasher(cls):
    scheduler = make_scheduler(cls, num_blocks=16)
    assert scheduler.cache_config.enable_prefix_caching is True and scheduler.harness_hasher is not None
    (request,) = make_requests(1, 40, scheduler=scheduler)
    assert len(request.block_hashes) == 2


@pytest.mark.parametrize("cls", GPUKV)
@pytest.mark.parametrize("options", [dict(enable_kv_cache_events=True), dict(sliding_window=32, second_window=48)],
                         ids=["kv-events", "window-led-boundary"])
def test_the_engine_keeps_hashing_where_gpukv_reads_vllms_hashes(cls, options):
    # (two window specs: vLLM's first lookup group is a window group, whose lone hit comes from the event index)
    scheduler = make_scheduler(cls, num_blocks=32, **options)
    assert scheduler.kv_cache_manager.reads_vllm_hashes is True
    assert scheduler.cache_config.enable_prefix_caching is True and scheduler.engine_hashes_blocks is True


@pytest.mark.parametrize("cls", GPUKV)
def test_a_hybrid_models_boundary_needs_no_vllm_hash(cls):
    # vLLM's first lookup group is the full-attention one: its lone hit is gpukv's full-attention hit, so no
    # event stream runs and the engine hashes nothing.
    scheduler = make_scheduler(cls, num_blocks=32, sliding_window=32, hybrid=True)
    manager = scheduler.kv_cache_manager
    assert manager.reads_vllm_hashes is False and manager.event_translator.index is False
    assert scheduler.cache_config.enable_prefix_caching is False and scheduler.engine_hashes_blocks is False


@pytest.mark.parametrize("cls", GPUKV)
def test_no_prefix_caching_leaves_the_flag_off_and_nothing_to_restore(cls):
    scheduler = make_scheduler(cls, num_blocks=16, enable_prefix_caching=False)
    scheduler.add_request(make_requests(1, 20, scheduler=scheduler)[0])
    assert scheduler.cache_config.enable_prefix_caching is False and scheduler.engine_hashes_blocks is False


def _hit_of(engine, request) -> int:
    engine.add([request])
    out = engine.schedule()
    (new,) = out.scheduled_new_reqs
    return new.num_computed_tokens


@pytest.mark.parametrize("cls", GPUKV)
def test_a_request_without_vllm_hashes_hits_the_cache_as_one_with_them(cls):
    scheduler = make_scheduler(cls, num_blocks=24)
    engine = Engine(scheduler)
    engine.add(make_requests(1, prompt=lambda _: PREFIX + [1, 2], max_tokens=1, scheduler=scheduler))
    engine.run_until_idle()
    (bare,) = make_requests(1, prompt=lambda _: PREFIX + [3], first_id=1, max_tokens=1, scheduler=scheduler)
    assert bare.block_hashes == []
    assert _hit_of(engine, bare) == 48


@pytest.mark.parametrize("cls", GPUKV)
def test_vllm_hashes_copied_from_a_cached_prompt_give_no_hit(cls):
    # A request carrying another prompt's vLLM hashes (a frontend's, say): gpukv's lookup reads the tokens.
    scheduler = make_scheduler(cls, num_blocks=24)
    engine = Engine(scheduler)
    engine.add(make_requests(1, prompt=lambda _: PREFIX + [1, 2], max_tokens=1, scheduler=scheduler))
    engine.run_until_idle()
    (forged,) = make_requests(1, prompt=lambda _: list(range(9000, 9049)), first_id=1, max_tokens=1,
                              scheduler=scheduler)
    forged.block_hashes[:] = make_requests(1, prompt=lambda _: PREFIX + [3], first_id=2)[0].block_hashes
    assert len(forged.block_hashes) == 3
    assert _hit_of(engine, forged) == 0

