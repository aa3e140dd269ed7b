"""gpukv under vLLM's v1 engine (``--scheduler-cls gpukv.vllm.AsyncScheduler``).

Which vLLM is installed picks the adapter, at import:

* vLLM 0.8.5 (no ``AsyncScheduler``; the ``vllm085`` extra): ``gpukv.vllm.v0_8.manager`` and
  ``gpukv.vllm.v0_8.scheduler``.

  * ``KVCacheManager``: vLLM 0.8.5's ``KVCacheManager`` interface on a gpukv
    manager (the device manager on CUDA, the reference elsewhere).
  * ``Scheduler``: vLLM's v1 ``Scheduler`` running on it, selectable as
    ``vllm serve MODEL --scheduler-cls gpukv.vllm.Scheduler``;
    ``ReferenceScheduler`` and ``DeviceScheduler`` pin the backend;
    ``UnbatchedReferenceScheduler`` and ``UnbatchedDeviceScheduler`` run
    vLLM's own loop on them (one manager call per request) instead of the
    batched ``schedule()``, the default (``BatchedReferenceScheduler`` is
    ``ReferenceScheduler``'s old name for it).

* vLLM 0.33 and 0.34 (one API generation: vLLM's ``AsyncScheduler``
  exists): ``gpukv.vllm.v0_33``: ``KVCacheManager`` (the generation's
  interface; where a release changed a rule the adapter follows what the
  installed vLLM offers, ``gpukv.vllm.v0_33.features``), ``Scheduler`` and
  ``AsyncScheduler`` (vLLM's, on it; async is the engine's default),
  ``ReferenceScheduler``, ``ReferenceAsyncScheduler``, ``DeviceScheduler``,
  ``DeviceAsyncScheduler`` (the running loop's allocations batched into one
  gpukv step), ``Unbatched*`` of the four (one gpukv call per request),
  ``UnsupportedConfigError``; ``Worker`` (``--worker-cls gpukv.vllm.Worker``):
  vLLM's GPU worker whose model runner reads gpukv's device block tables
  (``gpukv.vllm.v0_33.worker``; one GPU).

The adapter is picked by what the installed vLLM offers, not by its version
string. The version is checked against the tested releases
(``gpukv.vllm_plugin.TESTED_VLLM``): another is refused with an
``UntestedVllmError`` saying what to install, unless
``GPUKV_ALLOW_UNTESTED_VLLM=1``; either way the 0.33 generation's
conformance check (``gpukv.vllm.v0_33.conformance``) then refuses a vLLM
whose manager interface or ``Request`` the adapter does not cover.
"""

from __future__ import annotations

from gpukv import _runtime  # noqa: F401  (Triton's interpreter without CUDA, set before vLLM imports triton)
from gpukv.vllm_plugin import TESTED_VLLM, UntestedVllmError, check_vllm_version, has_async_scheduler, install_hint

try:
    import vllm as _vllm
    import vllm.v1.core.sched.scheduler  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise UntestedVllmError(f"gpukv.vllm needs vLLM (tested: {', '.join(TESTED_VLLM)}), and vLLM is not importable "
                            f"({exc})", argument="vllm", fix=install_hint()) from exc

VLLM_VERSION: str = _vllm.__version__
check_vllm_version(VLLM_VERSION)


if has_async_scheduler():
    from gpukv.vllm.v0_33 import (
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
    from gpukv.vllm.v0_33.conformance import check_conformance

    check_conformance()

    def __getattr__(name: str) -> object:
        """``Worker`` (``--worker-cls gpukv.vllm.Worker``), imported on first use: vLLM's worker module is heavy."""
        if name == "Worker":
            from gpukv.vllm.v0_33.worker import Worker

            return Worker
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

    __all__ = ["AsyncScheduler", "Block", "DeviceAsyncScheduler", "DeviceScheduler", "KVCacheManager",
               "ReferenceAsyncScheduler", "ReferenceScheduler", "Scheduler", "UnbatchedDeviceAsyncScheduler",
               "UnbatchedDeviceScheduler", "UnbatchedReferenceAsyncScheduler", "UnbatchedReferenceScheduler",
               "UnsupportedConfigError"]
else:
    from gpukv.vllm.v0_8.manager import Block, KVCacheManager  # type: ignore[assignment]
    from gpukv.vllm.v0_8.scheduler import (  # type: ignore[assignment]
        BatchedReferenceScheduler,
        DeviceScheduler,
        ReferenceScheduler,
        Scheduler,
        UnbatchedDeviceScheduler,
        UnbatchedReferenceScheduler,
    )

    __all__ = ["BatchedReferenceScheduler", "Block", "DeviceScheduler", "KVCacheManager", "ReferenceScheduler",
               "Scheduler", "UnbatchedDeviceScheduler", "UnbatchedReferenceScheduler"]
