"""What the installed vLLM of this API generation (0.33, 0.34) offers, read
from vLLM itself rather than from its version string.

One adapter serves the generation; where a release changed a rule, the rule
is chosen here, once, by the feature vLLM has:

* the prefix-cache read limit: ``Request.prefix_cache_hit_limit`` (0.34: 0
  skips the lookup, None is unbounded, N > 0 bounds a hit to N tokens, read
  through ``Request.get_max_cache_hit_length``) or
  ``Request.skip_reading_prefix_cache`` (0.33: a flag);
* ``KVCacheManager.get_num_cached_tokens`` (0.34's cache-aware admission
  probes the cache with it);
* what a LoRA request's block hashes key of its adapter
  (``kv_cache_utils._gen_lora_extra_hash_keys``: 0.33 and 0.34 its name and
  path), asked of vLLM itself (``gpukv.vllm.v0_33.lora_ids``);
* which single-type manager vLLM runs a KV-cache group on
  (``KVCacheSpecRegistry``: by the spec's class and the group's role; MLA
  layers on the full-attention manager), asked of vLLM itself
  (``gpukv.vllm.v0_33.groups``).
"""

from __future__ import annotations

from typing import Any


def _request_cls() -> Any:
    from vllm.v1.request import Request

    return Request


HIT_LIMIT = hasattr(_request_cls(), "get_max_cache_hit_length")
"""vLLM's ``Request`` bounds hits by ``prefix_cache_hit_limit`` (0.34 on)."""


def _lora_hash_keys() -> Any:
    from vllm.v1.core import kv_cache_utils

    return getattr(kv_cache_utils, "_gen_lora_extra_hash_keys", None)


LORA_HASH_KEYS = _lora_hash_keys()
"""vLLM's rule ``request -> what its block hashes key of the request's LoRA
adapter`` (a list), or None where vLLM has none by that name."""


def _spec_registry() -> Any:
    try:
        from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry
    except ImportError:
        return None
    return KVCacheSpecRegistry


KV_CACHE_SPEC_REGISTRY = _spec_registry()
"""vLLM's registry of which single-type manager runs a KV-cache spec
(``get_manager_class(spec, role)``), or None where vLLM has none (its
managers then follow the spec's class alone)."""


def skips_cache(request: Any) -> bool:
    """Whether ``request`` never reads the prefix cache (prompt logprobs or
    pooling asked so)."""
    if HIT_LIMIT:
        return request.prefix_cache_hit_limit == 0
    return bool(request.skip_reading_prefix_cache)


def hit_bounded(request: Any) -> bool:
    """Whether ``request``'s hits are bounded below ``num_tokens - 1`` by the
    request itself (0.34's prompt-logprob start), so no batched run may take it."""
    return HIT_LIMIT and request.prefix_cache_hit_limit is not None


def max_cache_hit_length(request: Any, bound: int | None) -> int:
    """The longest hit vLLM allows ``request``: ``num_tokens - 1``, the
    request's own limit (0.34) and ``bound`` (None: none), the least of them."""
    if HIT_LIMIT:
        return int(request.get_max_cache_hit_length(bound))
    return request.num_tokens - 1 if bound is None else bound
