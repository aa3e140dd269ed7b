"""gpukv: a KV-cache block manager for LLM serving whose state lives on the GPU.

The public API. ``gpukv.reference`` holds the sequential reference manager (the
executable spec); the host controller sizes the cache (``get_kv_cache_config``)
and reconciles it across ranks (``reconcile_kv_cache_config``).
"""

from gpukv import _runtime  # noqa: F401  (sets up Triton's interpreter before triton loads)
from gpukv.config import (
    available_kv_cache_memory,
    check_enough_kv_cache_memory,
    get_kv_cache_config,
    unify_kv_cache_configs,
)
from gpukv.distributed import reconcile_kv_cache_config
from gpukv.errors import (
    CapacityError,
    DuplicateRequestError,
    GpukvError,
    GpukvInputError,
    InvalidInputError,
    InvalidTypeError,
    ManagerFailedError,
    NoFreeBlocksError,
    StaleComputedBlocksError,
    UnknownRequestError,
)
from gpukv.hashing import MMItem
from gpukv.metrics import PrefixCacheStats, PrefixCachingMetrics
from gpukv.request import ComputedBlocks, NewRequest, RunningUpdate, StepResult
from gpukv.spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    SlidingWindowSpec,
)

__version__ = "0.1.0"

__all__ = [
    "CapacityError",
    "ComputedBlocks",
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
