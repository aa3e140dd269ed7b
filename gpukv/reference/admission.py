"""The reference's admission: a step's new requests (phases 3-5), one at a
time, as vLLM's waiting loop takes them.

A request's lookup depends only on the requests before it: its hit is its
longest run of leading cached blocks every group's policy accepts
(``gpukv.core.windows``), against the cache and against the blocks earlier
admitted requests of the step will compute and cache (a pending hit). It is
admitted when its new blocks and the free cached blocks it is the first to
touch fit, and computes ``new_tokens_at_admission`` tokens past its hit.
Admission defers (another round) where vLLM's pops of the earlier admitted
requests would evict a free cached block the next request hits.

With both full-attention and sliding-window groups, each lookup also
reports its full-attention hit: the longest prefix the full-attention groups
alone could serve, against the same cache and pending blocks. Where it
passes the hit, its blocks past the hit are not the request's to touch, yet
the earlier requests' pops may evict one: vLLM's lookup, made after those
pops, may then find another copy of the block, or none, so the request is
deferred as for a hit's block, and looked up again with the pops done.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import cast

from gpukv.core.blocks import blocks_after_admission, new_tokens_at_admission
from gpukv.core.checks import stale_computed_blocks
from gpukv.core.requests import ComputedBlocks, NewRequest, StepResult
from gpukv.core.windows import is_hybrid
from gpukv.errors import InvalidInputError
from gpukv.reference.digests import RequestState
from gpukv.reference.pool import NULL_BLOCK
from gpukv.reference.running import ReferenceRunning
from gpukv.reference.state import ReferenceState


class PopReach:
    """The blocks a step's admitted requests pop, in vLLM's order: the front
    of the free queue, passing over the blocks an admitted request touched
    (vLLM takes those out before the next pops). Walked lazily, only as far
    as a request with a free cached hit needs."""

    def __init__(self, queue: Iterator[int], touched: set[int]) -> None:
        self._queue, self._touched = queue, touched
        self._popped: set[int] = set()

    def any_of(self, blocks: set[int], num_popped: int) -> bool:
        """Whether the first ``num_popped`` pops take any of ``blocks``."""
        while len(self._popped) < num_popped:
            b = next(self._queue)  # (the admitted requests fit: the queue holds their pops)
            if b not in self._touched:
                self._popped.add(b)
        return not self._popped.isdisjoint(blocks)


class Available(Sequence):
    """Whether each of the first ``n`` positions has a block, asked of
    ``there(i)`` only when a policy reads position ``i``."""

    def __init__(self, there: Callable[[int], bool], n: int) -> None:
        self._there, self._n = there, n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):  # (a policy reads positions, never slices)
        if not 0 <= i < self._n:
            raise IndexError(i)
        return self._there(i)


@dataclass
class AdmissionPlan:
    """A new request's admission plan within one step."""

    state: RequestState
    num_hit_blocks: int
    # per group, per hit position: a block id, or (plan index, position) for a
    # block an earlier new request of this step will compute and cache.
    hits: Sequence[Sequence[int | tuple[int, int]]]
    num_new_blocks: int
    num_computed_tokens: int  # the hit plus the tokens it computes this step
    # the full-attention groups' own hit (blocks, >= num_hit_blocks), and per position past the hit each of
    # those groups' blocks there (a block id, or a pending (plan index, position)): ``plan_round`` defers the
    # request where the earlier requests' pops take one
    full_attention_hit: int = 0
    full_attention_blocks: Sequence[Sequence[int | tuple[int, int]]] = ()


