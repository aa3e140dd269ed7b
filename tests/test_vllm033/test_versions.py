"""Which vLLM gpukv's adapter follows, and what it refuses at start-up: the
tested releases, the adapter picked by what vLLM offers, and the conformance
check against the installed vLLM's own code."""

from __future__ import annotations

import importlib
import sys
import types

import pytest

from gpukv.vllm_plugin import TESTED_VLLM, UntestedVllmError

# (gpukv's 0.33-generation modules through the harness, which skips this module where that vLLM is absent)
from .harness import HIT_LIMIT, Request, VllmKVCacheManager, VllmScheduler, gpukv033, make_scheduler, vllm_version

conformance, features = gpukv033.conformance, gpukv033.features


def test_the_installed_vllm_is_a_tested_one_and_gets_this_generations_classes():
    import gpukv.vllm

    assert vllm_version() in TESTED_VLLM
    assert TESTED_VLLM[vllm_version()] == "gpukv.vllm.AsyncScheduler"
    assert gpukv.vllm.Scheduler is gpukv033.Scheduler
    assert gpukv.vllm.AsyncScheduler is gpukv033.AsyncScheduler
    assert gpukv.vllm.KVCacheManager is gpukv033.KVCacheManager


def _reimport(monkeypatch, version: str):
    import vllm

    monkeypatch.setattr(vllm, "__version__", version)
    saved = sys.modules.pop("gpukv.vllm")
    try:
        return importlib.import_module("gpukv.vllm")
    finally:
        sys.modules["gpukv.vllm"] = saved


def test_an_untested_vllm_is_refused_at_import_naming_the_tested_ones_and_the_install(monkeypatch):
    monkeypatch.delenv("GPUKV_ALLOW_UNTESTED_VLLM", raising=False)
    with pytest.raises(UntestedVllmError) as err:
        _reimport(monkeypatch, "0.35.0")
    message = str(err.value)
    assert "tested with vLLM 0.8.5, 0.8.5.post1, 0.33.0, 0.34.0; found vLLM 0.35.0" in message
    assert "pip install vllm==0.34.0" in message and "pip install -e ." in message
    assert "GPUKV_ALLOW_UNTESTED_VLLM=1" in message
    assert "requirements-vllm033" not in message  # (the CPU test recipe is no install for a GPU server)
    assert isinstance(err.value, ImportError)


def test_an_untested_vllm_is_accepted_when_opted_in_and_the_conformance_check_passes(monkeypatch):
    monkeypatch.setenv("GPUKV_ALLOW_UNTESTED_VLLM", "1")
    module = _reimport(monkeypatch, "0.35.0")
    assert module.AsyncScheduler is gpukv033.AsyncScheduler


def test_a_local_version_suffix_is_the_same_release(monkeypatch):
    monkeypatch.delenv("GPUKV_ALLOW_UNTESTED_VLLM", raising=False)
    assert _reimport(monkeypatch, f"{vllm_version()}+cu130").Scheduler is gpukv033.Scheduler


def test_the_installed_vllm_conforms_and_its_manager_reads_are_read_from_its_source():
    conformance.check_conformance()
    reads = conformance.manager_reads()
    assert {"allocate_slots", "get_computed_blocks", "free", "usage", "coordinator", "block_pool"} <= reads
    # 0.34's cache-aware admission probes the cache; 0.33's scheduler never does
    assert ("get_num_cached_tokens" in reads) == hasattr(VllmKVCacheManager, "get_num_cached_tokens")
    assert conformance.manager_misses(VllmKVCacheManager, gpukv033.KVCacheManager) == []
    assert conformance.request_misses(Request) == []


def test_a_manager_method_gpukv_lacks_is_named():
    class NewerManager(VllmKVCacheManager):
        def evict_for_tenant(self, tenant: str) -> None: ...

    assert conformance.manager_misses(NewerManager, gpukv033.KVCacheManager) == ["KVCacheManager.evict_for_tenant"]


def test_an_allocate_slots_parameter_gpukv_does_not_take_is_named():
    class NewerManager(VllmKVCacheManager):
        def allocate_slots(self, request, num_new_tokens, num_new_computed_tokens=0, new_computed_blocks=None,
                           num_lookahead_tokens=0, num_external_computed_tokens=0, delay_cache_blocks=False,
                           num_encoder_tokens=0, full_sequence_must_fit=False, reserved_blocks=0,
                           has_scheduled_reqs=True, skip_zeroing_group_ids=(), priority_tier=0): ...

    assert conformance.manager_misses(NewerManager, gpukv033.KVCacheManager) == [
        "KVCacheManager.allocate_slots(priority_tier=...)"]


