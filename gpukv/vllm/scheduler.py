"""vLLM 0.8.5's v1 ``Scheduler`` on gpukv: ``--scheduler-cls gpukv.vllm.Scheduler``.

The scheduling loop is vLLM's own, unchanged (so its ``SchedulerOutput`` is
vLLM's by construction); only the block manager underneath is gpukv's
(``gpukv.vllm.KVCacheManager``), which answers every call as vLLM's manager
does (``tests/test_vllm/`` hold it to that, step by step).
"""

from __future__ import annotations

from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler

from gpukv.vllm.manager import KVCacheManager


class Scheduler(VllmScheduler):
    """vLLM's scheduler with gpukv's block manager. ``backend``: "auto" (the
    device manager on CUDA, else the reference), "reference" or "device"."""

    backend = "auto"

    def __init__(self, vllm_config: Any, kv_cache_config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(vllm_config, kv_cache_config, *args, **kwargs)
        # vLLM's constructor built its own manager; this one replaces it,
        # with the arguments vLLM gave its own.
        # Not a subclass of vLLM's manager (it shares no state with it), but its interface.
        self.kv_cache_manager = KVCacheManager(  # type: ignore[assignment]
            kv_cache_config=kv_cache_config,
            max_model_len=self.max_model_len,
            enable_caching=bool(self.cache_config.enable_prefix_caching),
            caching_hash_algo=self.cache_config.prefix_caching_hash_algo,
            use_eagle=self.use_eagle,
            log_stats=self.log_stats,
            backend=self.backend,
            max_num_reqs=self.max_num_running_reqs,
        )


class ReferenceScheduler(Scheduler):
    """On gpukv's reference manager (host memory, any machine)."""

    backend = "reference"


class DeviceScheduler(Scheduler):
    """On gpukv's device manager (CUDA; on a CPU, Triton's interpreter)."""

    backend = "device"
