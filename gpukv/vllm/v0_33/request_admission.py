"""The adapter's admission of one waiting request (vLLM's ``allocate_slots``
for a request gpukv does not hold): the hit vLLM hands back checked to be
its last lookup's, vLLM's fit rules that are stricter than gpukv's
(``gpukv.vllm.v0_33.admission_fit``), gpukv's admission, and the adapter's
record of what the request holds."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gpukv.core.protocol import BlockManager
from gpukv.core.requests import ComputedBlocks, NewRequest, PrefixHit
from gpukv.errors import InvalidInputError
from gpukv.vllm.v0_33.admission_fit import HitTouches
from gpukv.vllm.v0_33.groups import UnsupportedConfigError
from gpukv.vllm.v0_33.views import has_blocks, token_ids
from gpukv.vllm.v0_33.window_releases import WindowReleases


class RequestAdmission:
    """The one-request admission of ``gpukv.vllm.v0_33.KVCacheManager`` (a
    part of it: it reads the adapter's manager, groups, lookups and records)."""

    block_size: int
    groups: Any
    ids_on_device: bool
    manager: BlockManager
    max_model_len: int
    num_kv_cache_groups: int
    watermark_blocks: int
    _admitted: tuple[str, list[list[int]]] | None
    _held: dict[str, list[int]]
    windows: WindowReleases | None
    _looked_up: dict[str, tuple[Any, ComputedBlocks | PrefixHit]]
    _requests: dict[str, Any]
    # (the adapter's own methods these call: annotations only, so none is shadowed)
    gpukv_request: Callable[..., NewRequest]
    new_kv_cache_blocks: Callable[..., Any]
    _drain: Callable[[Any], None]

    def _admit(self, request: Any, num_new_tokens: int, num_new_computed_tokens: int, blocks: Any,
               num_lookahead_tokens: int, full_sequence_must_fit: bool, reserved_blocks: int,
               has_scheduled_reqs: bool) -> Any:
        """Admit a request gpukv does not hold, with its last lookup's hit."""
        if request.num_computed_tokens:
            raise UnsupportedConfigError(f"request {request.request_id!r} comes with {request.num_computed_tokens} "
                                         "computed tokens but holds no blocks (a KV-connector path)",
                                         argument="request", fix="run without a KV connector")
        computed = _handed_back_hit(self._looked_up.get(request.request_id), request, num_new_computed_tokens,
                                    blocks)
        hit = computed.num_tokens if computed is not None else 0
        need_slot = min(hit + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        target = min(hit + num_new_tokens, request.num_tokens)
        if not self._admission_fits(request, computed, need_slot, full_sequence_must_fit, reserved_blocks,
                                    has_scheduled_reqs):
            return None
        new_request = self.gpukv_request(request, token_ids(request))
        new: list[list[int]] | None
        if self.ids_on_device:
            assert not isinstance(computed, ComputedBlocks)  # (its lookups gave a PrefixHit: the hit known by its size)
            admitted = self.manager.admit(new_request, computed, num_tokens=target - hit,
                                          num_lookahead_tokens=need_slot - target)
            new = [[] for _ in range(self.num_kv_cache_groups)] if admitted else None
        else:
            assert not isinstance(computed, PrefixHit)  # (its lookups gave the hit's ids)
            new = self.manager.allocate_slots(new_request, computed=computed, num_tokens=target - hit,
                                              num_lookahead_tokens=need_slot - target)
        self._looked_up.pop(request.request_id, None)
        if new is None:
            return None
        hit_ids = _hit_ids(computed, self.num_kv_cache_groups)
        all_ids = None if self.ids_on_device else [list(h) + g for h, g in zip(hit_ids, new, strict=True)]
        self._record_admission(request, all_ids)
        self._drain(request)
        return self.new_kv_cache_blocks(new)

    def _admission_fits(self, request: Any, computed: ComputedBlocks | PrefixHit | None, need_slot: int,
                        full_sequence_must_fit: bool, reserved_blocks: int, has_scheduled_reqs: bool) -> bool:
        """vLLM's admission checks that are stricter than gpukv's fit: the
        whole prompt (``full_sequence_must_fit``, before any window
        release), the watermark, ``reserved_blocks``; a hit's blocks no
        request holds count as blocks to take."""
        from vllm.v1.request import RequestStatus

        hit = computed.num_tokens if computed is not None else 0
        watermark = self.watermark_blocks if has_scheduled_reqs and request.status in (
            RequestStatus.WAITING, RequestStatus.PREEMPTED) else 0
        if not (full_sequence_must_fit or watermark or reserved_blocks):
            return True
        touched = HitTouches(self.manager, computed)
        hit_blocks = hit // self.block_size
        if full_sequence_must_fit:  # (a request admitted holds none)
            full = self.groups.blocks_to_admit(min(request.num_tokens, self.max_model_len), hit_blocks, capped=True)
            if not touched.fit(full, watermark, 0):
                return False
        return not (watermark or reserved_blocks) or touched.fit(
            self.groups.blocks_to_admit(need_slot, hit_blocks, capped=False), watermark, reserved_blocks)

    def _record_admission(self, request: Any, block_ids: list[list[int]] | None) -> None:
        """The ledger of a request gpukv admitted (``block_ids``: all of its
        blocks, None where they stay on the device)."""
        rid = request.request_id
        self._requests[rid] = request
        self._admitted = None if block_ids is None else (rid, block_ids)  # (vLLM's get_blocks comes next)
        self._held[rid] = list(self.manager.request_counts(rid))
        self._note_windows(rid)

    def note_held(self, rid: str) -> None:
        """The adapter's record of what request ``rid`` holds (its row, block
        positions per group, computed and known tokens), read back from the
        manager (host only; the record's list kept: the batched path holds it)."""
        self._held[rid][:] = self.manager.request_counts(rid)
        self._note_windows(rid)

    def _note_windows(self, rid: str) -> None:
        """In a window model, the null blocks request ``rid`` leads with, so
        what its next running call releases (``windows``)."""
        if self.windows is not None:
            self.windows.note(rid, self.manager.num_null_blocks(rid))


def _handed_back_hit(looked_up: tuple[Any, ComputedBlocks | PrefixHit] | None, request: Any,
                     num_new_computed_tokens: int, blocks: Any) -> ComputedBlocks | PrefixHit | None:
    """gpukv's hit for the computed blocks vLLM hands back to ``allocate_slots``:
    those of the request's last lookup (``looked_up``: what vLLM got, gpukv's
    hit; with ``ids_on_device`` an instance with no ids), or none."""
    handed_back = looked_up is not None and blocks is looked_up[0]
    if not handed_back and not has_blocks(blocks):
        if num_new_computed_tokens:
            raise InvalidInputError(f"num_new_computed_tokens={num_new_computed_tokens} without computed blocks",
                                    argument="new_computed_blocks", fix="pass what get_computed_blocks returned")
        return None
    if looked_up is None or (not handed_back and blocks.get_block_ids() != looked_up[0].get_block_ids()):
        raise InvalidInputError(f"new_computed_blocks are not the hit of request {request.request_id!r}'s last "
                                "lookup", argument="new_computed_blocks",
                                fix="call get_computed_blocks(request) and pass its blocks unchanged")
    computed = looked_up[1]
    if num_new_computed_tokens != computed.num_tokens:
        raise InvalidInputError(f"num_new_computed_tokens={num_new_computed_tokens} is not the hit's "
                                f"{computed.num_tokens} tokens", argument="num_new_computed_tokens",
                                fix="pass the token count get_computed_blocks returned")
    return computed


def _hit_ids(computed: ComputedBlocks | PrefixHit | None, num_groups: int) -> list[list[int]]:
    """The hit's block ids per group (none for no hit)."""
    if isinstance(computed, ComputedBlocks):
        return computed.block_ids
    return [[] for _ in range(num_groups)]
