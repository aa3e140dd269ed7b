"""gpukv: a KV-cache block manager for LLM serving whose state lives on the GPU.

The public API. ``gpukv.reference`` holds the sequential reference manager (the
executable spec); the host controller sizes the cache (``get_kv_cache_config``)
and reconciles it across ranks (``reconcile_kv_cache_config``).

Importing the package is cheap: it imports neither torch nor triton (so that
``gpukv --version`` answers at once and ``gpukv replay --metrics-port`` serves
its metrics before torch has loaded, issue 19). Each public name is imported
from its module when first used (PEP 562); a module that imports torch is
imported after ``gpukv._runtime``, which switches on Triton's interpreter on a
machine without CUDA before triton loads (every module that imports triton
imports ``gpukv._runtime`` first).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = [
    "AddressError",
    "AddressInUseError",
    "CapacityError",
    "ComputedBlocks",
    "ConcurrentCallError",
    "DuplicateRequestError",
    "FullAttentionSpec",
    "GpukvError",
    "GpukvInputError",
    "InvalidInputError",
    "InvalidTypeError",
    "KVCacheConfig",
    "KVCacheGroupSpec",
    "KVCacheSpec",
    "KVCacheTensor",
    "MMItem",
    "ManagerFailedError",
    "NewRequest",
    "NoFreeBlocksError",
    "PrefixCacheStats",
    "PrefixCachingMetrics",
    "PublisherClosedError",
    "ReconcileError",
    "RunningBatch",
    "RunningUpdate",
    "SlidingWindowSpec",
    "StaleComputedBlocksError",
    "StepResult",
    "UnknownRequestError",
    "available_kv_cache_memory",
    "check_enough_kv_cache_memory",
    "get_kv_cache_config",
    "reconcile_kv_cache_config",
    "unify_kv_cache_configs",
]

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time, __getattr__ below
    from gpukv.config import (
        available_kv_cache_memory,
        check_enough_kv_cache_memory,
        get_kv_cache_config,
        unify_kv_cache_configs,
    )
    from gpukv.distributed import reconcile_kv_cache_config
    from gpukv.errors import (
        AddressError,
        AddressInUseError,
        CapacityError,
        ConcurrentCallError,
        DuplicateRequestError,
        GpukvError,
        GpukvInputError,
        InvalidInputError,
        InvalidTypeError,
        ManagerFailedError,
        NoFreeBlocksError,
        PublisherClosedError,
        ReconcileError,
        StaleComputedBlocksError,
        UnknownRequestError,
    )
    from gpukv.hashing import MMItem
    from gpukv.metrics import PrefixCacheStats, PrefixCachingMetrics
    from gpukv.request import ComputedBlocks, NewRequest, RunningUpdate, StepResult
    from gpukv.running import RunningBatch
    from gpukv.spec import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheSpec,
        KVCacheTensor,
        SlidingWindowSpec,
    )

# The submodule each public name comes from (tests/test_cli.py checks this
# against __all__ and the block above).
_FROM: dict[str, tuple[str, ...]] = {
    "config": ("available_kv_cache_memory", "check_enough_kv_cache_memory", "get_kv_cache_config",
               "unify_kv_cache_configs"),
    "distributed": ("reconcile_kv_cache_config",),
    "errors": ("AddressError", "AddressInUseError", "CapacityError", "ConcurrentCallError", "DuplicateRequestError",
               "GpukvError",
               "GpukvInputError", "InvalidInputError", "InvalidTypeError", "ManagerFailedError", "NoFreeBlocksError",
               "PublisherClosedError", "ReconcileError", "StaleComputedBlocksError", "UnknownRequestError"),
    "hashing": ("MMItem",),
    "metrics": ("PrefixCacheStats", "PrefixCachingMetrics"),
    "request": ("ComputedBlocks", "NewRequest", "RunningUpdate", "StepResult"),
    "running": ("RunningBatch",),
    "spec": ("FullAttentionSpec", "KVCacheConfig", "KVCacheGroupSpec", "KVCacheSpec", "KVCacheTensor",
             "SlidingWindowSpec"),
}
_MODULE_OF = {name: module for module, names in _FROM.items() for name in names}
# Those that import neither torch nor triton; any other comes after gpukv._runtime.
_LIGHT = frozenset({"errors", "hashing", "metrics", "windows"})
# The submodules `import gpukv` loaded before issue 19 stay attributes of a
# bare `import gpukv` (`gpukv.config.get_kv_cache_config`).
_SUBMODULES = frozenset({*_FROM, "_runtime", "windows"})


def _submodule(name: str) -> Any:
    if name not in _LIGHT:
        importlib.import_module(f"{__name__}._runtime")  # before anything can load triton
    return importlib.import_module(f"{__name__}.{name}")


if not TYPE_CHECKING:  # hidden from type checkers, which would take any name as valid

    def __getattr__(name: str) -> Any:
        if name in _MODULE_OF:
            value = getattr(_submodule(_MODULE_OF[name]), name)
            globals()[name] = value  # once: later lookups skip __getattr__
            return value
        if name in _SUBMODULES:
            return _submodule(name)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    """The public names, the submodules and the module's own dunders; not what
    this file imports for itself (``importlib``, ``Any``, ``TYPE_CHECKING``,
    ``annotations``) nor its private helpers."""
    loaded = {name for name, value in globals().items()
              if getattr(value, "__name__", "").startswith(f"{__name__}.") and not name.startswith("_")}
    dunders = {name for name in globals() if name.startswith("__") and name.endswith("__")}
    return sorted({*dunders, *__all__, *(m for m in _SUBMODULES if not m.startswith("_")), *loaded})
