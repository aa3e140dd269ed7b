"""vLLM 0.8.5's ``KVCacheManager`` interface on a gpukv manager.

vLLM's v1 scheduler drives its block manager one request at a time, with
vLLM ``Request`` objects whose ``num_computed_tokens`` the scheduler itself
advances. gpukv's managers count computed tokens themselves and take the
sampled tokens as they are appended. This module translates one into the
other, call by call, so that the scheduler's decisions (hits, block ids,
refusals, and so preemptions) are vLLM's own:

* ``get_computed_blocks(request)`` looks the request up in gpukv (gpukv hashes
  the tokens itself: nothing the caller hands in decides a hit) and returns
  the hit as objects with ``.block_id``, and its length in tokens.
* ``allocate_slots(request, num_tokens, new_computed_blocks,
  num_lookahead_tokens)`` admits a request gpukv does not hold, with the hit
  of its last lookup, or grows a running one. The tokens vLLM computes this
  step beyond what gpukv has computed become gpukv's ``num_tokens``; the
  speculative tokens vLLM schedules are not cached by vLLM, so they become
  gpukv lookahead slots (never cached) with vLLM's own lookahead.
* ``free`` and the rest map one to one (``docs/api.md`` has the table).

For ``gpukv.vllm.Scheduler``'s batched ``schedule()``, the same translations
for a whole step at once: ``schedule_batch`` is one gpukv ``step``: the
requests freed since the last step, every running request's
``allocate_slots`` (as array, a ``gpukv.RunningBatch`` addressed by row:
``gpukv.vllm.v0_8.batch_rows``), a run of waiting requests'
``get_computed_blocks`` and ``allocate_slots`` (vLLM's waiting loop on the
manager), and what the scheduler's output needs (every new block id, the
first running request's reference counts for the common prefix), in one
device read. Every argument is checked first (``gpukv.vllm.v0_8.checks``).

Frees are folded into the next step: ``free`` records the request and the
next call to gpukv frees every recorded one first, in order, in one call (a
read of the manager's state, ``usage`` say, does so at once). Nothing can
tell the difference: no allocation, lookup or count happens in between.

The lookup rule (``lookup=``): vLLM 0.8.5 keeps a preempted request's block
hashes and, on resumption, looks up only those: blocks whose tokens were
appended but never computed are not hashed, so they never hit. gpukv hashes
every full block it is handed, which can hit one block more after a
multi-token append. ``lookup="vllm"`` (the default here) caps the hit at the
blocks vLLM would have hashed; ``lookup="all"`` keeps gpukv's longer (valid)
hit, gpukv's own managers' rule.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gpukv.core.hashing import MMItem
from gpukv.core.requests import ComputedBlocks, NewRequest, RunningUpdate, StepResult
from gpukv.errors import InvalidInputError, InvalidTypeError
from gpukv.vllm.v0_8.batch_rows import running_batch
from gpukv.vllm.v0_8.checks import check_num_tokens, check_scheduled, checked_length, request_id_of

BACKENDS = ("auto", "reference", "device")
LOOKUPS = ("vllm", "all")


@dataclass(frozen=True, slots=True)
class Block:
    """A block as vLLM's scheduler reads it: only its id."""

    block_id: int


@dataclass
class BatchOutcome:
    """What ``schedule_batch`` decided: how many of the running requests got
    their blocks (a prefix), each one's new block ids; per admitted waiting
    request (a prefix) its hit in tokens, its ``num_new_tokens`` and its block
    ids; and the step's result, for the common prefix
    (``result.num_common_prefix_blocks``)."""

    num_running: int
    running_block_ids: list[list[int]]
    admitted: list[tuple[int, int]]
    admitted_block_ids: list[list[int]]
    result: StepResult


def make_backend(backend: str, *, num_blocks: int, block_size: int, sliding_window: int | None,
                 max_model_len: int, enable_caching: bool, max_num_reqs: int,
                 max_num_batched_tokens: int | None = None) -> Any:
    """The gpukv manager under the adapter: the device manager on CUDA (or when
    asked for), else the reference. vLLM's free order (``uncached_first=False``)."""
    backend = resolve_backend(backend)
    kwargs = dict(sliding_windows=[sliding_window], enable_caching=enable_caching, uncached_first=False,
                  max_model_len=max_model_len, max_num_reqs=max_num_reqs,
                  max_num_batched_tokens=max_num_batched_tokens)
    if backend == "device":
        from gpukv.device.manager import DeviceManager

        return DeviceManager(num_blocks, block_size, **kwargs)  # type: ignore[arg-type]
    from gpukv.reference.manager import ReferenceManager

    return ReferenceManager(num_blocks, block_size, **kwargs)  # type: ignore[arg-type]


