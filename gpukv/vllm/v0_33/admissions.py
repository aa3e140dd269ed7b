"""A run of vLLM 0.33's waiting loop admitted as one gpukv step (the batched
path's second half; the first is ``gpukv.vllm.v0_33.pending``).

vLLM's waiting loop looks each waiting request up, then admits it, one
request at a time; each answer depends on the calls before it. gpukv's
``step(new=[...])`` makes the same decisions for a whole run of new
requests at once (each looked up against the cache and against the blocks
the earlier ones will cache, admitted in order until one does not fit),
so a run whose every vLLM decision besides the hit and the fit is known in
advance can be made as one step and vLLM's calls answered from it.

``plain_run`` picks that run when the waiting loop's first lookup comes: the
head of the waiting queue (first come, first served), as long as each
request is one vLLM admits whatever its hit without a chunk of the budget
(its tokens, or the long-prefill threshold where that is less, fit the
token budget left, counted without hits; a plain waiting or preempted
request: no multimodal input, pooling, computed tokens, stale output,
streaming) and a model-runner slot is free. vLLM's long-prefill threshold
(``long_prefill_cap``: the step's, as vLLM's ``schedule()`` sets it at its
start) is each run request's chunk: gpukv's step computes ``min(tokens past
the hit, threshold)`` as vLLM does. The run's last request may instead be
one vLLM chunks by the budget left (chunked prefill on and, under vLLM's
whole-prompt check ``scheduler_reserve_full_isl``, its prompt provably
fitting on the host, ``HostFitProof``): gpukv's step then takes the budget
and chunks it by vLLM's rule (``gpukv.core.blocks.new_tokens_at_admission``:
``min(tokens past the hit, threshold, budget left)``, hits charged as vLLM
charges them); should its hit leave it whole, vLLM's loop goes on past the
run on the per-request path. A request the threshold may chunk is a
chunked admission to the whole-prompt check too. All this only in a step
with nothing else that bends vLLM's loop (no pause, no held-KV queue, no
replayed windows, and no deferred prefills:
vLLM defers them on a throttled or off-cadence step, by the request's hit,
unless the step is capacity-bound or no running request decodes;
``defers_prefills``). Under the priority policy the head is the queue's first in
priority order (its iteration order, the order vLLM pops it in), whose
loop decides nothing else either; under a LoRA config a LoRA request joins
the run while its adapter keeps the step within ``max_loras`` (counting
every running request's adapter, as vLLM does), and where vLLM skips one
(before its lookup: it never reaches the manager) the run leaves it out and
goes on past it, as vLLM's loop does (``LoraSlots``). With more than one
lookup group each lookup's shared-prefix boundary is the step's full-attention hit of each request
where vLLM's first lookup group is every full-attention group; else it is
read from the event index just before the request's own events are
regrouped (``PendingGrowth.flush``'s ``boundaries``), where the index
stands as vLLM's cache did at its lookup.
Under speculative decoding the budget is vLLM's
``min(token_budget, input_budget - draft_slots)`` (each scheduled request
takes its draft slots from ``input_budget``), each admission asks for
``num_lookahead_tokens`` slots more, and a prompt vLLM may pad to ``1 +
num_spec_tokens`` tokens (one that can compute a single token: its padding
depends on the hit and the running loop) ends the run. In such a run vLLM's
only per-request decisions are the hit and the fit, which are gpukv's
step's: the full prompt's blocks are at most those the step allocates (its
tokens plus lookahead slots), so vLLM's whole-prompt check adds nothing. With
a watermark, each request joins the run only when the host proves vLLM's
watermark check passes (``HostFitProof``).

``AdmittedRun`` answers vLLM's calls in order: ``lookup`` for
``get_computed_blocks``, ``allocate`` for ``allocate_slots``. A call that is
not the next one the run expects, or a run vLLM does not take to its end, is
an ``AssertionError`` (never a silent difference). The request the step
refused goes to the per-request path (vLLM looks it up and is refused the
same way), as does everything after it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from gpukv.core.requests import ComputedBlocks
from gpukv.vllm.v0_33 import features
from gpukv.vllm.v0_33.views import token_ids


class WaitingRun(NamedTuple):
    """What ``plain_run`` predicts: the requests, in order; the token budget
    gpukv's step takes for them (None: no request chunked by it); the
    lookahead slots vLLM's waiting loop asks for each
    (``num_lookahead_tokens``); the most tokens each computes past its hit
    (vLLM's long-prefill threshold; None: no cap)."""

    requests: list[Any]
    token_budget: int | None
    lookahead: int = 0
    chunk: int | None = None


def long_prefill_cap(scheduler: Any) -> int:
    """vLLM's long-prefill threshold for the ``schedule()`` about to start
    (0: none): the config's, with chunked prefill and more than one request
    running or waiting (alone, a request starves no one), floored at a fair
    share of the budget where the config asks (``..._adaptive``). Taken
    before vLLM's ``schedule()`` as vLLM takes it at its start."""
    config = scheduler.scheduler_config
    eligible = sum(scheduler.get_request_counts())
    cap = config.long_prefill_token_threshold if config.enable_chunked_prefill and eligible > 1 else 0
    if cap > 0 and getattr(config, "long_prefill_token_threshold_adaptive", False):  # (a vLLM without: none)
        cap = max(cap, config.max_num_batched_tokens // eligible)
    return cap


def plain_run(scheduler: Any, adapter: Any, num_scheduled_tokens: int, throttle_prefills: bool,
              cap: int = 0) -> WaitingRun:
    """The waiting requests vLLM's loop will look up and admit, in order,
    after the running loop scheduled ``num_scheduled_tokens`` tokens for
    ``adapter.num_scheduled_requests`` requests, under the long-prefill
    threshold ``cap`` (``long_prefill_cap``; module docstring). Empty when
    the step may bend the loop."""
    s = scheduler
    lookahead = s.num_lookahead_tokens
    chunk = cap or None
    if _bends_the_loop(s, throttle_prefills):
        return WaitingRun([], None, lookahead, chunk)
    draft_slots = _draft_slots(s)
    tokens = s.max_num_scheduled_tokens - num_scheduled_tokens  # (vLLM's token_budget and input_budget left)
    inputs = s.scheduler_config.max_num_batched_tokens - num_scheduled_tokens \
        - draft_slots * adapter.num_scheduled_requests
    slots = s.max_num_active_reqs - len(s.running) - s.num_waiting_for_streaming_input
    padded = _pads_one_token_admissions(s)
    loras = LoraSlots(s.lora_config, s.running)
    whole_prompt = bool(s.scheduler_reserve_full_isl)
    run: list[Any] = []
    taken = 0  # (the run's tokens so far, none hit)
    proof = HostFitProof(adapter)
    for request in s.waiting:
        n = request.num_tokens
        most = min(n, cap) if cap else n  # (the most tokens vLLM schedules for it, whatever its hit)
        budget = min(tokens, inputs - draft_slots)  # (vLLM's request_token_budget; its loop stops at <= 0)
        if len(run) == slots or budget <= 0 or not _plain(request):
            break
        if not loras.admit(request):
            continue  # (vLLM skips it at the check it reaches first once plain, before its lookup)
        if n + lookahead > adapter.max_model_len or (padded and (n - 1) % adapter.block_size == 0):
            break
        slots_needed = n + lookahead
        if most > budget:
            if s.scheduler_config.enable_chunked_prefill and \
                    proof.fits(slots_needed, adapter.watermark_blocks, needed=whole_prompt):
                return WaitingRun([*run, request], budget + taken, lookahead, chunk)
            break
        if not proof.fits(slots_needed, adapter.watermark_blocks, needed=whole_prompt and most < n):
            break
        run.append(request)
        tokens, inputs, taken = tokens - most, inputs - most - draft_slots, taken + most
    return WaitingRun(run, None, lookahead, chunk)


class LoraSlots:
    """vLLM's ``max_loras`` rule in its waiting loop: a LoRA request whose
    adapter would be one more than ``max_loras`` among the running requests'
    (every one, scheduled this step or not: they may join a later batch) and
    the loop's admissions so far is skipped. ``admit`` says whether the
    request passes it (and counts its adapter): one that does not is left
    out of a run, which goes on past it as vLLM's loop does. Without a LoRA
    config vLLM counts nothing."""

    def __init__(self, lora_config: Any, running: Any) -> None:
        self._max = lora_config.max_loras if lora_config is not None else None
        # (after the running loop, as vLLM counts them; positive ids only, as vLLM's)
        self._ids = set() if self._max is None else {r.lora_request.lora_int_id for r in running
                                                      if r.lora_request and r.lora_request.lora_int_id > 0}

    def admit(self, request: Any) -> bool:
        lora = request.lora_request
        if self._max is None or not lora:
            return True
        if lora.lora_int_id not in self._ids and len(self._ids) >= self._max:
            return False
        if lora.lora_int_id > 0:
            self._ids.add(lora.lora_int_id)
        return True


def _bends_the_loop(s: Any, throttle_prefills: bool) -> bool:
    """Whether vLLM's waiting loop may decide something this step besides
    each request's hit and fit (then no run is predicted)."""
    from vllm.v1.core.sched.interface import PauseState  # type: ignore[attr-defined,unused-ignore]  # (0.33)

    return bool(s._pause_state != PauseState.UNPAUSED or s.kv_holding_waiting
                or defers_prefills(s, throttle_prefills)
                or s.prefix_replay_tokens
                or s.connector is not None or s.ec_connector is not None or getattr(s, "async_kv_waiting", None))


def defers_prefills(s: Any, throttle_prefills: bool) -> bool:
    """vLLM's ``defer_prefills`` of this ``schedule()``: a throttled step
    (the DP engine core's prefill balancing) or one the prefill cadence holds
    defers every prefill, and its waiting loop then stops at the first
    request its hit leaves more than one token to compute, unless the last
    admitting step was capacity-bound or no running request decodes (all
    are prefill chunks). Asked at the waiting loop's first lookup: by then
    the running loop changed none of it (a preemption skips the waiting
    loop, and the counts move only after it)."""
    if s.prefill_capacity_bound or not (throttle_prefills or s.local_prefill_interval > 1):
        return False
    if not any(not r.is_prefill_chunk for r in s.running):
        return False
    return throttle_prefills or (s.num_executed_steps + 1) - s.last_prefill_step < s.local_prefill_interval


def _draft_slots(s: Any) -> int:
    """vLLM's ``draft_slots``: input rows each scheduled request takes
    beyond its tokens when drafting (0 without speculative decoding)."""
    spec = s.vllm_config.speculative_config
    return spec.max_num_new_slots_for_drafting if spec is not None else 0


def _pads_one_token_admissions(s: Any) -> bool:
    """Whether vLLM's waiting loop may pad an admission that computes one
    token to ``1 + num_spec_tokens`` (uniform speculative decode): it does
    by its hit (all but the last token) and by what the running loop
    scheduled, which the host does not know, so such a request ends a run."""
    return bool(s.num_spec_tokens > 0 and s.num_sampled_tokens_per_step > 0)


class HostFitProof:
    """vLLM's admission checks that are stricter than gpukv's fit (the
    watermark, and the whole prompt under ``scheduler_reserve_full_isl``
    for a chunked admission), proved on the host for each request of a run
    in turn: its prompt's blocks with no hit (a hit only lowers what vLLM
    counts: the hit's evictable blocks plus the new ones) and the watermark
    within the manager's free-block lower bound, less what the running
    loop's calls (``pending.taken``) and the run's earlier requests may take.
    Proved, vLLM's check passes and so does gpukv's (it takes no more); not
    proved, the run ends there and vLLM's loop goes on per request, where
    the adapter makes vLLM's check itself."""

    def __init__(self, adapter: Any) -> None:
        self._adapter = adapter
        self._taken = adapter.pending.taken
        self._bound: int | None = None  # (read once, on the first check that needs it)

    def fits(self, num_tokens: int, watermark: int, *, needed: bool) -> bool:
        """Whether a request of ``num_tokens`` passes (always when neither
        the watermark nor ``needed`` asks for a check); counts its blocks
        as taken when it does."""
        a = self._adapter
        blocks = a.num_kv_cache_groups * -(-num_tokens // a.block_size)
        if watermark or needed:
            if self._bound is None:
                self._bound = a.manager.free_blocks_lower_bound()
            if self._bound - self._taken < blocks + watermark:
                return False
        self._taken += blocks
        return True


def _plain(request: Any) -> bool:
    """A waiting request vLLM's loop looks up and admits with no decision of
    its own besides the hit and the fit."""
    from vllm.v1.request import RequestStatus

    return (request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) and request.num_computed_tokens == 0
            and not (request.num_stale_output_tokens and not request.drop_stale_output)
            and not request.mm_features and request.prompt_embeds is None
            and request.pooling_params is None and not request.resumable and not features.hit_bounded(request))


@dataclass
class RunEntry:
    """One request of an ``AdmittedRun``: what vLLM's calls get back."""

    request: Any
    computed: ComputedBlocks  # gpukv's hit
    hit_blocks: Any  # the KVCacheBlocks get_computed_blocks returns
    new_blocks: Any  # the KVCacheBlocks allocate_slots returns
    block_ids: list[list[int]] | None  # all its blocks, per group (None: they stay on the device)
    num_new_tokens: int  # the tokens it computes past the hit (all of them, or the run's last one's chunk)
    looked_up: bool = False
    boundary: int = 0  # the shared-prefix boundary get_computed_blocks returns (more than one lookup group)


class AdmittedRun:
    """The admissions of one gpukv step, answering vLLM's calls in order.
    ``adapter``: the ``gpukv.vllm.v0_33.KVCacheManager``."""

    def __init__(self, adapter: Any) -> None:
        self._adapter = adapter
        self.num_runs = 0  # steps that admitted a run, since construction
        self.num_admitted = 0  # requests they admitted
        self.num_chunked = 0  # of those, admitted with a chunk of their prompt
        self.reset()

    def reset(self) -> None:
        """Forget the step's run (a new ``schedule()``)."""
        self.started = False
        self.lookahead = 0  # (the slots vLLM asks past each admission's tokens)
        self.entries: list[RunEntry] = []
        self.cursor = 0

    def check_taken(self) -> None:
        """After ``schedule()``: vLLM admitted every request of the run."""
        left = self.entries[self.cursor:]
        self.reset()
        if left:
            raise AssertionError(f"gpukv admitted {[e.request.request_id for e in left]} in a batched run that "
                                 "vLLM's waiting loop did not reach")

    def start(self, request: Any, waiting_run: tuple) -> None:
        """Admit the run (a ``WaitingRun``, whose head vLLM looks up now) as
        one gpukv step, with the running loop's pending calls
        (``PendingGrowth.flush``)."""
        self.started = True
        run, token_budget, self.lookahead, chunk = WaitingRun(*waiting_run)
        if not run or run[0] is not request:
            return
        a = self._adapter
        boundaries: list[int] = []
        new = [a.gpukv_request(r, token_ids(r), chunk if chunk is not None and chunk < r.num_tokens else None,
                               self.lookahead) for r in run]
        result = a.pending.flush(new=new, token_budget=token_budget, admitting=run, boundaries=boundaries)
        self.num_runs += 1
        self.num_admitted += result.num_admitted
        self.num_chunked += sum(1 for i in range(result.num_admitted)
                                if result.num_computed_tokens[i] + result.num_new_tokens[i] < run[i].num_tokens)
        ids, hits, full = result.admitted_block_ids, result.num_computed_tokens, result.full_attention_hit_tokens
        leads = full is not None and a.groups.full_attention_leads  # (the boundaries are the full-attention hits')
        for i in range(result.num_admitted):
            boundary = boundaries[i] if boundaries else a.run_boundary(run[i], hits[i], full[i]) if leads else 0
            self.entries.append(self._admission(run[i], hits[i], None if ids is None else [group[i] for group in ids],
                                                result.num_new_tokens[i], boundary))

    def _admission(self, request: Any, hit: int, block_ids: list[list[int]] | None, num_new_tokens: int,
                   boundary: int) -> RunEntry:
        a = self._adapter
        num_hit = hit // a.block_size
        if block_ids is None:  # (the ids stay on the device: vLLM's output carries none, ``ids_on_device``)
            computed = ComputedBlocks([[] for _ in range(a.num_kv_cache_groups)], hit)
            # (a hit's blocks are an instance of their own: vLLM hands them back to allocate_slots)
            hit_blocks = a.blocks_class(tuple([] for _ in range(a.num_kv_cache_groups))) if hit \
                else a.empty_kv_cache_blocks
            return RunEntry(request, computed, hit_blocks, a.empty_kv_cache_blocks, None, num_new_tokens,
                            boundary=boundary)
        hit_ids = [ids[:num_hit] for ids in block_ids]
        computed = ComputedBlocks(hit_ids, hit)
        hit_blocks = a.id_blocks(tuple(hit_ids), request, num_hit)
        new_blocks = a.new_kv_cache_blocks([ids[num_hit:] for ids in block_ids])
        return RunEntry(request, computed, hit_blocks, new_blocks, block_ids, num_new_tokens, boundary=boundary)

    def lookup(self, request: Any) -> RunEntry | None:
        """The run's answer to ``get_computed_blocks(request)`` (the run is
        made at the step's first lookup, from the adapter's ``waiting_run``),
        or None when there is none or it is over (the per-request path
        answers)."""
        a = self._adapter
        if not self.started and a.waiting_run is not None:
            self.start(request, a.waiting_run(a.num_scheduled_tokens))
        if self.cursor == len(self.entries):
            return None
        entry = self.entries[self.cursor]
        if entry.request is not request or entry.looked_up:
            raise AssertionError(f"vLLM looked up {request.request_id!r} where gpukv's batched run admitted "
                                 f"{entry.request.request_id!r} next")
        entry.looked_up = True
        return entry

    def allocate(self, request: Any, num_new_tokens: int, num_new_computed_tokens: int, blocks: Any,
                 num_lookahead_tokens: int) -> RunEntry | None:
        """The run's answer to ``allocate_slots`` for the request it looked up
        last, checked against what the step did; None when the run is over."""
        if self.cursor == len(self.entries) or self.entries[self.cursor].request is not request:
            return None
        entry = self.entries[self.cursor]
        expected = (entry.num_new_tokens, entry.computed.num_tokens, self.lookahead)
        if not entry.looked_up or blocks is not entry.hit_blocks and entry.computed.num_tokens or (
                num_new_tokens, num_new_computed_tokens, num_lookahead_tokens) != expected:
            raise AssertionError(f"vLLM allocates for {request.request_id!r} (new {num_new_tokens}, computed "
                                 f"{num_new_computed_tokens}, lookahead {num_lookahead_tokens}) not as gpukv's "
                                 f"batched run admitted it {expected}")
        self.cursor += 1
        return entry
