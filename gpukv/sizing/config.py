"""The host controller's side of sizing: how many blocks fit, how layers are
grouped, and how much device memory the cache may take.

Three jobs, in the order a server does them:

1. ``available_kv_cache_memory``: ask the device how much memory is left for
   the cache (NVML, else ``torch.cuda.mem_get_info``); the arithmetic is the
   pure function ``kv_cache_budget``.
2. ``get_kv_cache_config``: turn per-layer specs and that budget into a
   ``KVCacheConfig`` (after ``check_enough_kv_cache_memory`` has made sure one
   request of ``max_model_len`` tokens fits).
3. ``unify_kv_cache_configs``: several workers' configs must agree on the
   groups; all take the smallest ``num_blocks``
   (``gpukv.sizing.reconcile.reconcile_kv_cache_config`` does it across processes).

All sizes are bytes and ints; nothing here rounds through floats except the
utilisation fraction and the numbers printed in messages.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from gpukv.sizing.spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    SlidingWindowSpec,
)

__all__ = [
    "check_enough_kv_cache_memory",
    "get_kv_cache_config",
    "unify_kv_cache_configs",
    "kv_cache_budget",
    "device_memory_info",
    "available_kv_cache_memory",
]

logger = logging.getLogger("gpukv")

GiB = 1 << 30

# vLLM's rule for grouping a hybrid model: when the most numerous layer type has
# fewer than 1.25x the layers of the least numerous one, pad every group to the
# largest count (wasting < 20% of one type's tensors) rather than split into
# many small groups. Kept as a fraction of ints so the comparison is exact.
_PAD_RATIO_NUM, _PAD_RATIO_DEN = 5, 4


# --------------------------------------------------------------------------
# input checks


def _require_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")


def _require_positive(name: str, value: Any) -> None:
    _require_int(name, value)
    if value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value}")


def _check_specs(kv_cache_spec: Any) -> None:
    if not isinstance(kv_cache_spec, Mapping):
        raise TypeError(
            "kv_cache_spec must be a dict of layer name -> KVCacheSpec, "
            f"got {type(kv_cache_spec).__name__}"
        )
    if not kv_cache_spec:
        raise ValueError(
            "kv_cache_spec is empty: pass one KVCacheSpec per attention layer "
            "(a model without attention layers needs no KV cache)"
        )
    for name, spec in kv_cache_spec.items():
        if not isinstance(name, str):
            raise TypeError(f"layer names must be str, got {name!r}")
        if not isinstance(spec, KVCacheSpec):
            raise TypeError(
                f"layer {name!r} has {type(spec).__name__}, expected a KVCacheSpec "
                "(FullAttentionSpec or SlidingWindowSpec)"
            )


def _check_lengths(max_model_len: Any, max_num_batched_tokens: Any) -> None:
    _require_positive("max_model_len", max_model_len)
    if max_num_batched_tokens is not None:
        _require_positive("max_num_batched_tokens", max_num_batched_tokens)


# --------------------------------------------------------------------------
# 1. does one max-length request fit?


def _max_request_bytes(
    kv_cache_spec: Mapping[str, KVCacheSpec], max_model_len: int, max_num_batched_tokens: int | None
) -> int:
    """Bytes one request of ``max_model_len`` tokens holds, summed over layers."""
    return sum(
        spec.max_memory_usage_bytes(max_model_len, max_num_batched_tokens)
        for spec in kv_cache_spec.values()
    )


def _largest_fitting_model_len(fits: Callable[[int], bool], upper: int) -> int:
    """The largest length in ``[1, upper]`` for which ``fits`` holds, or 0 if none.

    Binary search: what a request needs never shrinks as it grows, so ``fits``
    is true up to some length and false after it.
    """
    lo, hi = 0, upper  # invariant: lo fits (0 trivially), nothing above hi does
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _not_enough_memory(need: str, have: str, max_model_len: int, fitting: int) -> ValueError:
    """The one wording of 'a max-length request does not fit', with what to change."""
    if fitting > 0:
        fits = f"The largest max_model_len that fits is {fitting}."
        lower = f"lower max_model_len to {fitting} or less"
    else:
        fits = "Not even a 1-token request fits."
        lower = "use a smaller model or a smaller KV cache dtype"
    return ValueError(
        f"not enough memory for the KV cache: one request of max_model_len={max_model_len} "
        f"tokens needs {need}, but {have}. "
        f"{fits} Raise gpu_memory_utilization, {lower}, or spread the model over more GPUs."
    )


def check_enough_kv_cache_memory(
    kv_cache_spec: dict[str, KVCacheSpec],
    available_memory: int,
    *,
    max_model_len: int,
    max_num_batched_tokens: int | None = None,
) -> None:
    """Raise ValueError unless one request of ``max_model_len`` tokens fits.

    The need is the sum over layers of ``max_memory_usage_bytes`` (vLLM's
    check). The message gives it and the available memory in GiB, the largest
    ``max_model_len`` that would fit, and what to change.
    ``get_kv_cache_config`` checks again against the layout it builds, which
    also counts the null block and padded groups.
    """
    _check_specs(kv_cache_spec)
    _require_int("available_memory", available_memory)
    _check_lengths(max_model_len, max_num_batched_tokens)

    if available_memory <= 0:
        raise ValueError(
            f"no memory left for the KV cache (available_memory={available_memory} bytes): "
            "the model and other allocations already take the whole share of the GPU. "
            "Raise gpu_memory_utilization, free memory held by other processes, "
            "or spread the model over more GPUs."
        )

    needed = _max_request_bytes(kv_cache_spec, max_model_len, max_num_batched_tokens)
    if needed <= available_memory:
        return
    fitting = _largest_fitting_model_len(
        lambda n: _max_request_bytes(kv_cache_spec, n, max_num_batched_tokens) <= available_memory,
        max_model_len,
    )
    raise _not_enough_memory(
        f"{needed / GiB:.2f} GiB over {len(kv_cache_spec)} layers",
        f"only {available_memory / GiB:.2f} GiB is available",
        max_model_len,
        fitting,
    )


# --------------------------------------------------------------------------
# 2. the config


def _as_full_attention(spec: KVCacheSpec) -> KVCacheSpec:
    """The seed's fallback: a sliding-window layer described as full attention
    (same block size, heads, head size, dtype): it then keeps every block."""
    if isinstance(spec, SlidingWindowSpec):
        return FullAttentionSpec(
            spec.block_size, spec.num_kv_heads, spec.head_size, spec.dtype, use_mla=spec.use_mla
        )
    return spec


def _layers_by_type(kv_cache_spec: Mapping[str, KVCacheSpec]) -> dict[str, list[str]]:
    """type_id -> layer names; types in order of first appearance, layers in dict order."""
    by_type: dict[str, list[str]] = {}
    for name, spec in kv_cache_spec.items():
        by_type.setdefault(spec.type_id, []).append(name)
    return by_type


def _describe_disagreement(
    kv_cache_spec: Mapping[str, KVCacheSpec], attribute: str, unit: str
) -> str:
    """e.g. '65536 bytes: layers a, b, c (+29 more); 32768 bytes: layers x'."""
    by_value: dict[int, list[str]] = {}
    for name, spec in kv_cache_spec.items():
        by_value.setdefault(getattr(spec, attribute), []).append(name)
    parts = []
    for value, names in by_value.items():
        shown = ", ".join(names[:3])
        more = f" (+{len(names) - 3} more)" if len(names) > 3 else ""
        parts.append(f"{value} {unit}: layers {shown}{more}")
    return "; ".join(parts)


def _group_size(layer_counts: Sequence[int]) -> int:
    """How many layers each group holds (vLLM's rule).

    Normally the smallest type's count, so every type splits into whole groups
    without padding. When the counts are close (largest < 1.25x smallest),
    the largest count instead: one group per type, the smaller types padded,
    which keeps the number of groups (block tables per request) at a minimum.
    With one type this is simply its layer count: one group.
    """
    smallest, largest = min(layer_counts), max(layer_counts)
    if largest * _PAD_RATIO_DEN < smallest * _PAD_RATIO_NUM:
        return largest
    return smallest


def _group_layers(kv_cache_spec: Mapping[str, KVCacheSpec]) -> tuple[list[KVCacheGroupSpec], int]:
    """Cut each type's layers (in order) into groups of ``group_size``;
    return the groups (types in first-appearance order) and ``group_size``."""
    by_type = _layers_by_type(kv_cache_spec)
    group_size = _group_size([len(names) for names in by_type.values()])
    groups = [
        KVCacheGroupSpec(layer_names=names[start : start + group_size],
                         kv_cache_spec=kv_cache_spec[names[0]])
        for names in by_type.values()
        for start in range(0, len(names), group_size)
    ]
    return groups, group_size


def _blocks_per_request(
    groups: Sequence[KVCacheGroupSpec], max_model_len: int, max_num_batched_tokens: int | None
) -> int:
    """Pool blocks one request of ``max_model_len`` tokens holds: in every
    group, as many as that group's spec needs (all pages are the same size)."""
    return sum(
        g.kv_cache_spec.max_memory_usage_bytes(max_model_len, max_num_batched_tokens)
        // g.kv_cache_spec.page_size_bytes
        for g in groups
    )


def _check_pool_holds_one_request(
    groups: Sequence[KVCacheGroupSpec],
    group_size: int,
    fitting_blocks: int,
    available_memory: int,
    max_model_len: int,
    max_num_batched_tokens: int | None,
) -> int:
    """Raise unless ``fitting_blocks`` hold one max-length request plus the null
    block; return the blocks that takes. Stricter than the per-layer sum: a
    padded group costs pool blocks as if it had ``group_size`` layers, and
    block 0 is never allocated."""

    def blocks_needed(length: int) -> int:
        return _blocks_per_request(groups, length, max_num_batched_tokens) + 1  # + null block

    needed = blocks_needed(max_model_len)
    if needed <= fitting_blocks:
        return needed
    page = groups[0].kv_cache_spec.page_size_bytes
    fitting = _largest_fitting_model_len(
        lambda n: blocks_needed(n) <= fitting_blocks, max_model_len
    )
    raise _not_enough_memory(
        f"{needed} blocks of the shared pool ({needed - 1} + the null block), "
        f"{needed * page * group_size / GiB:.2f} GiB",
        f"the {available_memory / GiB:.2f} GiB available hold only {fitting_blocks} blocks",
        max_model_len,
        fitting,
    )


def _apply_override(num_blocks: int, num_gpu_blocks_override: int | None) -> int:
    if num_gpu_blocks_override is None:
        return num_blocks
    logger.info(
        "num_gpu_blocks_override=%d replaces the %d blocks that fit in memory",
        num_gpu_blocks_override,
        num_blocks,
    )
    if num_gpu_blocks_override > num_blocks:
        logger.warning(
            "num_gpu_blocks_override=%d is more blocks than fit in the available memory (%d); "
            "allocating the cache may fail",
            num_gpu_blocks_override,
            num_blocks,
        )
    return num_gpu_blocks_override


def _log_capacity(
    groups: Sequence[KVCacheGroupSpec],
    group_size: int,
    num_blocks: int,
    max_model_len: int,
    max_num_batched_tokens: int | None,
) -> None:
    """One INFO line: what the cache holds and how many max-length requests fit."""
    block_size = groups[0].kv_cache_spec.block_size
    if len(groups) == 1:
        tokens = num_blocks * block_size
        logger.info(
            "KV cache: %s blocks of %d tokens = %s tokens per layer over %d layers; "
            "max concurrency for %s tokens per request: %.2fx",
            f"{num_blocks:,}", block_size, f"{tokens:,}", group_size,
            f"{max_model_len:,}", tokens / max_model_len,
        )
        return
    # With several groups a token costs a block in each group it is kept in,
    # so count blocks per request rather than tokens.
    per_request = _blocks_per_request(groups, max_model_len, max_num_batched_tokens)
    logger.info(
        "KV cache: %s blocks of %d tokens shared by %d groups of up to %d layers; "
        "a %s-token request needs %d blocks; max concurrency for %s tokens per request: %.2fx",
        f"{num_blocks:,}", block_size, len(groups), group_size,
        f"{max_model_len:,}", per_request, f"{max_model_len:,}", num_blocks / per_request,
    )


def get_kv_cache_config(
    kv_cache_spec: dict[str, KVCacheSpec],
    available_memory: int,
    *,
    max_model_len: int,
    num_gpu_blocks_override: int | None = None,
    max_num_batched_tokens: int | None = None,
    sliding_window_as_full_attention: bool = False,
) -> KVCacheConfig:
    """Size the cache and group the layers.

    Args:
        kv_cache_spec: layer name -> spec, in model order (the order fixes the
            groups and tensors, so every rank must pass the same order).
        available_memory: bytes the cache may use (see
            ``available_kv_cache_memory``).
        max_model_len: the longest request; one such request (plus the null
            block) must fit in the pool.
        num_gpu_blocks_override: use this many blocks instead of what fits.
        max_num_batched_tokens: most tokens scheduled in one step (bounds a
            sliding-window layer's need); default ``max_model_len``.
        sliding_window_as_full_attention: the seed's behaviour: describe every
            sliding-window layer as full attention, so a model whose layers
            share one page size becomes one group (for a caller that manages
            a single group; costs the memory the window would have saved).

    Layout (vLLM's uniform-page-size scheme; a uniform model is its one-type case):
        Layers are grouped by ``type_id`` (types in first-appearance order,
        layers in dict order) and each type is cut into groups of
        ``group_size`` layers (see ``_group_size``); every group has its own
        block table, all draw from one pool of
        ``num_blocks = available_memory // page_size // group_size`` blocks.
        There are ``group_size`` tensors of ``page_size * num_blocks`` bytes;
        tensor ``i`` is shared by the ``i``-th layer of every group that has
        one, so a block id names the same bytes in each. A uniform model is
        one group, one tensor per layer,
        ``num_blocks = available_memory // page_size // num_layers``.

        Page sizes or block sizes that differ between layers: ValueError.
        (Treating sliding windows as full attention cannot help there: it
        keeps each layer's page size.)
    """
    _check_config_arguments(kv_cache_spec, available_memory, max_model_len, num_gpu_blocks_override,
                            max_num_batched_tokens, sliding_window_as_full_attention)
    specs = _specs_in_use(kv_cache_spec, sliding_window_as_full_attention)
    # Check the specs actually used: after the fallback a former sliding-window
    # layer needs a full-length request's worth of blocks.
    check_enough_kv_cache_memory(specs, available_memory, max_model_len=max_model_len,
                                 max_num_batched_tokens=max_num_batched_tokens)
    return _lay_out(specs, available_memory, max_model_len, num_gpu_blocks_override, max_num_batched_tokens)


def _check_config_arguments(
    kv_cache_spec: Any,
    available_memory: Any,
    max_model_len: Any,
    num_gpu_blocks_override: Any,
    max_num_batched_tokens: Any,
    sliding_window_as_full_attention: Any,
) -> None:
    """get_kv_cache_config's arguments, checked before any of them is used."""
    _check_specs(kv_cache_spec)
    _require_int("available_memory", available_memory)
    if available_memory < 0:
        raise ValueError(
            f"available_memory must be >= 0 bytes, got {available_memory}; "
            "pass the bytes the KV cache may use (see available_kv_cache_memory)"
        )
    _check_lengths(max_model_len, max_num_batched_tokens)
    if num_gpu_blocks_override is not None:
        _require_positive("num_gpu_blocks_override", num_gpu_blocks_override)
    if not isinstance(sliding_window_as_full_attention, bool):
        raise TypeError(
            "sliding_window_as_full_attention must be a bool, "
            f"got {sliding_window_as_full_attention!r}"
        )


def _specs_in_use(
    kv_cache_spec: Mapping[str, KVCacheSpec], sliding_window_as_full_attention: bool
) -> dict[str, KVCacheSpec]:
    """The specs the config is built from (sliding windows as full attention
    if asked), refused unless their layers can share one pool."""
    specs: dict[str, KVCacheSpec] = dict(kv_cache_spec)
    if sliding_window_as_full_attention:
        windowed = [n for n, s in specs.items() if isinstance(s, SlidingWindowSpec)]
        if windowed:
            logger.warning(
                "treating %d sliding-window layer(s) as full attention: they keep every "
                "block, which costs memory the window would have saved",
                len(windowed),
            )
            specs = {name: _as_full_attention(spec) for name, spec in specs.items()}
    _check_one_pool(specs)
    return specs


def _check_one_pool(specs: Mapping[str, KVCacheSpec]) -> None:
    """Every layer draws from one pool, so page and block sizes must agree."""
    if len({s.page_size_bytes for s in specs.values()}) > 1:
        raise ValueError(
            "the layers' KV cache page sizes disagree ("
            + _describe_disagreement(specs, "page_size_bytes", "bytes")
            + "); all layers share one block pool, so their page sizes "
            "(2 * block_size * num_kv_heads * head_size * dtype size, halved for MLA) "
            "must agree: describe every layer with specs of one page size"
        )
    if len({s.block_size for s in specs.values()}) > 1:
        raise ValueError(
            "the layers' block sizes disagree ("
            + _describe_disagreement(specs, "block_size", "tokens")
            + "); all groups of one pool must use one block_size"
        )


def _lay_out(
    specs: Mapping[str, KVCacheSpec],
    available_memory: int,
    max_model_len: int,
    num_gpu_blocks_override: int | None,
    max_num_batched_tokens: int | None,
) -> KVCacheConfig:
    """The layers' groups, the pool's size (checked, overridden if asked,
    logged) and the tensors the groups share."""
    groups, group_size = _group_layers(specs)
    page = groups[0].kv_cache_spec.page_size_bytes
    fitting_blocks = available_memory // page // group_size
    needed_blocks = _check_pool_holds_one_request(
        groups, group_size, fitting_blocks, available_memory, max_model_len, max_num_batched_tokens
    )
    num_blocks = _apply_override(fitting_blocks, num_gpu_blocks_override)
    if num_blocks < needed_blocks:
        logger.warning(
            "num_gpu_blocks_override=%d is fewer than the %d blocks (null block included) "
            "one request of max_model_len=%d tokens needs; such requests can never be admitted",
            num_blocks, needed_blocks, max_model_len,
        )
    _log_capacity(groups, group_size, num_blocks, max_model_len, max_num_batched_tokens)

    tensors = [
        KVCacheTensor(
            size=page * num_blocks,
            shared_by=[g.layer_names[i] for g in groups if i < len(g.layer_names)],
        )
        for i in range(group_size)
    ]
    return KVCacheConfig(num_blocks=num_blocks, tensors=tensors, kv_cache_groups=groups)


# --------------------------------------------------------------------------
# 3. several workers


def _groups_difference(
    reference: Sequence[KVCacheGroupSpec], other: Sequence[KVCacheGroupSpec]
) -> str | None:
    """What first differs between two workers' groups, or None if nothing."""
    if len(reference) != len(other):
        return f"{len(other)} groups instead of {len(reference)}"
    for index, (ref, oth) in enumerate(zip(reference, other, strict=True)):
        if ref.layer_names != oth.layer_names:
            return f"group {index} has layers {oth.layer_names} instead of {ref.layer_names}"
        if ref.kv_cache_spec != oth.kv_cache_spec:
            return f"group {index} has spec {oth.kv_cache_spec} instead of {ref.kv_cache_spec}"
    return None


def _with_num_blocks(config: KVCacheConfig, num_blocks: int) -> KVCacheConfig:
    """The same layout with ``num_blocks`` blocks: each tensor keeps its page size."""
    tensors = [
        KVCacheTensor(size=t.size // config.num_blocks * num_blocks, shared_by=list(t.shared_by))
        for t in config.tensors
    ]
    return dataclasses.replace(config, num_blocks=num_blocks, tensors=tensors)


def _sorted_groups(config: KVCacheConfig) -> KVCacheConfig:
    """The config with its groups in ``type_id`` order (stable), as vLLM sorts
    them before comparing workers: two workers that built the same groups in a
    different order then agree on which group index is which."""
    groups = sorted(config.kv_cache_groups, key=lambda g: g.kv_cache_spec.type_id)
    return dataclasses.replace(config, kv_cache_groups=groups)


def unify_kv_cache_configs(
    configs: list[KVCacheConfig], *, names: Sequence[str] | None = None
) -> list[KVCacheConfig]:
    """Make several workers' configs agree: same groups, the smallest ``num_blocks``.

    Each config's groups are first sorted by their spec's ``type_id`` (stable;
    vLLM 0.8.5 does the same), so workers that listed the same groups in a
    different order agree. Then every config must have the same
    ``kv_cache_groups`` (layer names and specs, in that order) as
    ``configs[0]``; otherwise ValueError naming the first one that differs
    (``names[i]`` when given, e.g. "rank 2", else "config i") and how.
    Returns new configs, in order, with sorted groups; each tensor shrinks to
    ``page_size * min_num_blocks`` bytes.
    """
    if not isinstance(configs, (list, tuple)) or not configs:
        raise ValueError("unify_kv_cache_configs needs a non-empty list of KVCacheConfig")
    for index, config in enumerate(configs):
        if not isinstance(config, KVCacheConfig):
            raise TypeError(f"configs[{index}] is {type(config).__name__}, expected KVCacheConfig")
    if names is None:
        names = [f"config {i}" for i in range(len(configs))]
    elif len(names) != len(configs):
        raise ValueError(f"got {len(names)} names for {len(configs)} configs")

    configs = [_sorted_groups(config) for config in configs]
    for index, config in enumerate(configs[1:], start=1):
        difference = _groups_difference(configs[0].kv_cache_groups, config.kv_cache_groups)
        if difference is not None:
            raise ValueError(
                f"{names[index]} has different KV cache groups from {names[0]}: {difference}. "
                "Every worker must load the same model with the same layer specs "
                "(and list the layers in the same order)."
            )

    num_blocks = min(config.num_blocks for config in configs)
    return [_with_num_blocks(config, num_blocks) for config in configs]


# --------------------------------------------------------------------------
# memory probing


def _check_utilization(gpu_memory_utilization: Any) -> None:
    if isinstance(gpu_memory_utilization, bool) or not isinstance(
        gpu_memory_utilization, (int, float)
    ):
        raise TypeError(
            f"gpu_memory_utilization must be a number, got {gpu_memory_utilization!r}"
        )
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(
            f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}: "
            "it is the fraction of the GPU's memory this process may use (e.g. 0.9)"
        )


def kv_cache_budget(
    total_bytes: int,
    free_bytes: int,
    gpu_memory_utilization: float,
    model_memory_bytes: int = 0,
) -> int:
    """Bytes the KV cache may take: our share of the device
    (``total * utilization``) less what is already in use (``total - free``:
    by this process, e.g. loaded weights, and by any other) less what the
    model still needs that is not allocated yet (``model_memory_bytes``:
    e.g. peak activations, or weights loaded after the cache is sized).
    Never negative: 0 means no room (``check_enough_kv_cache_memory`` says so).
    """
    _require_int("total_bytes", total_bytes)
    _require_int("free_bytes", free_bytes)
    _require_int("model_memory_bytes", model_memory_bytes)
    _check_utilization(gpu_memory_utilization)
    if total_bytes <= 0:
        raise ValueError(f"total_bytes must be positive, got {total_bytes}")
    if not 0 <= free_bytes <= total_bytes:
        raise ValueError(f"free_bytes must be in [0, total_bytes={total_bytes}], got {free_bytes}")
    if model_memory_bytes < 0:
        raise ValueError(f"model_memory_bytes must be >= 0, got {model_memory_bytes}")
    share = int(total_bytes * gpu_memory_utilization)
    used = total_bytes - free_bytes
    return max(0, share - used - model_memory_bytes)


def _cuda_index(device: Any) -> int:
    """The CUDA ordinal (as torch sees it, after CUDA_VISIBLE_DEVICES) of ``device``."""
    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, bool):
        raise TypeError(f"device must be a CUDA device, an index or None, got {device!r}")
    if isinstance(device, int):
        index = device
    else:
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError) as err:
            raise TypeError(
                f"device must be a CUDA device, an index or None, got {device!r}"
            ) from err
        if dev.type != "cuda":
            raise ValueError(f"device must be a CUDA device, got {dev}")
        index = dev.index if dev.index is not None else torch.cuda.current_device()
    count = torch.cuda.device_count()
    if not 0 <= index < count:
        raise ValueError(f"CUDA device {index} does not exist; this process sees {count}")
    return index


