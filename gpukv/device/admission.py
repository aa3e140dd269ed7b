"""The device manager's admission: a step's new requests (phases 3-5) in
rounds, and the lookups that change nothing.

One round: the new requests not admitted yet get candidate rows; the host
plans their prompts (``gpukv.device.admission_plan.plan_admission``: one upload into
the bucket's fixed buffers, ``AdmissionBuffers``); the device writes the
rows, hashes and looks the prompts up, and admits in order as vLLM's
waiting loop does (``kernels/lookup.py``: the budget, the free blocks, a
running update that did not fit), then takes the admitted requests' blocks.
The round's status rides on the step's one read. When the device deferred
(a request's hit would reuse a block an earlier admitted one just popped),
vLLM looks the rest up after those pops: another round, one read more.

Every launch of a bucket's parts is kept on its first round and replayed
(``SharedLaunches.replayed``, ``gpukv.device.launches``), or replayed as a CUDA graph
(``gpukv.device.graphs.AdmissionGraphs``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from gpukv.core import hashing
from gpukv.core.checks import (
    apply_allocate_args,
    check_computed_for,
    check_prefix_hit,
    normalize_computed,
    stale_computed_blocks,
)
from gpukv.core.requests import ComputedBlocks, NewRequest, PrefixHit, StepResult
from gpukv.device.admission_plan import AdmissionBuffers, AdmissionPlan, empty_plan, hit_limit, plan_admission
from gpukv.device.outputs import StepGather
from gpukv.kernels import decode as decode_ops
from gpukv.kernels import lookup as lookup_ops
from gpukv.kernels import prefill as prefill_ops

if TYPE_CHECKING:
    from gpukv.device.launches import SharedLaunches
    from gpukv.device.reads import DeviceReads
    from gpukv.device.state import DeviceCalls, DeviceState


#: Up to this many admitted requests, their host mirror is written request by request (``_keep_rows``): 2-6
#: us for 2 to 8 requests where numpy's arrays take 7-9 us; numpy is quicker from about 16.
_FEW_ADMITTED = 8


def _hit_and_touches(words: list) -> list:
    """A dry lookup's hit and first touches from its status words
    ``ST_HITS..ST_TOUCHES``: it looks its one request up whatever the free
    blocks (no budget, nothing popped before it, never deferred), so the
    step's blocks-hit stat is that request's hit."""
    return [words[0], words[lookup_ops.ST_TOUCHES - lookup_ops.ST_HITS]]


class Admission:
    """The admission of one device manager (``state``: its rows, pool,
    requests, stats and staging; ``calls``: its read, step, checks and call
    markers; ``reads``; ``launches``: the verbs shared with the decode;
    ``max_chunk``: the most tokens the engine computes for a request in one
    step, None: no bound, ``plan_admission``'s sizes), with the per-bucket
    host plans and device buffers it reuses."""

    def __init__(self, state: DeviceState, calls: DeviceCalls, reads: DeviceReads,
                 launches: SharedLaunches, max_chunk: int | None = None) -> None:
        self._s = state
        self._calls = calls
        self._reads = reads
        self._launches = launches
        self._max_chunk = max_chunk
        self.buffers: dict[tuple, AdmissionBuffers] = {}
        #: The last dry lookup (``_dry_lookup``), None after one on device tokens.
        self.memo: LookupMemo | None = None
        self._unblocked: torch.Tensor | None = None  # int32[1] 0: a dry lookup's ``blocked`` flag

    # ------------------------------------------------------------- rounds
    def round(self, new, result: StepResult, hit_caps, token_budget: int | None, count_stats: bool, graphs=None,
              lead: Sequence[torch.Tensor] = (), tail: StepGather | None = None,
              hit_touches: Sequence[int] | None = None) -> tuple[bool, list]:
        """Admit the new requests after the ``result.num_admitted`` admitted
        so far (all of them in the step's first round; after a deferral,
        ``_admit_kernel``, the rest), with what the budget has left, in one
        read that also carries ``lead`` (int64[1] tensors); ``result`` grows.
        ``hit_touches``: ``hit_caps`` are the hits a lookup finds now, and
        these the blocks of each hit no request holds (the manager's own
        lookup read them in this state): where that makes the outcome
        certain, the round reads nothing (``known_fit``). Returns whether it
        deferred again, and ``lead``'s values."""
        s = self._s
        done = result.num_admitted
        rest = new[done:]
        budget_left = None if token_budget is None else token_budget - sum(result.num_new_tokens)
        known = None if hit_touches is None or done or lead or tail is not None else \
            self.known_fit(rest, hit_caps, hit_touches, budget_left)
        rows = [s.rows.take() for _ in rest]
        try:
            status, hits, computed, full = self.admit(rest, rows, s.blocked,
                                                      None if hit_caps is None else hit_caps[done:],
                                                      token_budget=budget_left, graphs=graphs)
        except BaseException:
            s.rows.give_back_unused(rows)  # no row leaks, whatever went wrong
            raise
        part = StepResult()
        if known is not None:
            host, taken = known
            s.free_lower_bound -= taken  # (exact: the blocks the admission takes, as a read would have set it)
            deferred = self.finish(rest, rows, host, part, count_stats)
            self._merge(result, part)
            return deferred, []
        gathered = [] if tail is None else tail.parts((np.asarray(rows, dtype=np.int64), self.most_blocks(rest)),
                                                      first=done)
        outputs = [hits, computed, full] if s.hybrid else [hits, computed]
        host = self._reads.step_status([*lead, status[: lookup_ops.NUM_STATUS],
                                        *(t.to(torch.int64) for t in outputs), *gathered])
        deferred = self.finish(rest, rows, host[len(lead):], part, count_stats)
        if tail is not None:
            adm = np.asarray(part.rows, dtype=np.int64)
            tail.took(host[len(lead) + lookup_ops.NUM_STATUS + len(outputs) * len(rest):], adm, s.rows.num_held[adm])
        self._merge(result, part)
        return deferred, host[: len(lead)]

    @staticmethod
    def _merge(result: StepResult, part: StepResult) -> None:
        """A round's ``part`` added to the step's ``result``."""
        result.num_admitted += part.num_admitted
        result.num_computed_tokens += part.num_computed_tokens
        result.rows += part.rows
        result.num_new_tokens += part.num_new_tokens
        result.refused_hit_tokens = part.refused_hit_tokens
        if part.full_attention_hit_tokens is not None:
            result.full_attention_hit_tokens = (result.full_attention_hit_tokens or []) + part.full_attention_hit_tokens

    def known_fit(self, new: Sequence[NewRequest], hit_caps, hit_touches: Sequence[int],
                  budget_left: int | None) -> tuple[list[int], int] | None:
        """What a round's read would say, where the host knows it: one
        request (no deferral), its hit exact (``hit_caps``, ``round``) and
        its first touches known (``hit_touches``), no token budget, no
        KV-event log (the events ride on the read), tokens on the host, and
        every block it takes (``_charge``'s new blocks and the touches) under
        the host's lower bound of free blocks, so the device admits it. The
        values ``finish`` reads (status, hit, computed tokens, and a hybrid
        model's full-attention hit: the hit, as the cap bounds it too) and
        the blocks taken; None: read them."""
        s = self._s
        if len(new) != 1 or budget_left is not None or s.events.log is not None:
            return None
        (r,) = new
        if isinstance(r.token_ids, torch.Tensor):
            return None
        bs, n = s.block_size, len(r.token_ids)
        hit = min(hit_limit(r, bs), int(hit_caps[0]))
        chunk = n if r.num_tokens_to_compute is None else r.num_tokens_to_compute
        computed = hit * bs + min(n - hit * bs, chunk)
        taken = (-(-(computed + r.num_lookahead_tokens) // bs) - hit) * s.num_groups + int(hit_touches[0])
        if taken > s.free_lower_bound:
            return None
        status = [0] * lookup_ops.NUM_STATUS
        status[lookup_ops.ST_ADMITTED], status[lookup_ops.ST_USED] = 1, taken
        return [*status, hit, computed, *((hit,) if s.hybrid else ())], taken

    def most_blocks(self, new: Sequence[NewRequest]) -> np.ndarray:
        """The most block positions each new request can hold after its
        admission (its whole prompt computed, and its lookahead)."""
        bs = self._s.block_size
        return np.fromiter((-(-(len(r.token_ids) + r.num_lookahead_tokens) // bs) for r in new), np.int64, len(new))

    def finish(self, new, cand_rows: list[int], host: list, result: StepResult, count_stats: bool) -> bool:
        """The admitted requests keep their rows; the others give theirs back.
        Returns whether the admission deferred the rest (``ST_DEFERRED``)."""
        s = self._s
        K, S = len(new), lookup_ops.NUM_STATUS
        stat, hits, comp = host[:S], host[S: S + K], host[S + K: S + 2 * K]
        full = host[S + 2 * K: S + 3 * K] if s.hybrid else None
        if count_stats:
            self.count_lookups(new, hits)
        admitted = int(stat[lookup_ops.ST_ADMITTED])
        bs = s.block_size
        result.num_admitted = admitted
        if admitted < K and hits[admitted] >= 0:  # looked up, then refused
            result.refused_hit_tokens = int(hits[admitted]) * bs
        result.num_computed_tokens = [int(h) * bs for h in hits[:admitted]]
        if full is not None and admitted:
            result.full_attention_hit_tokens = [int(f) * bs for f in full[:admitted]]
        result.num_new_tokens = [int(c) - int(h) * bs for c, h in zip(comp[:admitted], hits[:admitted], strict=True)]
        result.rows = cand_rows[:admitted]
        if admitted:
            self._keep_rows(new[:admitted], result.rows, hits[:admitted], comp[:admitted])
        s.rows.give_back_unused(cand_rows[admitted:])
        return bool(stat[lookup_ops.ST_DEFERRED])

    def _keep_rows(self, admitted: Sequence[NewRequest], rows: list[int], hits: list, comp: list) -> None:
        """The host's mirror of the admitted requests' rows: their counts, the
        window groups' null blocks before their hits, their ids."""
        s = self._s
        bs, rs = s.block_size, s.rows
        if len(rows) <= _FEW_ADMITTED:  # (plain ints, no array built: quicker than numpy for a few requests)
            for req, row, h, c in zip(admitted, rows, hits, comp, strict=True):
                hit, done = int(h), int(c)
                rs.num_tokens[row], rs.num_computed[row] = len(req.token_ids), done
                rs.num_held[row] = -(-(done + req.num_lookahead_tokens) // bs)
                rs.null_until[row] = [0 if w < 0 else max(0, hit - w) for w in s.window_blocks]
                s.reqs[req.request_id] = row
                s.row_ids[row] = req.request_id
            return
        adm = np.asarray(rows, dtype=np.int64)
        h = np.asarray(hits, dtype=np.int64)
        n = np.fromiter((len(r.token_ids) for r in admitted), np.int64, len(admitted))
        lookahead = np.fromiter((r.num_lookahead_tokens for r in admitted), np.int64, len(admitted))
        computed = np.asarray(comp, dtype=np.int64)  # the admission's (``_admit_kernel``)
        rs.num_tokens[adm], rs.num_computed[adm] = n, computed
        rs.num_held[adm] = -(-(computed + lookahead) // bs)
        w = np.asarray(s.window_blocks, dtype=np.int64)
        rs.null_until[adm] = np.where(w < 0, 0, np.maximum(0, h[:, None] - w))
        for req, row in zip(admitted, rows, strict=True):
            s.reqs[req.request_id] = row
            s.row_ids[row] = req.request_id

    def count_lookups(self, new, hits: list) -> None:
        """Stats of the lookups the admission made: every request it looked
        at (a hit >= 0; it stops after the first refused one)."""
        s = self._s
        bs = s.block_size
        for req, h in zip(new, hits, strict=True):
            if h < 0:
                break
            n = 0 if req.skip_prefix_cache else len(req.token_ids)
            s.stats.record(num_tokens=n, num_hit_tokens=int(h) * bs, num_blocks=-(-n // bs), num_hit_blocks=int(h),
                            preempted=req.num_preemptions > 0)

    # ------------------------------------------------------------- lookups
    def allocate_new(self, request: NewRequest, computed: ComputedBlocks | None, num_tokens: int | None,
                     num_lookahead_tokens: int | None) -> list[list[int]] | None:
        """``allocate_slots`` of a new request: admitted with the hit its
        ``computed`` blocks give (still what a lookup finds now, else
        refused), its new blocks per group, or None when they do not fit."""
        s = self._s
        (request,) = self._calls.normalize((), (), [request], single=True, defer_admissible=True).new
        computed = normalize_computed(computed, s.limits)
        check_computed_for(request, computed, s.limits)
        request = apply_allocate_args(request, computed.num_tokens if computed is not None else 0, num_tokens,
                                      num_lookahead_tokens, s.limits)
        with self._calls.counting():
            cap, memo = 0, None
            if computed is not None:
                # Checked before anything changes: the given hit must still be
                # what a lookup capped at its length finds now (a longer hit
                # would move a window group's null blocks).
                cap = computed.num_tokens // s.block_size
                current, memo = self._hit_current(request, cap, computed.num_tokens, computed.block_ids)
                if not current:
                    raise stale_computed_blocks()
            # (the dry lookup above wrote only a free row and scratch buffers)
            touches = self._touches_known(cap, memo)
            self._calls.begin_changes()
            res = self._calls.step((), (), [request], count_stats=False, hit_caps=[cap], hit_touches=touches)
        if res.num_admitted == 0:
            return None
        got = res.num_computed_tokens[0]
        return [g[got // s.block_size:] for g in self._calls.get_block_ids(request.request_id)]

    def admit_sized(self, request: NewRequest, hit: Any, num_tokens: int | None,
                    num_lookahead_tokens: int | None) -> bool:
        """``admit`` of a new request with a hit known by its size: the hit
        checked against a lookup capped at its length (its size read, no
        block id), then one step admitting the request with that cap (the
        same lookup, nothing changed in between, so the same hit); the check
        is skipped where the last dry lookup proves it (``LookupMemo``)."""
        s = self._s
        (request,) = self._calls.normalize((), (), [request], single=True, defer_admissible=True).new
        hit_tokens = check_prefix_hit(hit, request, s.limits)
        request = apply_allocate_args(request, hit_tokens, num_tokens, num_lookahead_tokens, s.limits)
        cap, memo = hit_tokens // s.block_size, None
        with self._calls.counting():
            if cap:
                current, memo = self._hit_current(request, cap, hit_tokens, None)
                if not current:
                    raise stale_computed_blocks()
            touches = self._touches_known(cap, memo)
            self._calls.begin_changes()
            res = self._calls.step((), (), [request], count_stats=False, hit_caps=[cap], hit_touches=touches)
        return res.num_admitted == 1

    @staticmethod
    def _touches_known(cap: int, memo: LookupMemo | None) -> list[int] | None:
        """The first touches of the hit of ``cap`` blocks just checked to be
        current by ``memo`` (``_hit_current``'s): none without a hit; else
        the unheld blocks it read, where it was a sized lookup; None when not
        known (the step then reads its outcome)."""
        if cap == 0:
            return [0]
        if memo is None or memo.unheld is None:
            return None
        return [memo.unheld]

    def lookup_only(self, request: NewRequest, count_stats: bool, hit_cap: int | None = None) -> ComputedBlocks:
        """The hit a step would give this request now (at most ``hit_cap``
        blocks), changing no block: its blocks read back."""
        s = self._s
        n, _, cache, full = self._dry_lookup(request, count_stats, hit_cap, sized=False)
        blocks = self._calls.read(cache[0, :n].T) if n else [[] for _ in range(s.num_groups)]
        for g, w in enumerate(s.window_blocks):
            if w >= 0:  # a window group holds the null block before its last W hit positions
                blocks[g] = [0 if p < n - w else b for p, b in enumerate(blocks[g])]
        if self.memo is not None:  # (the lookup just remembered: its ids, a copy no caller holds)
            self.memo.ids = [list(g) for g in blocks]
        return ComputedBlocks(blocks, n * s.block_size, None if full is None else full * s.block_size)

    def lookup_size(self, request: NewRequest, count_stats: bool, hit_cap: int | None = None) -> PrefixHit:
        """The size of the hit a step would give this request now (at most
        ``hit_cap`` blocks) and how many of its blocks no request holds, in
        one read; no block id leaves the device, no block changes."""
        n, unheld, _, full = self._dry_lookup(request, count_stats, hit_cap, sized=True)
        return PrefixHit(n * self._s.block_size, unheld, None if full is None else full * self._s.block_size)

    def _dry_lookup(self, request: NewRequest, count_stats: bool, hit_cap: int | None,
                    sized: bool) -> tuple[int, int, torch.Tensor, int | None]:
        """A lookup that admits nothing, on a row taken and given back: the
        hit in blocks, (with ``sized``) its unheld blocks, the cached hits
        buffer (int32[KP, P, G]: request 0's row holds the hit's ids) and the
        full-attention hit in blocks (a hybrid model's; else None), read
        in one read with the verdict on device tokens."""
        s = self._s
        row = s.rows.take()
        try:
            caps = [0] if not s.enable_caching else None if hit_cap is None else [hit_cap]
            status, hit, _, cache, full = self.admit([request], [row], self.unblocked(), caps, dry=True)
            tokens = request.token_ids
            on_device = isinstance(tokens, torch.Tensor)
            if on_device or s.hybrid:  # (in one read: the hit, its unheld blocks, the full-attention hit, the verdict)
                # (sized: the dry admission's first touches of its one request, the hit's unheld blocks)
                parts = [hit.to(torch.int64), *([status[lookup_ops.ST_TOUCHES: lookup_ops.ST_TOUCHES + 1]] if sized
                                                else []), *([full.to(torch.int64)] if s.hybrid else [])]
                if isinstance(tokens, torch.Tensor):  # checked on the device: the verdict rides with the hit
                    parts.append(self.device_tokens_bad([tokens]))
                values = self._calls.read(torch.cat(parts))
                if on_device:
                    self._reads.check_errors(values[-1], "request.token_ids")  # before any change: a refusal
            elif sized:  # two status words, read as they are (no cast, no concatenation): ``_hit_and_touches``
                values = _hit_and_touches(self._calls.read(status[lookup_ops.ST_HITS: lookup_ops.ST_TOUCHES + 1]))
            else:  # the hit alone: read as it is
                values = self._calls.read(hit)
            n = int(values[0])
            if count_stats:
                self._calls.begin_changes()  # get_computed_blocks' point of first change
                self.count_lookups([request], [n])
        finally:
            s.rows.give_back_unused([row])
        unheld = int(values[1]) if sized else None
        self._remember(request, hit_cap, n, unheld)
        return n, unheld or 0, cache, int(values[1 + sized]) if s.hybrid else None

    def unblocked(self) -> torch.Tensor:
        """int32[1] 0 on the device: a dry lookup's ``blocked`` flag, made
        once and never written (the kernel only reads it), so the dry lookup's
        kept launches stay valid to replay."""
        if self._unblocked is None:
            self._unblocked = torch.zeros(1, dtype=torch.int32, device=self._s.device)
        return self._unblocked

    def _remember(self, request: NewRequest, hit_cap: int | None, hit: int, unheld: int | None) -> None:
        """A dry lookup's result kept for the admission that follows
        (``_hit_current``, ``_touches_known``), with the most blocks it could
        hit and (a sized lookup) its unheld blocks; nothing kept for tokens
        on the device (never compared on the host)."""
        s = self._s
        if isinstance(request.token_ids, torch.Tensor):
            self.memo = None
            return
        limit = hit_limit(request, s.block_size) if s.enable_caching else 0
        bound = limit if hit_cap is None else min(hit_cap, limit)
        self.memo = LookupMemo(s.epoch, request, bound, hit, s.block_size)
        self.memo.unheld = unheld

    def _hit_current(self, request: NewRequest, cap: int, hit_tokens: int,
                     ids: Sequence[Sequence[int]] | None) -> tuple[bool, LookupMemo | None]:
        """Whether a lookup of ``request`` capped at ``cap`` blocks finds now
        a hit of ``hit_tokens`` (with ``ids``: those block ids per group),
        and the dry lookup that says so, for the admission's touches
        (``_touches_known``). The remembered dry lookup answers where it
        provably gives what a lookup now would (``LookupMemo.covers``: the
        tokens compared once an admission); else a capped dry lookup of this
        request (sized: no id read, when no id is compared), remembered in
        turn (None: tokens on the device, never remembered)."""
        s = self._s
        memo = self.memo
        if memo is not None and memo.covers(request, cap, s.epoch) and (ids is None or memo.ids is not None):
            return memo.hit * s.block_size == hit_tokens and (ids is None or memo.same_ids(ids)), memo
        if ids is None:
            current = self.lookup_size(request, count_stats=False, hit_cap=cap).num_tokens == hit_tokens
            return current, self.memo
        now = self.lookup_only(request, count_stats=False, hit_cap=cap)
        current = now.num_tokens == hit_tokens and all(list(ids[g]) == now.block_ids[g] for g in range(s.num_groups))
        return current, self.memo

    def device_tokens_bad(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """int64[1] on the device: ``ERR_BAD_TOKEN`` if any id of these token
        tensors (``step()``'s and lookups' tokens on the device, which the
        host never reads) is outside ``[0, 2**32)``, else 0. A step ORs it
        into the free queue's sticky error word, which its read raises; a
        lookup reads it with the hit. A few torch operations per tensor, only
        on this path (the batched decode checks in its kernel)."""
        bad = torch.zeros(1, dtype=torch.int64, device=self._s.device)
        for t in tensors:
            out = (t < 0).any() if t.dtype == torch.int32 else (torch.bitwise_right_shift(t, 32) != 0).any()
            bad.bitwise_or_(out.to(torch.int64) * decode_ops.ERR_BAD_TOKEN)
        return bad

    # ------------------------------------------------------------ launches
    def admit(self, new, rows, blocked, hit_caps=None, dry: bool = False, token_budget: int | None = None,
              graphs=None):
        """Phases 3-5 of a step: the new requests into ``rows``, their
        digests, lookups and admission, then (unless ``dry``) their blocks.
        Planned on the host from the requests' lengths and uploaded once;
        every entry after that is derived on the device
        (``gpukv.kernels.prefill``), by launches prepared once per bucket and
        replayed. Returns the admission's status, the hits (int32[K]), the
        tokens each request has computed after the step (int32[K]), (with
        ``dry``) the cached hits (int32[KP, P, G]), and the full-attention
        hits (int32[K], written for a hybrid model only)."""
        s = self._s
        plan = plan_admission(new, rows, s.block_size, hit_caps, self._host_array, token_budget, dry,
                              self._max_chunk)
        return self._launch(plan, new, rows, blocked, dry, graphs)

    def prepared(self, bucket: tuple, dry: bool) -> bool:
        """Whether ``bucket``'s launches (a dry lookup's, or a step's) are kept."""
        bufs = self.buffers.get(bucket)
        return bufs is not None and self._launches.is_kept(bufs.prepared, "lookup" if dry else "admit")

    def prepare(self, bucket: tuple, dry: bool) -> None:
        """``bucket``'s buffers made and its launches prepared by a round
        admitting no request: every program of its kernels finds no request
        and writes only the bucket's own buffers, so nothing a lookup or a
        step reads changes, and the first admission of the bucket replays
        its launches (no first-time launch, no buffer zeroed, on the serving
        path). With KV-cache events on no launch is kept
        (``SharedLaunches.replayed``): the buffers are made and the kernels
        compiled."""
        plan = empty_plan(bucket, self._host_array)
        self._launch(plan, [], [], self.unblocked() if dry else self._s.blocked, dry, None)

    def _launch(self, plan: AdmissionPlan, new, rows, blocked, dry: bool, graphs):
        """``admit``'s device part: ``plan`` into its bucket's buffers, then
        the bucket's parts (each prepared once, then replayed)."""
        s = self._s
        bufs = self.buffers.get(plan.bucket)
        if bufs is None:
            bufs = self.buffers[plan.bucket] = AdmissionBuffers.create(plan.bucket, s.num_groups, s.device)
        # (written in the staging's array, ``_host_array``: sent as it is, one copy)
        s.staging.upload_host(("admission", plan.bucket), bufs.plan, len(plan.packed))
        if plan.device_tokens and not dry:  # (a dry lookup reads its own verdict: ``lookup_only``)
            errors = s.pool.free_queue.counter("error")
            errors.bitwise_or_(self.device_tokens_bad([t for _, t in plan.device_tokens]))
        for off, t in plan.device_tokens:
            bufs.views["tokens"][off: off + t.numel()].copy_(t)  # int64 ids wrap to their uint32 bits

        def write_rows() -> None:
            prefill_ops.write_rows(bufs.views, tokens=s.rows.tokens, extras=s.rows.extras)

        if dry:  # (a lookup only: not worth a graph)
            graphs = None
        self._part(plan.bucket, bufs, "rows", write_rows, graphs)
        self.write_extra_keys(new, rows)  # (host work, only for requests with extra keys)
        if dry:  # a lookup only (``get_computed_blocks``): its own part, replayed as the step's are
            assert blocked is self.unblocked()  # (a replay relaunches on the kept flag)
            self._part(plan.bucket, bufs, "lookup", lambda: self._find_and_admit(bufs, blocked), None)
            k = len(new)
            return bufs.status, bufs.hit[:k], bufs.views["comp"][:k], bufs.cache, bufs.full_hit[:k]

        def admit_and_take() -> None:
            self._find_and_admit(bufs, blocked)
            self._take_admitted_blocks(bufs)

        self._part(plan.bucket, bufs, "admit", admit_and_take, graphs)
        self._launches.rebuild_if_due(plan.max_new_blocks * s.num_groups)
        # (events: at most one per block popped or cached, whatever the bucket's padding)
        s.events.expect((plan.max_new_blocks + plan.max_cached_blocks) * s.num_groups)
        return bufs.status, bufs.hit[: len(new)], bufs.views["comp"][: len(new)], bufs.full_hit[: len(new)]

    def _host_array(self, bucket: tuple, size: int) -> np.ndarray:
        """The staging's host array for a plan of ``bucket`` (``plan_admission``'s
        ``host_array``): pinned on CUDA, kept per bucket, so the plan is
        written once and sent with one copy (a second plan of the bucket in
        a step gets a staging region: ``Staging.host_array``)."""
        return self._s.staging.host_array(("admission", bucket), size)

    def _part(self, bucket: tuple, bufs: AdmissionBuffers, part: str, launch, graphs) -> None:
        """One fixed part of the admission's launches: a CUDA graph replay
        (``graphs``: ``gpukv.device.graphs.AdmissionGraphs``; not with KV-cache
        events), else its kept launches replayed (``SharedLaunches.replayed``)."""
        s = self._s
        if graphs is not None and s.events.log is None:
            with self._calls.hook():  # (the caller's code: the manager's own calls refused there)
                graphs.run((bucket, part), launch)
        else:
            self._launches.replayed(bufs.prepared, part, launch)

    def _find_and_admit(self, bufs: AdmissionBuffers, blocked) -> None:
        """The prompts' digests, their verified cached blocks, the chains of
        the step's requests sharing a block, and the sequential admission."""
        s = self._s
        v, pool, bs = bufs.views, s.pool, s.block_size
        self._launches.hash_rows(v["rows"], bufs.zeros, v["nfull"])
        rows = s.rows
        shared = dict(tokens=rows.tokens, digests=rows.digests, extras=rows.extras, root=s.root_lanes)
        prefill_ops.lookup(v, bufs.cache, table=pool.table, blk_tokens=pool.blk_tokens, blk_parent=pool.blk_parent,
                           blk_extra=pool.blk_extra, **shared)
        prefill_ops.chains(v, bufs.head, bufs.next, bufs.same, block_size=bs, **shared)
        lookup_ops.admit(bufs.cache, None, v["max_hit"], v["nblocks"], v["ntok"], v["skip"], ref_cnt=pool.ref_cnt,
                         touched=pool.touched, stamp=pool.stamp, num_free=pool.free_count, blocked=blocked,
                         block_size=bs, hit_out=bufs.hit, status=bufs.status, window_blocks=s.win_dev,
                         chains=(bufs.head, bufs.next, bufs.same), resolved=bufs.resolved, start=bufs.start,
                         compute=v["comp"], lookahead=v["lookahead"], num_requests=v["num_requests"],
                         token_budget=v["token_budget"], free_queue=pool.free_queue,
                         full_hit_out=bufs.full_hit if s.hybrid else None)

    def _take_admitted_blocks(self, bufs: AdmissionBuffers) -> None:
        """The admitted requests' blocks: first touches of their cached hits,
        their new blocks, their hits into their block tables (a pending hit
        takes a reference to the block an earlier request just got), and the
        full blocks of their chunks cached, each in (request, group,
        position) order."""
        s = self._s
        pool, table = s.pool, s.rows.block_table
        prefill_ops.admission_entries(bufs.views, bufs.status, bufs.hit, bufs.start, bufs.cache, s.win_dev,
                                      bufs.alloc, bufs.record, block_size=s.block_size, ref_cnt=pool.ref_cnt,
                                      free_queue=pool.free_queue)
        grp, row, pos, want, rank = bufs.alloc
        count = bufs.status[lookup_ops.ST_NEW_BLOCKS: lookup_ops.ST_NEW_BLOCKS + 1]
        pool.allocate(count, want, grp, row, pos, block_table=table, rank=rank, popped=bufs.popped,
                      on_popped=s.events.popped_hook())
        prefill_ops.place_hits(bufs.views, bufs.status, bufs.hit, bufs.cache, bufs.resolved, s.win_dev,
                               block_table=table, ref_cnt=pool.ref_cnt, free_queue=pool.free_queue)
        self._launches.cache_blocks(*bufs.record, scratch=bufs.record_scratch, seq=bufs.record_seq)

    def write_extra_keys(self, new: Sequence[NewRequest], rows: list[int]) -> None:
        """The extra-key digests of new requests that have extra keys (their
        rows were zeroed by the admission's first launch): their prompt
        blocks' (LoRA, multimodal items, salt) and, for every later block, the
        LoRA-only digest (later tokens carry no multimodal item or salt), so
        running steps and decodes never compute extra keys."""
        s = self._s
        up = s.staging.upload
        if s.events.log is not None:  # the LoRA id each row's stored blocks report
            lora = [(0, 0) if r.lora_id is None else (1, r.lora_id - 2**64 if r.lora_id >= 2**63 else r.lora_id)
                    for r in new]
            s.rows.lora[up(np.asarray(rows, dtype=np.int64))] = up(np.array(lora, dtype=np.int64).reshape(-1, 2))
        bs, key = s.block_size, s.key
        for r, row in zip(new, rows, strict=True):
            if r.lora_id is None and not r.mm_items and r.cache_salt is None:
                continue
            nb = -(-len(r.token_ids) // bs)
            ds = hashing.extra_key_digests(key, nb, bs, lora_id=r.lora_id, mm_items=r.mm_items,
                                           cache_salt=r.cache_salt)
            extras = s.rows.extras
            extras[row, :nb] = up(np.asarray(hashing.digests_to_lanes(ds).view(np.int64), dtype=np.int64))
            if r.lora_id is not None and nb < s.rows.max_blocks:
                (later,) = hashing.extra_key_digests(key, 1, bs, lora_id=r.lora_id, first_block=max(nb, 1))
                extras[row, nb:] = up(np.asarray(hashing.digests_to_lanes([later]).view(np.int64), dtype=np.int64))


class LookupMemo:
    """A dry lookup the manager made (``Admission._dry_lookup``): the
    normalised request it looked up (its token array is the manager's own,
    made by the argument checks: no caller holds it), the most blocks it
    could hit (its cap and its own last-token limit), its hit in blocks, the
    hit's ids per group when they were read (``lookup_only``: a copy, window
    nulls in place), or the hit's blocks no request holds when they were
    (``lookup_size``), the block size and the mutation epoch it saw
    (``DeviceState.epoch``)."""

    __slots__ = ("epoch", "request", "bound", "hit", "block_size", "ids", "unheld")

    def __init__(self, epoch: int, request: NewRequest, bound: int, hit: int, block_size: int) -> None:
        self.epoch, self.request, self.bound, self.hit, self.block_size = epoch, request, bound, hit, block_size
        self.ids: list[list[int]] | None = None
        self.unheld: int | None = None

    def covers(self, request: NewRequest, cap: int, epoch: int) -> bool:
        """Whether a lookup of ``request`` capped at ``cap`` blocks now must
        give this one's result. A capped lookup reads the pool and the digests
        of the first ``cap`` blocks only, which chain over those blocks'
        tokens and the extra keys; its hit is the largest every group can
        serve under its bound (``kernels/lookup.py``, ``_request_hit``: the
        same from any bound at or above it, the same ids below it). So: no
        call has passed a point of first change since (``epoch``: the pool,
        the rows and the cache are as they were), this lookup's bound covers
        ``cap`` and its hit is exactly ``cap``, and the request's id, extra
        keys and host tokens over those blocks equal the remembered ones
        (vLLM's adapter looks up the prompt cut after its last possible hit
        block, then admits the whole prompt). Tokens on the device are never
        compared: the host does not read them."""
        mine, tokens = self.request, request.token_ids
        if epoch != self.epoch or self.hit != cap or self.bound < cap or isinstance(tokens, torch.Tensor):
            return False
        if (request.request_id, request.lora_id, request.cache_salt, request.skip_prefix_cache,
                request.mm_items) != (mine.request_id, mine.lora_id, mine.cache_salt, mine.skip_prefix_cache,
                                      mine.mm_items):
            return False
        n = cap * self.block_size
        return len(tokens) >= n and bool(np.array_equal(np.asarray(tokens)[:n], np.asarray(mine.token_ids)[:n]))

    def same_ids(self, ids: Sequence[Sequence[int]]) -> bool:
        """Whether ``ids`` (per group) are the remembered hit's ids."""
        assert self.ids is not None
        return len(ids) == len(self.ids) and all(list(a) == b for a, b in zip(ids, self.ids, strict=True))
