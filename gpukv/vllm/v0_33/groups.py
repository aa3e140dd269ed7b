"""vLLM 0.33's KV-cache groups as gpukv's adapter follows them.

``check_kv_cache_config`` turns vLLM's ``KVCacheConfig`` into
:class:`KVGroups` (or refuses it with an ``UnsupportedConfigError`` saying
what and what to do): the groups vLLM runs on its full-attention and
sliding-window managers (MLA's included), of one block size.
:class:`KVGroups` is the home of vLLM 0.33's per-group block counts that the
adapter checks before calling gpukv (gpukv applies the windows themselves:
``gpukv.core.windows``):

* the admission reservation (``full_sequence_must_fit``) of a window group is
  capped at ``SlidingWindowSpec.max_admission_blocks_per_request``
  (``cdiv(min(window - 1 + max_in_flight_tokens, max_model_len), block_size)
  + 1``; ``single_type_kv_cache_manager.py:215-227``,
  ``kv_cache_interface.py:918-944``);
* the hit lookup order of the hybrid coordinator (equal specs looked up
  together, full attention first; ``kv_cache_coordinator.py:718-775``),
  whose first group's lone hit is the shared-prefix boundary's
  (``kv_cache_coordinator.py:806-941``, ``kv_cache_manager.py:320-325``):
  gpukv's own lookup reports it where that first group is every
  full-attention group (``full_attention_leads``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from gpukv.core.windows import Policy, policies
from gpukv.errors import InvalidInputError
from gpukv.vllm.v0_33 import features


class UnsupportedConfigError(InvalidInputError):
    """A vLLM 0.33 configuration or call the gpukv adapter does not follow
    (``docs/design.md`` lists them and says why): the message says what and
    what to do instead."""


def refuse(what: str, fix: str, argument: str = "vllm_config") -> UnsupportedConfigError:
    return UnsupportedConfigError(f"gpukv's vLLM 0.33 adapter does not support {what}", argument=argument, fix=fix)


@dataclass(frozen=True)
class KVGroups:
    """The KV-cache groups of a config the adapter follows: one block size,
    per group its window in tokens (None: full attention) and its admission
    cap in blocks (None: none), and vLLM's hit lookup order (tuples of group
    ids, one per distinct spec, full attention first)."""

    block_size: int
    windows: tuple[int | None, ...]
    admission_caps: tuple[int | None, ...]
    lookup_order: tuple[tuple[int, ...], ...]

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def has_windows(self) -> bool:
        return any(w is not None for w in self.windows)

    @cached_property
    def policies(self) -> list[Policy]:
        """gpukv's policy per group (``gpukv.core.windows``): the window rules both sides share."""
        return policies(self.windows, self.block_size)

    def blocks_to_admit(self, num_tokens: int, num_hit_blocks: int, *, capped: bool) -> int:
        """New blocks an admission with a hit of ``num_hit_blocks`` takes for
        ``num_tokens`` slots, summed over groups (vLLM's
        ``get_num_blocks_to_allocate`` for a request holding none, hit blocks
        not counted: the caller adds those it takes out of the free queue);
        ``capped``: the admission gate's reservation, window groups capped."""
        per_group = -(-num_tokens // self.block_size)
        total = 0
        for cap in self.admission_caps:
            required = min(per_group, cap) if capped and cap is not None else per_group
            total += max(required - num_hit_blocks, 0)
        return total

    @cached_property
    def full_attention_leads(self) -> bool:
        """Whether vLLM's first lookup group holds every full-attention group
        and another group follows it (a hybrid model whose full-attention
        layers share one spec): then its lone hit is the full-attention hit
        gpukv's lookups report (``ComputedBlocks.full_attention_hit_tokens``)."""
        full = tuple(g for g, w in enumerate(self.windows) if w is None)
        return len(self.lookup_order) > 1 and self.lookup_order[0] == full

    @cached_property
    def needs_hit_index(self) -> bool:
        """Whether the shared-prefix boundary needs an index of what each
        group cached: several lookup groups, the first not every
        full-attention group (vLLM's hashes and the event stream then run)."""
        return len(self.lookup_order) > 1 and not self.full_attention_leads

    def longest_single_group_hit(self, is_cached: Callable[[int, int], bool], max_blocks: int) -> int:
        """The hit, in blocks, of vLLM's first lookup group alone (its
        ``longest_hit_length``): ``is_cached(position, group)`` says whether
        a group holds the request's block at a position cached."""
        ids = self.lookup_order[0]
        available = _Available(lambda i: all(is_cached(i, g) for g in ids), max_blocks)
        return self.policies[ids[0]].hit(available)


class _Available(Sequence[bool]):
    """Positions ``0..n-1``, each read when a policy asks (full attention
    stops at its first miss)."""

    def __init__(self, there: Callable[[int], bool], n: int) -> None:
        self._there, self._n = there, n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: Any) -> Any:  # (a policy reads positions, never slices)
        return self._there(i)