def _nvml_memory_info(index: int) -> tuple[int, int] | None:
    """(total, free) bytes from NVML for torch's CUDA device ``index``, or None.

    NVML numbers devices physically, ignoring CUDA_VISIBLE_DEVICES, so the
    handle is found by the UUID torch reports for ``index``.
    """
    try:
        import pynvml
    except ImportError:
        logger.debug("pynvml is not installed; using torch.cuda.mem_get_info")
        return None
    try:
        uuid = str(torch.cuda.get_device_properties(index).uuid)
        pynvml.nvmlInit()
    except Exception as err:  # noqa: BLE001 - any NVML failure means: use the fallback
        logger.debug("NVML unavailable (%s); using torch.cuda.mem_get_info", err)
        return None
    try:
        # torch prints the bare UUID; NVML wants it with its "GPU-" or, for a
        # MIG instance, "MIG-" prefix.
        for prefix in ("GPU-", "MIG-"):
            try:
                handle = pynvml.nvmlDeviceGetHandleByUUID(prefix + uuid)
            except pynvml.NVMLError:
                continue
            info = pynvml.nvmlDeviceGetMemoryInfo(handle)
            return int(info.total), int(info.free)
        logger.debug("NVML has no device with UUID %s; using torch.cuda.mem_get_info", uuid)
        return None
    except Exception as err:  # noqa: BLE001
        logger.debug("NVML query failed (%s); using torch.cuda.mem_get_info", err)
        return None
    finally:
        with contextlib.suppress(Exception):  # shutting down is best effort
            pynvml.nvmlShutdown()


