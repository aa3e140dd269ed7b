"""vLLM's prefix-cache lookups on the adapter: ``get_computed_blocks`` (the
hit a waiting request starts from, answered from a batched run of
admissions when one is under way) and 0.34's probe ``get_num_cached_tokens``,
both gpukv's own lookup on the request's tokens, bounded as vLLM bounds them
(``features``), and the shared-prefix boundary of models with several lookup
groups (gpukv's full-attention hit, or the event stream's index of cached
hashes where vLLM's first lookup group is not every full-attention group)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from gpukv.core.requests import ComputedBlocks, PrefixHit
from gpukv.errors import InvalidInputError
from gpukv.vllm.v0_33 import features
from gpukv.vllm.v0_33.screening import check_request
from gpukv.vllm.v0_33.views import token_ids

if TYPE_CHECKING:
    from gpukv.core.protocol import BlockManager

F = TypeVar("F", bound=Callable[..., Any])


def flushing(method: F) -> F:
    """A method that reads or changes gpukv's state: the running requests'
    pending allocations are applied first (``gpukv.vllm.v0_33.pending``)."""

    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self.pending.calls:
            self.pending.flush()
        return method(self, *args, **kwargs)

    return call  # type: ignore[return-value]


class CacheLookups:
    """The lookups of ``gpukv.vllm.v0_33.KVCacheManager`` (a part of it: it
    reads the adapter's manager, groups, records and batched run)."""

    admissions: Any
    batching: bool
    block_size: int
    empty_kv_cache_blocks: Any
    groups: Any
    manager: BlockManager
    max_model_len: int
    num_kv_cache_groups: int
    pending: Any
    event_translator: Any
    _looked_up: dict[str, tuple[Any, ComputedBlocks | PrefixHit]]
    blocks_class: Any
    ids_on_device: bool
    # (the adapter's own methods these call: annotations only, so none is shadowed)
    flush: Callable[[], None]
    prefix_cache_lookup_enabled: Callable[[Any], bool]
    id_blocks: Callable[..., Any]
    gpukv_request: Callable[..., Any]


    def get_computed_blocks(self, request: Any, max_cache_hit_length: int | None = None) -> tuple[Any, int, int]:
        """The request's cache hit: ``(KVCacheBlocks, hit tokens, shared-prefix
        boundary)``. The hit covers at most ``max_cache_hit_length`` tokens
        (None: all but the last token), whole blocks of its known tokens; a
        window group's blocks before its window are the null block. The
        boundary: the hit of vLLM's first lookup group alone (full attention
        in a hybrid) when longer than the hit, else 0."""
        entry = self.admissions.lookup(request) if self.batching and max_cache_hit_length is None else None
        if entry is not None:
            return entry.hit_blocks, entry.computed.num_tokens, entry.boundary
        self.flush()  # (the per-request path)
        if not self.prefix_cache_lookup_enabled(request):
            return self.empty_kv_cache_blocks, 0, 0
        check_request(request, self.max_model_len)
        bound = max_cache_hit_length
        if bound is not None and (isinstance(bound, bool) or not isinstance(bound, int) or bound < 0):
            raise InvalidInputError(f"max_cache_hit_length must be None or an int >= 0, got {bound!r}",
                                    argument="max_cache_hit_length", fix="pass None for num_tokens - 1")
        limit = features.max_cache_hit_length(request, bound)
        max_hit_blocks = min(limit, request.num_tokens - 1) // self.block_size
        computed = self._lookup(request, max_hit_blocks)
        boundary = self._shared_prefix_boundary(request, max_hit_blocks, computed.num_tokens,
                                                computed.full_attention_hit_tokens)
        if not computed.num_tokens:
            self._looked_up.pop(request.request_id, None)
            return self.empty_kv_cache_blocks, 0, boundary
        if isinstance(computed, PrefixHit):  # (an instance of its own, no ids: vLLM hands it back to allocate_slots)
            blocks = self.blocks_class(tuple([] for _ in range(self.num_kv_cache_groups)))
        else:
            blocks = self.id_blocks(tuple(computed.block_ids), request, computed.num_tokens // self.block_size)
        self._looked_up[request.request_id] = (blocks, computed)
        return blocks, computed.num_tokens, boundary

    @flushing
    def get_num_cached_tokens(self, request: Any) -> int:
        """The request's tokens already in the prefix cache, as a probe (vLLM
        0.34's cache-aware admission): no reference taken, nothing allocated,
        no event, no lookup remembered for ``allocate_slots``. Like vLLM's, the
        last token never counts and the request's own hit limit does not
        bound it (only a limit of 0, no lookup, gives 0)."""
        if not self.prefix_cache_lookup_enabled(request):
            return 0
        check_request(request, self.max_model_len)
        return self._lookup(request, (request.num_tokens - 1) // self.block_size).num_tokens

    def _lookup(self, request: Any, max_hit_blocks: int) -> ComputedBlocks | PrefixHit:
        """gpukv's lookup on the tokens a hit of ``max_hit_blocks`` blocks can
        cover (gpukv never hits a request's last token); with
        ``ids_on_device`` its size only (the ids stay on the device)."""
        if max_hit_blocks <= 0:
            return ComputedBlocks([[] for _ in range(self.num_kv_cache_groups)], 0)
        capped = self.gpukv_request(request, token_ids(request, max_hit_blocks * self.block_size + 1))
        if self.ids_on_device:
            return self.manager.read_prefix_hit(capped)
        return self.manager.get_computed_blocks(capped)

    def run_boundary(self, request: Any, num_hit_tokens: int, full_attention_hit_tokens: int | None) -> int:
        """The shared-prefix boundary vLLM's lookup gives a batched run's
        request (no hit bound of its own: ``plain_run``) whose hit is
        ``num_hit_tokens`` and full-attention hit ``full_attention_hit_tokens``
        (the step's); with an event index, from the cache as the index stands
        now (``PendingGrowth.flush`` asks just before the request's own events)."""
        if self.groups.full_attention_leads:  # (the step's value: its lookup skipped and was bounded as vLLM's)
            return self._shared_prefix_boundary(request, 0, num_hit_tokens, full_attention_hit_tokens)
        if not self.prefix_cache_lookup_enabled(request):
            return 0
        limit = features.max_cache_hit_length(request, None)
        return self._shared_prefix_boundary(request, min(limit, request.num_tokens - 1) // self.block_size,
                                            num_hit_tokens, full_attention_hit_tokens)

    def _shared_prefix_boundary(self, request: Any, max_hit_blocks: int, num_hit_tokens: int,
                                full_attention_hit_tokens: int | None) -> int:
        """vLLM's ``shared_prefix_boundary``: the lone hit of its first lookup
        group, in tokens, when longer than the hit (0 otherwise, and always
        with one lookup group, where the two are one). That group is every
        full-attention group in a hybrid model whose full-attention layers
        share one spec: its lone hit is gpukv's full-attention hit (and
        ``max_hit_blocks`` unread). Else it is read from the event index,
        at most ``max_hit_blocks`` blocks."""
        if self.groups.full_attention_leads:  # (a hybrid model: its lookups report the value)
            longest = full_attention_hit_tokens or 0
        elif self.event_translator.index:
            hashes = request.block_hashes
            longest = self.groups.longest_single_group_hit(
                lambda i, g: self.event_translator.is_cached(hashes[i], g),
                min(max_hit_blocks, len(hashes))) * self.block_size
        else:
            return 0
        return longest if longest > num_hit_tokens else 0
