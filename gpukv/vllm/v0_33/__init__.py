"""gpukv under vLLM 0.33's v1 engine (``gpukv.vllm`` exports these when vLLM 0.33.x is installed).

* ``KVCacheManager``: vLLM 0.33's ``KVCacheManager`` interface on a gpukv
  manager (the device manager on CUDA, the reference elsewhere).
* ``AsyncScheduler`` / ``Scheduler``: vLLM 0.33's ``AsyncScheduler`` (async
  scheduling, the engine's default) and ``Scheduler`` running on it,
  ``vllm serve MODEL --scheduler-cls gpukv.vllm.AsyncScheduler``;
  ``Reference*`` and ``Device*`` pin the backend. vLLM's own scheduling
  loop, its running requests' allocations batched into one gpukv step
  (``gpukv.vllm.v0_33.pending``); ``Unbatched*`` make one gpukv call per
  request.
* ``UnsupportedConfigError``: what a refused configuration raises.
"""

from __future__ import annotations

from gpukv.vllm.v0_33.manager import Block, KVCacheManager, UnsupportedConfigError
from gpukv.vllm.v0_33.scheduler import (
    AsyncScheduler,
    DeviceAsyncScheduler,
    DeviceScheduler,
    ReferenceAsyncScheduler,
    ReferenceScheduler,
    Scheduler,
    UnbatchedDeviceAsyncScheduler,
    UnbatchedDeviceScheduler,
    UnbatchedReferenceAsyncScheduler,
    UnbatchedReferenceScheduler,
)

__all__ = ["AsyncScheduler", "Block", "DeviceAsyncScheduler", "DeviceScheduler", "KVCacheManager",
           "ReferenceAsyncScheduler", "ReferenceScheduler", "Scheduler", "UnbatchedDeviceAsyncScheduler",
           "UnbatchedDeviceScheduler", "UnbatchedReferenceAsyncScheduler", "UnbatchedReferenceScheduler",
           "UnsupportedConfigError"]