def device_memory_info(device: Any = None) -> tuple[int, int]:
    """(total, free) bytes of a CUDA device: NVML, else ``torch.cuda.mem_get_info``."""
    if not torch.cuda.is_available():
        raise RuntimeError(
            "no CUDA GPU is available, so there is no device memory to measure; "
            "pass available_memory (bytes) to get_kv_cache_config explicitly"
        )
    index = _cuda_index(device)
    info = _nvml_memory_info(index)
    if info is not None:
        return info
    free, total = torch.cuda.mem_get_info(index)
    return int(total), int(free)


def available_kv_cache_memory(
    device: Any = None,
    gpu_memory_utilization: float = 0.9,
    model_memory_bytes: int = 0,
) -> int:
    """Bytes the KV cache may use on ``device`` (default: the current CUDA device).

    ``kv_cache_budget`` of the device's total and free memory; see it for the
    arithmetic. Raises RuntimeError when there is no CUDA device.
    """
    _check_utilization(gpu_memory_utilization)
    _require_int("model_memory_bytes", model_memory_bytes)
    if model_memory_bytes < 0:
        raise ValueError(f"model_memory_bytes must be >= 0, got {model_memory_bytes}")
    total, free = device_memory_info(device)
    budget = kv_cache_budget(total, free, gpu_memory_utilization, model_memory_bytes)
    logger.debug(
        "device memory: total %.2f GiB, free %.2f GiB; KV cache budget %.2f GiB "
        "(utilization %.2f, model %.2f GiB)",
        total / GiB, free / GiB, budget / GiB, gpu_memory_utilization, model_memory_bytes / GiB,
    )
    return budget