def resolve_backend(backend: str) -> str:
    """"reference" or "device": what ``backend`` ("auto" included) runs on here."""
    if backend not in BACKENDS:
        raise InvalidInputError(f"unknown backend {backend!r}", argument="backend",
                                fix=f"pass one of {', '.join(BACKENDS)}")
    if backend == "auto":
        return "device" if torch.cuda.is_available() else "reference"
    return backend


def _group_spec(kv_cache_config: Any) -> Any:
    groups = getattr(kv_cache_config, "kv_cache_groups", None)
    if not groups or len(groups) != 1:
        raise InvalidInputError("vLLM 0.8.5's KVCacheManager takes exactly one KV-cache group",
                                argument="kv_cache_config",
                                fix="pass a KVCacheConfig with one group (gpukv's own managers take several)")
    return groups[0].kv_cache_spec


class KVCacheManager:
    """vLLM 0.8.5's ``vllm.v1.core.kv_cache_manager.KVCacheManager``, on gpukv.

    Constructor arguments are vLLM's; ``backend`` ("auto", "reference",
    "device") picks the gpukv manager underneath (``.manager``), ``lookup``
    ("vllm", "all") the resumed-request lookup rule (module docstring),
    ``max_num_reqs`` the request rows it starts with (they grow) and
    ``max_num_batched_tokens`` the scheduler's (the device manager sizes its
    admission buffers by it; None: by the prompts alone).
    """

    def __init__(self, kv_cache_config: Any, max_model_len: int, enable_caching: bool = True,
                 caching_hash_algo: str = "builtin", use_eagle: bool = False, log_stats: bool = False, *,
                 backend: str = "auto", lookup: str = "vllm", max_num_reqs: int = 64,
                 max_num_batched_tokens: int | None = None) -> None:
        from vllm.v1.metrics.stats import PrefixCacheStats

        if lookup not in LOOKUPS:
            raise InvalidInputError(f"unknown lookup rule {lookup!r}", argument="lookup",
                                    fix="pass 'vllm' (vLLM's resumed lookup) or 'all' (every full block)")
        spec = _group_spec(kv_cache_config)
        self.block_size: int = spec.block_size
        self.num_gpu_blocks: int = kv_cache_config.num_blocks
        self.max_model_len = max_model_len
        self.enable_caching = bool(enable_caching)
        self.caching_hash_algo = caching_hash_algo  # gpukv always hashes with keyed BLAKE3
        self.use_eagle = bool(use_eagle)
        self.log_stats = bool(log_stats)
        self.lookup = lookup
        self._stats_cls = PrefixCacheStats
        self.prefix_cache_stats = PrefixCacheStats() if log_stats else None
        self.sliding_window: int | None = getattr(spec, "sliding_window", None)
        self.backend = resolve_backend(backend)
        self.manager = make_backend(self.backend, num_blocks=self.num_gpu_blocks, block_size=self.block_size,
                                    sliding_window=self.sliding_window,
                                    max_model_len=max_model_len, enable_caching=self.enable_caching,
                                    max_num_reqs=max_num_reqs, max_num_batched_tokens=max_num_batched_tokens)
        # The requests gpukv holds for vLLM, by id: their rows (``gpukv.device.rows``).
        self._rows: dict[str, int] = {}
        # Requests freed here and not yet in gpukv, in order (the next call frees them first).
        self._pending_free: list[str] = []
        # vLLM's len(req_to_block_hashes[id]): the blocks vLLM has hashed for a
        # request (its lookup rule), kept across preemption until free_block_hashes.
        self._num_hashed: dict[str, int] = {}
        # The hit of each request's last lookup, handed back by allocate_slots.
        self._looked_up: dict[str, ComputedBlocks] = {}
        # Requests freed once finished: a second free is a caller's mistake.
        self._finished: weakref.WeakSet[Any] = weakref.WeakSet()

    # ------------------------------------------------------------- vLLM's API
    @property
    def usage(self) -> float:
        """vLLM's ``1 - free / num_gpu_blocks`` (its null block counts as used;
        reads the device)."""
        self._flush()
        return 1.0 - self.manager.read_num_free_blocks() / self.num_gpu_blocks

    def make_prefix_cache_stats(self) -> Any:
        """vLLM's ``PrefixCacheStats`` since the last call (in blocks, as vLLM
        0.8.5 counts), or None without ``log_stats``."""
        if not self.log_stats:
            return None
        stats, self.prefix_cache_stats = self.prefix_cache_stats, self._stats_cls()
        return stats

    def get_computed_blocks(self, request: Any) -> tuple[list[Block], int]:
        """The request's cache hit: blocks (``.block_id``) and its length in tokens."""
        rid = request_id_of(request)
        num_tokens = checked_length(request, self.max_model_len)
        if not self.enable_caching:
            return [], 0
        self._mm_items(request)  # refused before anything is counted, as vLLM hashes first
        if request.sampling_params.prompt_logprobs is not None:
            self._count_lookup(request, 0)
            self._looked_up.pop(rid, None)
            return [], 0
        self._flush()
        max_hit = self._num_queries(request) if self.lookup == "vllm" else (num_tokens - 1) // self.block_size
        computed = self._lookup(request, max_hit)
        if self.use_eagle and computed.num_tokens:  # vLLM recomputes the last hit block for EAGLE
            computed = self._lookup(request, computed.num_tokens // self.block_size - 1)
        self._count_lookup(request, computed.num_tokens)
        self._looked_up[rid] = computed
        return [Block(b) for b in computed.block_ids[0]], computed.num_tokens

    def allocate_slots(self, request: Any, num_tokens: int, new_computed_blocks: list[Any] | None = None,
                       num_lookahead_tokens: int = 0) -> list[Block] | None:
        """Blocks for ``num_tokens`` more tokens (beyond the hit for a request
        not yet admitted) and ``num_lookahead_tokens`` slots; the new blocks,
        or None (nothing changed) when they do not fit."""
        rid = request_id_of(request)
        checked_length(request, self.max_model_len)
        check_num_tokens(num_tokens, num_lookahead_tokens)
        if request.is_finished():
            raise InvalidInputError(f"request {rid!r} is finished", argument="request",
                                    fix="allocate only for waiting or running requests")
        self._flush()
        if rid in self._rows:
            if new_computed_blocks:
                raise InvalidInputError(f"request {rid!r} is running; computed blocks are for admission only",
                                        argument="new_computed_blocks", fix="pass None for a running request")
            return self._grow(request, num_tokens, num_lookahead_tokens)
        return self._admit(request, num_tokens, new_computed_blocks, num_lookahead_tokens)

    def free(self, request: Any) -> None:
        """Give back the request's blocks (tail first), as vLLM's ``free``: a
        request holding none (waiting, preempted, aborted before it ran) frees
        nothing; a finished request freed a second time is refused. gpukv
        frees them at the next call (module docstring)."""
        rid = request_id_of(request)
        finished = request.is_finished()
        if finished and request in self._finished:
            raise InvalidInputError(f"request {rid!r} was already freed", argument="request",
                                    fix="free a finished request once")
        self._looked_up.pop(rid, None)
        if self._rows.pop(rid, None) is not None:
            if not finished:  # preempted: vLLM keeps the hashes of the blocks it computed
                full = self.manager.num_computed_tokens(rid) // self.block_size
                self._num_hashed[rid] = max(self._num_hashed.get(rid, 0), full)
            self._pending_free.append(rid)
        if finished:
            self._finished.add(request)

    def free_block_hashes(self, request: Any) -> None:
        """Forget the request's lookup state (vLLM: once it finished)."""
        rid = request_id_of(request)
        self._num_hashed.pop(rid, None)
        self._looked_up.pop(rid, None)

    def get_num_common_prefix_blocks(self, request: Any, num_running_requests: int) -> int:
        """Leading blocks of ``request`` held by all ``num_running_requests``
        running requests (reads the device)."""
        rid = request_id_of(request)
        if rid not in self._rows:
            raise InvalidInputError(f"request {rid!r} holds no blocks", argument="request",
                                    fix="pass a running request")
        self._flush()
        return self.manager.get_num_common_prefix_blocks(rid, num_running_requests)[0]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block, when no request holds one (else False)."""
        self._flush()
        ok = self.manager.reset_prefix_cache()
        if ok and self.prefix_cache_stats is not None:
            self.prefix_cache_stats.reset = True
        return ok

    # ------------------------------------------------- batched (the Scheduler's)
    def schedule_batch(self, running: Sequence[Any], num_new_tokens: Sequence[int] | np.ndarray,
                       waiting: Sequence[Any], *, num_tokens_to_compute: int | None, num_lookahead_tokens: int,
                       token_budget: int, prefix_of: Any | None) -> BatchOutcome:
        """One scheduling step's block-manager work as one gpukv ``step``:

        * the requests freed since the last call, first, in order;
        * ``allocate_slots(request, n, num_lookahead_tokens=...)`` for each
          running request and its ``num_new_tokens``, in order: the first
          that does not fit and every later one get nothing, as if their
          calls had not been made (vLLM's loop then preempts and retries them
          one by one), and then no waiting request is looked at;
        * vLLM's waiting loop over ``waiting`` (each ``waiting_batchable``):
          looked up in order and admitted while their blocks fit, each
          computing its hit plus ``min(tokens - hit, num_tokens_to_compute,
          budget left)`` tokens, until ``token_budget`` is spent or one does
          not fit; lookups count in the stats as vLLM's
          ``get_computed_blocks`` counts them (the refused request's too);
        * the new block ids of all of them, and ``prefix_of``'s (a running
          request, the first waiting one when none runs, or None) reference
          counts for the common prefix, in the step's one device read.

        Every argument is checked, in a few vectorised passes, before
        anything changes."""
        batch = (running_batch(self.manager, self._rows, running, num_new_tokens, num_lookahead_tokens,
                               self.max_model_len) if len(running) else ())
        new = [self._admission_request(r, num_tokens_to_compute, num_lookahead_tokens) for r in waiting]
        prefix = None if prefix_of is None else request_id_of(prefix_of)
        if prefix is not None and prefix not in self._rows and not any(r.request_id == prefix for r in new):
            raise InvalidInputError(f"request {prefix!r} holds no blocks", argument="prefix_of",
                                    fix="pass the first running request (or, with none, the first waiting one)")
        if new and self._pending_free and not self._pending_free_set().isdisjoint(r.request_id for r in new):
            self._flush()  # (a request freed and resumed before a step: freed first, in a call of its own)
        finished, self._pending_free = self._pending_free, []
        result = self.manager.step(finished=finished, running=batch, new=new,
                                   token_budget=token_budget if new else None, block_ids=True, prefix_of=prefix)
        return self._outcome(running, waiting, result)

    def _outcome(self, running: Sequence[Any], waiting: Sequence[Any], result: StepResult) -> BatchOutcome:
        """The adapter's ledger after ``schedule_batch``'s step, and what it
        hands the scheduler."""
        fit = len(running) if result.running_failed_at is None else result.running_failed_at
        hits = list(result.num_computed_tokens)
        if result.refused_hit_tokens is not None:
            hits.append(result.refused_hit_tokens)
        if self.enable_caching:
            for request, hit in zip(waiting, hits, strict=False):
                self._count_lookup(request, hit)
        rows, looked_up = self._rows, self._looked_up
        for request, row in zip(waiting, result.rows, strict=False):
            rid = request.request_id
            looked_up.pop(rid, None)
            rows[rid] = row
        assert result.running_block_ids is not None and result.admitted_block_ids is not None
        return BatchOutcome(fit, result.running_block_ids[0],
                            list(zip(result.num_computed_tokens, result.num_new_tokens, strict=True)),
                            result.admitted_block_ids[0], result)

    def waiting_batchable(self, request: Any, num_lookahead_tokens: int = 0) -> bool:
        """Whether ``schedule_batch`` gives this waiting request what vLLM's
        ``get_computed_blocks`` then ``allocate_slots`` would give it: not
        when it carries speculative tokens (kept over a preemption), when its
        lookahead slots would pass ``max_model_len`` (capped then), under
        EAGLE (its hit drops a block), nor when a resumed request's lookup
        may be capped below gpukv's (``lookup="vllm"``: vLLM looks up only the
        blocks it hashed before the preemption)."""
        if self.use_eagle or request.spec_token_ids:
            return False
        if request.num_tokens + num_lookahead_tokens > self.max_model_len:
            return False
        if self.enable_caching and self.lookup == "vllm" and request.sampling_params.prompt_logprobs is None:
            return self._num_queries(request) >= (request.num_tokens - 1) // self.block_size
        return True

    def _admission_request(self, request: Any, chunk: int | None, lookahead: int) -> NewRequest:
        """gpukv's ``NewRequest`` for vLLM's waiting loop body over
        ``request``: its whole prompt looked up, at most ``chunk`` tokens
        computed beyond the hit (vLLM's long-prefill threshold)."""
        num_tokens = checked_length(request, self.max_model_len)
        chunk = chunk if chunk is not None and chunk < num_tokens else None  # (the same: gpukv refuses more)
        return self._new_request(request, request.all_token_ids[:], chunk, lookahead)

    # ------------------------------------------------------------ inspection
    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's blocks, position by position (reads the device)."""
        self._flush()
        return self.manager.get_block_ids(request_id)[0]

    def num_free_blocks(self) -> int:
        """Free blocks, evictable cached ones included, as vLLM's
        ``block_pool.get_num_free_blocks()`` (reads the device)."""
        self._flush()
        return self.manager.read_num_free_blocks()

    def request_ids(self) -> list[str]:
        """Ids of the requests holding blocks."""
        return list(self._rows)

    def check_invariants(self) -> None:
        """The manager's invariants, and the adapter's ledger agreeing with it."""
        self._flush()
        self.manager.check_invariants()
        held = set(self.manager.request_ids())
        if held != set(self._rows):
            raise AssertionError(f"the adapter's requests {sorted(self._rows)} are not the manager's {sorted(held)}")
        rows = {rid: self.manager.row_of(rid) for rid in held}
        if rows != self._rows:
            raise AssertionError(f"the adapter's rows {self._rows} are not the manager's {rows}")

    # -------------------------------------------------------------- internals
    def _pending_free_set(self) -> set[str]:
        return set(self._pending_free)

    def _flush(self) -> None:
        """Free in gpukv what was freed here since the last call (one call)."""
        if self._pending_free:
            finished, self._pending_free = self._pending_free, []
            self.manager.step(finished=finished)

    def _new_request(self, request: Any, tokens: Any, chunk: int | None = None, lookahead: int = 0) -> NewRequest:
        """gpukv's view of a vLLM request: its tokens, LoRA and multimodal
        items (its extra keys, in every digest it caches under), and no lookup
        when it asks for prompt logprobs (vLLM computes every prompt token then)."""
        return NewRequest(request.request_id, tokens, lora_id=_lora_id(request),
                          mm_items=self._mm_items(request) if self.enable_caching else (),
                          skip_prefix_cache=request.sampling_params.prompt_logprobs is not None,
                          num_tokens_to_compute=chunk, num_lookahead_tokens=lookahead)

    def _mm_items(self, request: Any) -> tuple[MMItem, ...]:
        positions, hashes = request.mm_positions or [], request.mm_hashes or []
        if len(positions) != len(hashes):
            # vLLM 0.8.5 refuses these too (a ValueError while hashing): without
            # content hashes two images could not be told apart.
            raise InvalidInputError(f"request {request.request_id!r} has {len(positions)} multimodal items but "
                                    f"{len(hashes)} hashes", argument="request",
                                    fix="give every multimodal item its content hash (mm_hashes), or turn off "
                                        "prefix caching")
        return tuple(MMItem(p.offset, p.length, h) for p, h in zip(positions, hashes, strict=True))

    def _lookup(self, request: Any, max_hit: int) -> ComputedBlocks:
        """gpukv's lookup of the request, its hit at most ``max_hit`` blocks
        (looked up on the tokens it can cover, so a window's null blocks fall
        where a lookup of that length puts them)."""
        if max_hit <= 0:
            return ComputedBlocks([[]], 0)
        end = min(request.num_tokens, max_hit * self.block_size + 1)
        return self.manager.get_computed_blocks(self._new_request(request, request.all_token_ids[:end]))

    def _num_queries(self, request: Any) -> int:
        """vLLM's lookup length in blocks: the blocks it has hashed for the
        request (all its full blocks, or for a resumed request those it kept),
        less the last when they cover every token."""
        num_tokens = request.num_tokens
        num_hashed = self._num_hashed.get(request.request_id) or num_tokens // self.block_size
        return num_hashed - (num_hashed * self.block_size == num_tokens)

    def _count_lookup(self, request: Any, hit_tokens: int) -> None:
        """A lookup as vLLM's ``get_computed_blocks`` counts it: the request's
        hashed blocks remembered, a request in the stats, and unless it asks
        for prompt logprobs (no lookup then) its queries and hits, in blocks."""
        rid = request.request_id
        self._num_hashed[rid] = self._num_hashed.get(rid) or request.num_tokens // self.block_size
        stats = self.prefix_cache_stats
        if stats is None:
            return
        stats.requests += 1
        if request.sampling_params.prompt_logprobs is None:
            stats.queries += self._num_queries(request)
            stats.hits += hit_tokens // self.block_size

    def _admit(self, request: Any, num_tokens: int, blocks: list[Any] | None,
               num_lookahead_tokens: int) -> list[Block] | None:
        rid = request.request_id
        num_known = request.num_tokens
        computed = self._computed_for(rid, blocks)
        hit = computed.num_tokens if computed is not None else 0
        check_scheduled(request, num_known, hit, num_tokens)
        # vLLM caches full blocks up to hit + num_tokens less its speculative
        # tokens; gpukv computes (and caches) exactly those, the rest are slots.
        target = max(hit + num_tokens - len(request.spec_token_ids), hit + 1)
        target = min(target, num_known)
        slots = self._slots(hit + num_tokens + num_lookahead_tokens, target)
        new = self.manager.allocate_slots(self._new_request(request, request.all_token_ids[:]), computed=computed,
                                          num_tokens=target - hit, num_lookahead_tokens=slots)
        self._looked_up.pop(rid, None)
        if new is None:
            return None
        self._rows[rid] = self.manager.row_of(rid)
        return [Block(b) for b in new[0]]

    def _grow(self, request: Any, num_tokens: int, num_lookahead_tokens: int) -> list[Block] | None:
        update = self._running_update(request, num_tokens, num_lookahead_tokens)
        rid = update.request_id
        new = self.manager.allocate_slots(rid, update.new_token_ids, num_tokens=update.num_tokens_to_compute,
                                          num_lookahead_tokens=update.num_lookahead_tokens)
        if new is None:
            return None
        return [Block(b) for b in new[0]]

    def _running_update(self, request: Any, num_tokens: int, num_lookahead_tokens: int) -> RunningUpdate:
        """gpukv's update for vLLM's ``allocate_slots(request, num_tokens,
        num_lookahead_tokens=...)`` of a running request."""
        rid = request.request_id
        (held,), (computed,) = (a.tolist() for a in self.manager.row_token_counts([self._rows[rid]]))
        appended = request.all_token_ids[held:]  # only what vLLM appended since
        num_known = request.num_tokens
        vllm_computed = request.num_computed_tokens
        check_scheduled(request, num_known, vllm_computed, num_tokens)
        # What vLLM caches after this call (its computed tokens less the
        # speculative ones), at least one token more than gpukv has computed.
        target = max(vllm_computed + num_tokens - len(request.spec_token_ids), computed + 1)
        target = min(target, num_known)
        slots = self._slots(vllm_computed + num_tokens + num_lookahead_tokens, target)
        return RunningUpdate(rid, appended, target - computed, slots)

    def _slots(self, vllm_total: int, target: int) -> int:
        """Lookahead slots beyond ``target`` so blocks cover ``vllm_total``
        tokens; vLLM caps a request's blocks at ``max_model_len``, so do we."""
        return max(0, min(vllm_total, self.max_model_len) - target)

    def _computed_for(self, rid: str, blocks: list[Any] | None) -> ComputedBlocks | None:
        """The hit of the request's last lookup, if ``blocks`` are its blocks."""
        if not blocks:
            return None
        looked_up = self._looked_up.get(rid)
        try:
            ids = [b.block_id for b in blocks]
        except AttributeError as exc:
            raise InvalidTypeError("new_computed_blocks must be the blocks get_computed_blocks returned",
                                   argument="new_computed_blocks",
                                   fix="pass get_computed_blocks(request)[0]") from exc
        if looked_up is None or ids != looked_up.block_ids[0]:
            raise InvalidInputError(f"new_computed_blocks {ids} are not the hit of request {rid!r}'s last lookup",
                                    argument="new_computed_blocks",
                                    fix="call get_computed_blocks(request) and pass its blocks unchanged")
        return looked_up


def _lora_id(request: Any) -> int | None:
    lora = request.lora_request
    return lora.lora_int_id if lora else None
