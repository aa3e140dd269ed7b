"""gpukv under vLLM's v1 engine (the ``vllm`` extra: ``pip install 'gpukv[vllm]'``).

Which vLLM is installed picks the adapter, at import:

* vLLM 0.8.x (0.8.5, the ``vllm`` extra): ``gpukv.vllm.manager`` and
  ``gpukv.vllm.scheduler``.

  * ``KVCacheManager``: vLLM 0.8.5's ``KVCacheManager`` interface on a gpukv
    manager (the device manager on CUDA, the reference elsewhere).
  * ``Scheduler``: vLLM's v1 ``Scheduler`` running on it, selectable as
    ``vllm serve MODEL --scheduler-cls gpukv.vllm.Scheduler``;
    ``ReferenceScheduler`` and ``DeviceScheduler`` pin the backend;
    ``UnbatchedReferenceScheduler`` and ``UnbatchedDeviceScheduler`` run
    vLLM's own loop on them (one manager call per request) instead of the
    batched ``schedule()``, the default (``BatchedReferenceScheduler`` is
    ``ReferenceScheduler``'s old name for it).

* vLLM 0.33.x: ``gpukv.vllm.v0_33``: ``KVCacheManager`` (0.33's interface),
  ``Scheduler`` and ``AsyncScheduler`` (vLLM 0.33's, on it; async is the
  engine's default), ``ReferenceScheduler``, ``ReferenceAsyncScheduler``,
  ``DeviceScheduler``, ``DeviceAsyncScheduler`` (the running loop's
  allocations batched into one gpukv step), ``Unbatched*`` of the four (one
  gpukv call per request), ``UnsupportedConfigError``.

* Any other vLLM: an ImportError naming the supported versions.
"""

from __future__ import annotations

from gpukv import _runtime  # noqa: F401  (Triton's interpreter without CUDA, set before vLLM imports triton)

SUPPORTED = ("0.8.x (0.8.5)", "0.33.x (0.33.0)")
_INSTALL = ("install one: pip install 'gpukv[vllm]' (vLLM 0.8.5), or vLLM 0.33.0 "
            "(tests/test_vllm033/requirements-vllm033.txt has the recipe)")

try:
    import vllm as _vllm
    import vllm.v1.core.sched.scheduler  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(f"gpukv.vllm needs vLLM {' or '.join(SUPPORTED)}, and vLLM is not importable ({exc}); "
                      f"{_INSTALL}") from exc

VLLM_VERSION: str = _vllm.__version__

if VLLM_VERSION.startswith("0.8."):
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
elif VLLM_VERSION.startswith("0.33."):
    from gpukv.vllm.v0_33 import (  # type: ignore[assignment]
        AsyncScheduler,
        Block,
        DeviceAsyncScheduler,
        DeviceScheduler,
        KVCacheManager,
        ReferenceAsyncScheduler,
        ReferenceScheduler,
        Scheduler,
        UnbatchedDeviceAsyncScheduler,
        UnbatchedDeviceScheduler,
        UnbatchedReferenceAsyncScheduler,
        UnbatchedReferenceScheduler,
        UnsupportedConfigError,
    )

    __all__ = ["AsyncScheduler", "Block", "DeviceAsyncScheduler", "DeviceScheduler", "KVCacheManager",
               "ReferenceAsyncScheduler", "ReferenceScheduler", "Scheduler", "UnbatchedDeviceAsyncScheduler",
               "UnbatchedDeviceScheduler", "UnbatchedReferenceAsyncScheduler", "UnbatchedReferenceScheduler",
               "UnsupportedConfigError"]
else:
    raise ImportError(f"gpukv.vllm supports vLLM {' and '.join(SUPPORTED)}; found vLLM {VLLM_VERSION}; {_INSTALL}")
