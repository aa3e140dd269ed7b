"""gpukv: a KV-cache block manager for LLM serving whose state lives on the GPU.

The public API, what a serving loop needs: the two managers (``DeviceManager``
on the GPU, ``ReferenceManager`` its executable spec on the host) and the
protocol both offer (``BlockManager``); the request and result types; the base
error (the others are in ``gpukv.errors``); the cache's sizing
(``get_kv_cache_config``, from the specs) and its reconciliation across ranks
(``reconcile_kv_cache_config``); the slot mapping computed from the device's
block tables; the decode step as CUDA graphs; a router's index of the events.
The vLLM adapters are ``gpukv.vllm``'s.

Importing the package is cheap: it imports neither torch nor triton (so that
``gpukv --version`` answers at once and ``gpukv replay --metrics-port`` serves
its metrics before torch has loaded). Each public name is imported from its
module when first used (PEP 562); a module that imports torch is imported
after ``gpukv._runtime``, which switches on Triton's interpreter on a machine
without CUDA before triton loads (every module that imports triton imports
``gpukv._runtime`` first).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = [
    "BlockManager",
    "ComputedBlocks",
    "DecodeGraphs",
    "DeviceManager",
    "FullAttentionSpec",
    "GpukvError",
    "KVCacheConfig",
    "MMItem",
    "NewRequest",
    "PrefixCacheStats",
    "PrefixHit",
    "ReferenceManager",
    "RouterIndex",
    "RunningBatch",
    "RunningUpdate",
    "SlidingWindowSpec",
    "StepResult",
    "get_kv_cache_config",
    "reconcile_kv_cache_config",
    "slot_mapping",
]

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time, __getattr__ below
    from gpukv.core.hashing import MMItem
    from gpukv.core.metrics import PrefixCacheStats
    from gpukv.core.protocol import BlockManager
    from gpukv.core.requests import ComputedBlocks, NewRequest, PrefixHit, RunningUpdate, StepResult
    from gpukv.core.running_batch import RunningBatch
    from gpukv.device.graphs import DecodeGraphs
    from gpukv.device.manager import DeviceManager
    from gpukv.errors import GpukvError
    from gpukv.events.router import RouterIndex
    from gpukv.kernels.slot_mapping import slot_mapping
    from gpukv.reference.manager import ReferenceManager
    from gpukv.sizing.config import get_kv_cache_config
    from gpukv.sizing.reconcile import reconcile_kv_cache_config
    from gpukv.sizing.spec import FullAttentionSpec, KVCacheConfig, SlidingWindowSpec

# The submodule each public name comes from (tests/tools/test_cli.py checks this
# against __all__ and the block above).
_FROM: dict[str, tuple[str, ...]] = {
    "core.protocol": ("BlockManager",),
    "sizing.config": ("get_kv_cache_config",),
    "sizing.reconcile": ("reconcile_kv_cache_config",),
    "errors": ("GpukvError",),
    "events.router": ("RouterIndex",),
    "device.graphs": ("DecodeGraphs",),
    "core.hashing": ("MMItem",),
    "kernels.slot_mapping": ("slot_mapping",),
    "device.manager": ("DeviceManager",),
    "core.metrics": ("PrefixCacheStats",),
    "reference.manager": ("ReferenceManager",),
    "core.requests": ("ComputedBlocks", "NewRequest", "PrefixHit", "RunningUpdate", "StepResult"),
    "core.running_batch": ("RunningBatch",),
    "sizing.spec": ("FullAttentionSpec", "KVCacheConfig", "SlidingWindowSpec"),
}
_MODULE_OF = {name: module for module, names in _FROM.items() for name in names}
# The layers' folders (each ``__init__`` is a docstring, it imports nothing).
_LAYERS = frozenset({"core", "device", "events", "kernels", "reference", "sizing", "tools"})
# Those that import neither torch nor triton; any other comes after gpukv._runtime.
_LIGHT = frozenset({*_LAYERS, "errors", "events.router", "core.hashing", "core.metrics", "core.windows"})
# Submodules a bare `import gpukv` answers as attributes (`gpukv.sizing.config` once loaded):
# the layers' folders, the errors and the process-wide runtime.
_SUBMODULES = frozenset({*_LAYERS, "errors", "_runtime"})


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