class ReferenceAdmission:
    """The admission of one reference manager: on its shared ``state`` (the
    pool, digests, rows, requests, stats and policies); ``running`` caches
    the blocks an admitted request fills, as it does a running request's."""

    def __init__(self, state: ReferenceState, running: ReferenceRunning) -> None:
        self._s = state
        self._running = running
        self._hybrid = is_hybrid([policy.window for policy in state.policies])

    # -------------------------------------------------------------- a step
    def admit_new(self, new, token_budget: int | None) -> StepResult:
        """Phases 3-5 for the step's new requests, a round per deferral."""
        s = self._s
        bs = s.block_size
        # Each request is hashed when its lookup comes (in ``plan``), so the
        # requests after the first refused one are not hashed at all.
        states = [s.digests.new_state(r) for r in new]
        plans: list[AdmissionPlan] = []
        refused_hit: int | None = None
        while True:  # a round per deferral (``plan_round``): vLLM's order exactly
            budget_left = None if token_budget is None else token_budget - sum(
                p.num_computed_tokens - p.num_hit_blocks * bs for p in plans)
            admitted, deferred, refused_hit = self.plan_round(states[len(plans):], budget_left)
            self.admit(admitted)
            plans += admitted
            if not deferred:
                break
        for st in states[len(plans):]:
            s.digests.remember(st)
        hit_tokens = [p.num_hit_blocks * bs for p in plans]
        return StepResult(
            num_admitted=len(plans),
            num_computed_tokens=hit_tokens,
            rows=[p.state.row for p in plans],
            num_new_tokens=[p.num_computed_tokens - h for p, h in zip(plans, hit_tokens, strict=True)],
            refused_hit_tokens=refused_hit,
            full_attention_hit_tokens=[p.full_attention_hit * bs for p in plans] if self._hybrid and plans else None,
        )

    def plan_round(self, states: list[RequestState],
                   token_budget: int | None = None) -> tuple[list[AdmissionPlan], bool, int | None]:
        """Phases 3 and 4, interleaved: looking up stops at the first refused
        request, or before the first one the budget has nothing left for
        (vLLM's ``while token_budget > 0``). Returns the admitted requests'
        plans (a prefix of ``states``); whether it stopped before a request to
        look it up again once these are admitted (deferred: vLLM pops the
        earlier requests' blocks before it looks the next one up, and those
        pops evict a free cached block this one hits, or one of its
        full-attention blocks past its hit); and the hit, in
        tokens, of the request it looked up and refused (None: none was)."""
        pool, bs = self._s.pool, self._s.block_size
        num_free = pool.num_free_blocks
        plans: list[AdmissionPlan] = []
        used = new_blocks = 0
        budget_left = token_budget
        touched: set[int] = set()
        evicted = PopReach(pool.free_blocks_in_order(), touched)
        for state in states:
            if budget_left is not None and budget_left <= 0:
                break
            plan = self.plan(state, plans, budget_left)
            first_touch = {b for g in plan.hits for b in g
                           if isinstance(b, int) and b != NULL_BLOCK and pool.ref_cnt[b] == 0 and b not in touched}
            past_hit = {b for blocks in plan.full_attention_blocks for b in blocks
                        if isinstance(b, int) and pool.ref_cnt[b] == 0 and b not in touched}
            if (first_touch or past_hit) and evicted.any_of(first_touch | past_hit, new_blocks):
                return plans, True, None
            self.count_lookup(plan)
            need = plan.num_new_blocks + len(first_touch)
            if used + need > num_free:
                return plans, False, plan.num_hit_blocks * bs
            plans.append(plan)
            used += need
            new_blocks += plan.num_new_blocks
            touched |= first_touch
            if budget_left is not None:
                budget_left -= plan.num_computed_tokens - plan.num_hit_blocks * bs
        return plans, False, None

    # ------------------------------------------------------------- lookups
    def lookup(self, request: NewRequest) -> ComputedBlocks:
        """``get_computed_blocks``: the request's hit now (its digests
        remembered, the lookup counted in the stats)."""
        s = self._s
        plan = self.plan(s.digests.new_state(request), [])
        s.digests.remember(plan.state)
        self.count_lookup(plan)
        # No earlier plan in this call: every hit is a block id, none a pending (plan, position).
        return ComputedBlocks(cast("list[list[int]]", [[b for b in g] for g in plan.hits]),
                              plan.num_hit_blocks * s.block_size, self._full_attention_tokens(plan))

    def peek(self, request: NewRequest) -> ComputedBlocks:
        """The request's hit now, changing nothing (no digest remembered,
        nothing counted)."""
        s = self._s
        plan = self.plan(s.digests.new_state(request), [])
        return ComputedBlocks(cast("list[list[int]]", [list(g) for g in plan.hits]),
                              plan.num_hit_blocks * s.block_size, self._full_attention_tokens(plan))

    def _full_attention_tokens(self, plan: AdmissionPlan) -> int | None:
        """A lookup's full-attention hit in tokens (None without both kinds of group)."""
        return plan.full_attention_hit * self._s.block_size if self._hybrid else None

    def plan(self, st: RequestState, plans: list[AdmissionPlan], budget_left: int | None = None) -> AdmissionPlan:
        """Find the request's hit, against the cache and against the blocks the
        earlier ``plans`` of this step will compute and cache; it computes
        ``new_tokens_at_admission`` tokens past it (``budget_left``: what the
        step's token budget has left, None for no budget)."""
        s = self._s
        s.digests.extend([st])
        block_at = self._block_finder(st, plans)
        if st.skip_prefix_cache or not s.enable_caching:
            hit = 0  # (nothing looked up: its full-attention hit is 0 too)
        else:
            hit = (len(st.tokens) - 1) // s.block_size
            while True:
                new_hit = hit
                for g, policy in enumerate(s.policies):
                    # (read lazily: full attention stops at its first miss)
                    new_hit = policy.hit(Available(functools.partial(lambda i, g: block_at(i, g) is not None, g=g),
                                                   new_hit))
                if new_hit == hit:
                    break
                hit = new_hit
        hits = []
        for g, policy in enumerate(s.policies):
            first_real = policy.first_real(hit)
            hits.append([NULL_BLOCK if i < first_real else block_at(i, g) for i in range(hit)])
        plan = self.plan_for_hit(st, hit, hits, budget_left)
        plan.full_attention_hit = hit
        if not st.skip_prefix_cache and s.enable_caching:
            self._find_full_attention_hit(plan, block_at)
        return plan

    def _find_full_attention_hit(self, plan: AdmissionPlan, block_at) -> None:
        """A hybrid model's lookup: ``plan``'s full-attention groups' own
        hit, and their blocks past its hit (nothing to find with one kind of
        group only: the hit is theirs)."""
        s = self._s
        if not self._hybrid:
            return
        full = [g for g, policy in enumerate(s.policies) if policy.window is None]
        longest = (len(plan.state.tokens) - 1) // s.block_size
        for g in full:
            longest = s.policies[g].hit(Available(functools.partial(lambda i, g: block_at(i, g) is not None, g=g),
                                                  longest))
        plan.full_attention_hit = longest
        plan.full_attention_blocks = [[block_at(i, g) for g in full] for i in range(plan.num_hit_blocks, longest)]

    def _block_finder(self, st: RequestState, plans: list[AdmissionPlan]):
        """``block_at(i, g)``: the verified cached block (or pending hit) of
        ``st`` at position ``i`` of group ``g``, None for none; each probed once."""
        s = self._s
        pool, digests = s.pool, s.digests
        probe: dict = {}

        def block_at(i: int, g: int):
            if (i, g) not in probe:
                found = None
                if s.enable_caching:
                    found = pool.lookup(st.block_hashes[i], g)
                    if found is not None and not pool.verify(found, digests.parent(st, i),
                                                             digests.token_bytes(st, i), st.extras[i]):
                        found = None
                    if found is None:
                        found = self.pending_hit(st, i, plans)
                probe[(i, g)] = found
            return probe[(i, g)]

        return block_at

    def plan_for_hit(self, st: RequestState, hit: int, hits, budget_left: int | None = None) -> AdmissionPlan:
        """The plan of admitting ``st`` with a hit of ``hit`` blocks (``hits``: per group, the blocks)."""
        bs, G = self._s.block_size, self._s.num_groups
        new = new_tokens_at_admission(hit, len(st.tokens), st.chunk, bs, budget_left)
        n_alloc = blocks_after_admission(hit, len(st.tokens), st.chunk, st.lookahead, bs, budget_left)
        return AdmissionPlan(st, hit, hits, (n_alloc - hit) * G, hit * bs + new)

    def pending_hit(self, st: RequestState, i: int, plans: list[AdmissionPlan]):
        """(plan index, i) for the first earlier request of the step that
        computes a block with our digest at position ``i`` (one that did not
        hit it: a window group may hit a position with the null block, so an
        earlier request sharing the block need not hold it; and whose chunk
        reaches past the block, so it caches it), if that block verifies
        against ours; else None. As in vLLM, where each admission caches its
        full computed blocks before the next request is looked up."""
        digests = self._s.digests
        digest = st.block_hashes[i]
        bs = self._s.block_size
        for j, plan in enumerate(plans):
            other = plan.state
            if (i < len(other.block_hashes) and other.block_hashes[i] == digest and plan.num_hit_blocks <= i
                    and i < plan.num_computed_tokens // bs):
                if (digests.token_bytes(other, i) != digests.token_bytes(st, i) or other.extras[i] != st.extras[i]
                        or digests.parent(other, i) != digests.parent(st, i)):
                    return None
                return (j, i)
        return None

    def count_lookup(self, plan: AdmissionPlan) -> None:
        """The stats of one request's lookup (as the device's ``count_lookups``)."""
        s = self._s
        st = plan.state
        if st.skip_prefix_cache:
            s.stats.record(num_tokens=0, num_hit_tokens=0, num_blocks=0, num_hit_blocks=0, preempted=st.preempted)
            return
        n_tok = len(st.tokens)
        s.stats.record(num_tokens=n_tok, num_hit_tokens=plan.num_hit_blocks * s.block_size,
                       num_blocks=-(-n_tok // s.block_size), num_hit_blocks=plan.num_hit_blocks,
                       preempted=st.preempted)

    # ------------------------------------------------------------ changing
    def admit(self, plans: list[AdmissionPlan]) -> None:
        """Phase 5: touch every admitted request's hits, then each in order
        takes its blocks (a pending hit the block an earlier one just got)
        and a row, then the blocks that will be full are cached."""
        s = self._s
        pool, G = s.pool, s.num_groups
        for plan in plans:
            pool.touch(b for g in plan.hits for b in g if isinstance(b, int))
        for plan in plans:
            st = plan.state
            for g in range(G):
                resolved = []
                for b in plan.hits[g]:
                    if isinstance(b, tuple):
                        j, pos = b
                        b = plans[j].state.blocks[g][pos]
                        pool.touch([b])
                    resolved.append(b)
                st.blocks[g] = resolved
                st.num_cached_blocks[g] = plan.num_hit_blocks
            for g in range(G):
                st.blocks[g].extend(pool.allocate(plan.num_new_blocks // G))
            st.num_computed_tokens = plan.num_computed_tokens
            s.rows.take(st)
            s.requests[st.request_id] = st
        for plan in plans:
            self._running.cache_full_blocks(plan.state)

    # ----------------------------------------------------- allocate_slots
    def check_computed(self, state: RequestState, hits, num_hit: int) -> None:
        """The computed blocks a caller hands back are this request's own
        cached hit (its groups, its digests), else refused."""
        s = self._s
        if len(hits) != s.num_groups or any(len(g) != num_hit for g in hits):
            raise InvalidInputError("the computed blocks do not match this manager's groups", argument="computed",
                                    fix="pass what get_computed_blocks returned for this request")
        s.digests.extend([state])  # incremental: a recalled shorter list is completed
        for g, blocks in enumerate(hits):
            for i, b in enumerate(blocks):
                if b == NULL_BLOCK:
                    continue
                info = s.pool.cached_info(b)
                if info is None or info.digest != state.block_hashes[i] or info.group != g:
                    raise stale_computed_blocks()

    def admit_with_hit(self, state: RequestState, hits, num_hit: int) -> list[list[int]] | None:
        """A checked new request admitted with its given hit, if its new
        blocks and first touches fit: its new blocks per group, or None."""
        s = self._s
        plan = self.plan_for_hit(state, num_hit, hits)
        need = plan.num_new_blocks + len({b for g in hits for b in g if b != NULL_BLOCK and s.pool.ref_cnt[b] == 0})
        if need > s.pool.num_free_blocks:
            s.digests.remember(state)
            return None
        before = [len(g) for g in hits]
        self.admit([plan])
        return [state.blocks[g][before[g]:] for g in range(s.num_groups)]