def test_a_request_field_the_adapter_reads_missing_from_vllm_is_named():
    class OlderRequest:
        def __init__(self) -> None:
            self.request_id = "r"

    misses = conformance.request_misses(OlderRequest)
    assert "Request.request_id" not in misses
    assert {"Request.num_tokens", "Request.block_hashes", "Request.all_token_ids"} <= set(misses)
    assert ("Request.prefix_cache_hit_limit" in misses) == HIT_LIMIT


def test_a_scheduler_lacking_an_attribute_the_adapter_reads_is_refused_by_name():
    conformance.check_scheduler(make_scheduler(gpukv033.ReferenceScheduler))
    older = types.SimpleNamespace(**{name: None for name in conformance.SCHEDULER_FIELDS if name != "_pause_state"})
    with pytest.raises(gpukv033.UnsupportedConfigError, match=r"asks of its block manager .*Scheduler\._pause_state"):
        conformance.check_scheduler(older)


def test_a_miss_refuses_the_scheduler_before_vllms_constructor_runs(monkeypatch):
    monkeypatch.setattr(conformance, "check_conformance", _refusing)
    monkeypatch.setattr(sys.modules["gpukv.vllm.v0_33.scheduler"], "check_conformance", _refusing)
    with pytest.raises(gpukv033.UnsupportedConfigError, match=r"KVCacheManager\.evict_for_tenant"):
        gpukv033.ReferenceScheduler(vllm_config=None, kv_cache_config=None)


def _refusing() -> None:
    raise conformance._refuse(["KVCacheManager.evict_for_tenant"])


def test_the_features_follow_what_vllm_offers():
    assert hasattr(Request, "get_max_cache_hit_length") == features.HIT_LIMIT
    assert HIT_LIMIT == features.HIT_LIMIT


def test_get_num_cached_tokens_probes_without_taking_anything():
    """0.34's probe: the cached tokens of a request's full blocks (never its
    last token), on gpukv as on vLLM, and nothing taken or remembered."""
    from .harness import Engine, KVView, make_requests

    counts = []
    for cls in (VllmScheduler, gpukv033.ReferenceScheduler):
        scheduler = make_scheduler(cls, num_blocks=12)
        engine = Engine(scheduler)
        engine.add(make_requests(1, 40, prompt=lambda _: list(range(40)), max_tokens=1))
        engine.run_until_idle()
        (probe,) = make_requests(1, prompt=lambda _: list(range(33)) + [99], first_id=1)
        before = KVView(scheduler).free_queue()
        if not hasattr(scheduler.kv_cache_manager, "get_num_cached_tokens"):
            pytest.skip(f"vLLM {vllm_version()} has no get_num_cached_tokens")
        counts.append(scheduler.kv_cache_manager.get_num_cached_tokens(probe))
        assert KVView(scheduler).free_queue() == before  # no block taken out of the free queue
    assert counts == [32, 32]  # blocks [0..16) and [16..32) are cached; [32..48) was never full


def test_the_vllm_example_runs_as_readme_shows_it():
    """``python examples/vllm_scheduler.py`` (README, "Use with vLLM"): vLLM's
    AsyncScheduler on gpukv built as vLLM builds it, the second request's hit,
    and the same decisions as vLLM's own scheduler."""
    import os
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, str(root / "examples" / "vllm_scheduler.py")], capture_output=True,
                         text=True, env=env, timeout=300, check=True).stdout.splitlines()
    assert out == ["request a: blocks [1, 2, 3], 0 tokens from the prefix cache",
                   "request b: blocks [1, 2, 3], 32 tokens from the prefix cache",
                   "gpukv's block manager (ReferenceManager) made vLLM's own decisions: True"]


def test_vllm_finds_gpukvs_start_up_check_among_its_general_plugins():
    """The entry point an install registers is what vLLM loads at start-up
    (``load_general_plugins`` runs every plugin of this group)."""
    from vllm.plugins import load_plugins_by_group

    from gpukv import vllm_plugin

    plugins = load_plugins_by_group("vllm.general_plugins")
    assert plugins["gpukv"] is vllm_plugin.plugin
