"""gpukv under vLLM 0.8.5's v1 engine (the ``vllm`` extra: ``pip install 'gpukv[vllm]'``).

* ``KVCacheManager``: vLLM 0.8.5's ``KVCacheManager`` interface on a gpukv
  manager (the device manager on CUDA, the reference elsewhere).
* ``Scheduler``: vLLM's v1 ``Scheduler`` running on it, selectable as
  ``vllm serve MODEL --scheduler-cls gpukv.vllm.Scheduler``;
  ``ReferenceScheduler`` and ``DeviceScheduler`` pin the backend;
  ``UnbatchedReferenceScheduler`` and ``UnbatchedDeviceScheduler`` run
  vLLM's own loop on them (one manager call per request) instead of the
  batched ``schedule()``, the default (``BatchedReferenceScheduler`` is
  ``ReferenceScheduler``'s old name for it).
"""

from __future__ import annotations

from gpukv import _runtime  # noqa: F401  (Triton's interpreter without CUDA, set before vLLM imports triton)

try:
    import vllm.v1.core.sched.scheduler  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("gpukv.vllm needs vLLM 0.8.5: pip install 'gpukv[vllm]'") from exc

from gpukv.vllm.manager import Block, KVCacheManager
from gpukv.vllm.scheduler import (
    BatchedReferenceScheduler,
    DeviceScheduler,
    ReferenceScheduler,
    Scheduler,
    UnbatchedDeviceScheduler,
    UnbatchedReferenceScheduler,
)

__all__ = ["BatchedReferenceScheduler", "Block", "DeviceScheduler", "KVCacheManager", "ReferenceScheduler",
           "Scheduler", "UnbatchedDeviceScheduler", "UnbatchedReferenceScheduler"]