def check_kv_cache_config(kv_cache_config: Any, max_model_len: int | None = None,
                          max_in_flight_tokens: int | None = None) -> KVGroups:
    """The groups of a KV-cache config the adapter follows: groups vLLM runs
    on its full-attention manager (MLA's included) and sliding-window groups
    (windows of 2 tokens or more, no extra retained tokens, no sparse
    retention) of one block size. Anything else is refused.
    ``max_in_flight_tokens`` (None: ``max_model_len``, as vLLM's manager
    defaults it) sizes the window groups' admission caps."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    groups = getattr(kv_cache_config, "kv_cache_groups", None)
    if not groups:
        raise InvalidInputError("the KV-cache config has no groups", argument="kv_cache_config",
                                fix="pass the KVCacheConfig the engine built")
    if getattr(kv_cache_config, "has_mamba_layers", False):
        raise refuse("Mamba layers", "use vLLM's own scheduler for Mamba models")
    if getattr(kv_cache_config, "needs_kv_cache_zeroing", False):
        raise refuse("KV-cache zeroing", "use vLLM's own scheduler for models that need zeroed blocks")
    if any(getattr(group, "host_resident", False) for group in groups):
        raise refuse("host-resident KV-cache groups (a block pool of their own in host memory)",
                     "use vLLM's own scheduler: gpukv's manager keeps one pool for every group")
    specs = [group.kv_cache_spec for group in groups]
    kinds = [_attention_kind(group) for group in groups]
    for group, spec, kind in zip(groups, specs, kinds, strict=True):
        if kind is None:
            role = _role(group)
            raise refuse(f"KV-cache spec {type(spec).__name__}" + ("" if role is None else f" in role {role!r}"),
                         "only groups vLLM runs on its full-attention or sliding-window manager (full attention, "
                         "MLA, sliding windows) run on gpukv; use vLLM's own scheduler")
        if kind is SlidingWindowSpec:
            _check_window(spec, kv_cache_config)
    sizes = sorted({spec.block_size for spec in specs})
    if len(sizes) != 1:
        raise refuse(f"groups of different block sizes {sizes}", "give every group one block size")
    windows = tuple(spec.sliding_window if kind is SlidingWindowSpec else None
                    for spec, kind in zip(specs, kinds, strict=True))
    in_flight = max_model_len if max_in_flight_tokens is None else max_in_flight_tokens
    caps = tuple(None if w is None or max_model_len is None
                 else spec.max_admission_blocks_per_request(max_in_flight_tokens=in_flight,
                                                            max_model_len=max_model_len)
                 for w, spec in zip(windows, specs, strict=True))
    return KVGroups(sizes[0], windows, caps, _lookup_order(specs, FullAttentionSpec))


def _role(group: Any) -> str | None:
    """The name of the group's role where vLLM gives it one other than the default (None: none)."""
    role = getattr(group, "role", None)
    name = getattr(role, "value", role)
    return None if name is None or name == "default" else str(name)


def _attention_kind(group: Any) -> type | None:
    """``FullAttentionSpec`` or ``SlidingWindowSpec``: which of vLLM's two
    managers gpukv follows runs ``group`` (exactly ``FullAttentionManager``
    or ``SlidingWindowManager``, not a subclass, which changes their rules),
    asked of vLLM's spec registry where it has one, so that MLA layers
    (registered on the full-attention manager) run on gpukv; None for any
    other manager (a group role's included) and for a spec that opts out of
    prefix caching."""
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager, SlidingWindowManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    spec = group.kv_cache_spec
    registry = features.KV_CACHE_SPEC_REGISTRY
    if registry is not None:
        manager = registry.get_manager_class(spec, getattr(group, "role", None))  # (vLLM's own call)
    else:
        manager = {FullAttentionSpec: FullAttentionManager, SlidingWindowSpec: SlidingWindowManager}.get(type(spec))
    if not getattr(spec, "prefix_cacheable", True):
        return None
    if manager is FullAttentionManager and isinstance(spec, FullAttentionSpec):
        return FullAttentionSpec
    if manager is SlidingWindowManager and isinstance(spec, SlidingWindowSpec):
        return SlidingWindowSpec
    return None


def _check_window(spec: Any, kv_cache_config: Any) -> None:
    if spec.sliding_window < 2:
        raise refuse(f"a sliding window of {spec.sliding_window} token: vLLM 0.33 caches none of its blocks "
                     "(reachable_block_mask), gpukv hits every position of it", "use a window of 2 tokens or more")
    if spec.extra_retained_tokens:
        raise refuse("extra retained tokens below a sliding window (multi-module MTP)", "use vLLM's own scheduler")
    if getattr(kv_cache_config, "prefix_cache_retention_interval", None) is not None:
        raise refuse("sparse prefix-cache retention (prefix_cache_retention_interval) for sliding windows",
                     "leave prefix_cache_retention_interval unset (dense retention, vLLM's default)")


def _lookup_order(specs: Sequence[Any], full_spec: type) -> tuple[tuple[int, ...], ...]:
    """vLLM's hybrid lookup groups: equal specs together, in config order,
    then full attention first (a stable sort)."""
    order: list[tuple[Any, list[int]]] = []
    for i, spec in enumerate(specs):
        for seen, ids in order:
            if seen == spec:
                ids.append(i)
                break
        else:
            order.append((spec, [i]))
    order.sort(key=lambda entry: not isinstance(entry[0], full_spec))
    return tuple(tuple(ids) for _, ids in order)
