"""Does the installed vLLM ask of its block manager only what gpukv's adapter
answers? Checked against vLLM's own code, not its version string, so a new
release that calls a new manager method, passes a new ``allocate_slots``
parameter or drops a ``Request`` field the adapter reads is refused at
start-up, naming what is missing, instead of failing mid-serving.

What is checked (``check_conformance``; ``check_scheduler`` once vLLM's
scheduler is built):

* every public method of vLLM's ``KVCacheManager``, and every attribute its
  scheduler and engine core read through ``kv_cache_manager.NAME`` (read
  from their source), exists on gpukv's adapter: implemented, or refused by
  name (the KV-connector and copy-on-write calls);
* every parameter of each vLLM manager method that gpukv implements is one
  gpukv's method takes (``allocate_slots``' above all);
* every ``Request`` field the adapter reads (``REQUEST_FIELDS``, and the
  prefix-cache read limit ``gpukv.vllm.v0_33.features`` picks) is a field of
  vLLM's ``Request``;
* every scheduler attribute the adapter reads (``SCHEDULER_FIELDS``: the
  refusals at construction and the batched run's conditions) exists on the
  built scheduler.

The adapter reads no ``SchedulerOutput`` field: vLLM builds it from the
manager's answers.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from typing import Any

from gpukv.vllm.v0_33 import features
from gpukv.vllm.v0_33.groups import UnsupportedConfigError

REQUEST_FIELDS = (
    "request_id", "num_tokens", "all_token_ids", "num_computed_tokens", "num_in_flight_tokens", "lora_request",
    "cache_salt", "block_hashes", "mm_features", "prompt_embeds", "status", "is_finished", "num_preemptions",
    "pooling_params", "num_stale_output_tokens", "drop_stale_output", "resumable", "prompt_token_ids",
    "is_prefill_chunk", "num_prompt_tokens",
)
"""The ``Request`` fields the adapter reads (besides the read limit)."""

SCHEDULER_FIELDS = (
    "connector", "aux_output_connector", "is_encoder_decoder", "hash_block_size", "block_size",
    "use_eagle_block_drop", "num_hash_lookahead_tokens", "num_prefill_lookahead", "dcp_world_size", "max_model_len",
    "cache_config", "log_stats", "enable_kv_cache_events", "scheduler_config", "vllm_config", "max_num_running_reqs",
    "policy", "_pause_state", "kv_holding_waiting", "local_prefill_interval", "lora_config", "num_lookahead_tokens",
    "prefix_replay_tokens", "ec_connector", "max_num_scheduled_tokens", "max_num_active_reqs", "running",
    "num_waiting_for_streaming_input", "waiting", "requests", "grammar_compile_error_reqs",
    "scheduler_reserve_full_isl", "num_spec_tokens", "num_sampled_tokens_per_step", "prefill_capacity_bound",
    "num_executed_steps", "last_prefill_step", "get_request_counts",
)
"""The scheduler attributes the adapter reads (``scheduler._refuse_unsupported``, ``admissions.plain_run``,
``screening``)."""

_READERS = ("vllm.v1.core.sched.scheduler", "vllm.v1.core.sched.async_scheduler", "vllm.v1.engine.core")
"""vLLM's modules whose reads of ``kv_cache_manager.NAME`` the adapter must answer."""


def _refuse(misses: list[str]) -> UnsupportedConfigError:
    import vllm

    return UnsupportedConfigError(
        f"the installed vLLM {vllm.__version__} asks of its block manager what gpukv's adapter does not answer: "
        + "; ".join(misses), argument="vllm",
        fix="install a vLLM release gpukv is tested with (gpukv.vllm_plugin.TESTED_VLLM), or use vLLM's own scheduler")


@functools.cache
def _assigned_attributes(function: Any) -> frozenset[str]:
    """The ``self.NAME`` a function assigns (from its source)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError):
        return frozenset()
    return frozenset(node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
                     and isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name)
                     and node.value.id == "self")


def manager_reads() -> set[str]:
    """What vLLM's scheduler and engine core read through ``kv_cache_manager.NAME``."""
    import importlib

    names: set[str] = set()
    for module_name in _READERS:
        tree = ast.parse(inspect.getsource(importlib.import_module(module_name)))
        names |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
                  and isinstance(node.value, ast.Attribute) and node.value.attr == "kv_cache_manager"}
    return names


def _has(cls: Any, name: str) -> bool:
    return hasattr(cls, name) or name in _assigned_attributes(cls.__init__)


def manager_misses(vllm_cls: Any, gpukv_cls: Any) -> list[str]:
    """vLLM manager methods, attributes and parameters gpukv's adapter lacks."""
    wanted = {n for n in dir(vllm_cls) if not n.startswith("_")} | manager_reads()
    misses = [f"KVCacheManager.{n}" for n in sorted(wanted) if not _has(gpukv_cls, n)]
    for name in sorted(wanted):
        ours, theirs = getattr(gpukv_cls, name, None), getattr(vllm_cls, name, None)
        if not (inspect.isfunction(ours) and inspect.isfunction(theirs)):
            continue
        known = inspect.signature(ours).parameters
        if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in known.values()):
            continue  # (a refusing stand-in takes anything)
        unknown = [p for p in inspect.signature(theirs).parameters if p not in known]
        misses += [f"KVCacheManager.{name}({p}=...)" for p in unknown]
    return misses


def request_misses(request_cls: Any) -> list[str]:
    """``Request`` fields the adapter reads that vLLM's ``Request`` lacks."""
    limit = ("prefix_cache_hit_limit", "get_max_cache_hit_length") if features.HIT_LIMIT else (
        "skip_reading_prefix_cache",)
    return [f"Request.{n}" for n in REQUEST_FIELDS + limit if not _has(request_cls, n)]


@functools.cache
def check_conformance() -> None:
    """Refuse (``UnsupportedConfigError`` naming each miss) an installed vLLM
    whose manager interface or ``Request`` the adapter does not cover."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager
    from vllm.v1.request import Request

    from gpukv.vllm.v0_33.manager import KVCacheManager

    misses = manager_misses(VllmKVCacheManager, KVCacheManager) + request_misses(Request)
    if misses:
        raise _refuse(misses)


def check_scheduler(scheduler: Any) -> None:
    """Refuse a built vLLM scheduler lacking an attribute the adapter reads."""
    misses = [f"Scheduler.{n}" for n in SCHEDULER_FIELDS if not hasattr(scheduler, n)]
    if misses:
        raise _refuse(misses)
