"""The reference's running requests (phase 2, and the batched ``decode``):
each, in order, appends its tokens and gets the blocks for the tokens it
computes and its lookahead slots; the first whose blocks do not fit stops
the phase, it and the later ones unchanged. Then the blocks they filled are
hashed (all requests at once) and cached, request by request."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from gpukv.core.checks import token_array_for_host
from gpukv.core.running_batch import RunningRows
from gpukv.events.schema import BlockStored
from gpukv.reference.digests import CachedBlockInfo, RequestState
from gpukv.reference.pool import NULL_BLOCK
from gpukv.reference.state import ReferenceState


class ReferenceRunning:
    """The running requests of one reference manager, on its shared
    ``state`` (the pool, digests, rows, requests and event log)."""

    def __init__(self, state: ReferenceState) -> None:
        self._s = state

    def work(self, running) -> tuple[list[RequestState], tuple[list, list, Any]]:
        """The running requests' states and, per request, its new tokens (a
        list), its chunk (None: all) and its lookahead slots, from
        ``RunningUpdate``s or a normalised ``RunningBatch``."""
        s = self._s
        if isinstance(running, RunningRows):
            states = s.rows.state[running.rows].tolist()
            tokens = running.tokens.tolist()
            if running.counts is not None:
                tokens = [t[:c] for t, c in zip(tokens, running.counts.tolist(), strict=True)]
            chunks = [None] * len(states) if running.chunks is None else running.chunks.tolist()
            la = running.lookahead
            return states, (tokens, chunks, [la] * len(states) if isinstance(la, int) else la.tolist())
        requests = s.requests
        states = [requests[u.request_id] for u in running]
        tokens = []
        for u in running:
            t: Any = u.new_token_ids  # normalised (gpukv.core.checks): an int64 array or a tensor
            tokens.append((t if type(t) is np.ndarray else token_array_for_host(t)).tolist())
        return states, (tokens, [u.num_tokens_to_compute for u in running], [u.num_lookahead_tokens for u in running])

    def run_all(self, states: Sequence[RequestState], tokens: Sequence[list], chunks: Sequence[int | None],
                lookaheads: Sequence[int], filled: list[RequestState] | None = None) -> int | None:
        """Each running request in order (``states``) appends its ``tokens``
        and gets blocks for the tokens it computes (``chunks``: None for all)
        and its lookahead slots: the index of the first whose blocks do not
        fit, it and the later ones left unchanged, or None when all fit.
        ``filled`` gets the requests a block of whose filled up (known or
        computed): the only ones with anything to hash or cache."""
        s = self._s
        bs = s.block_size
        pool = s.pool
        num_free = pool.num_free_blocks  # less what each request below allocates (allocate pops the free queue)
        row_tokens, row_computed = s.rows.num_tokens, s.rows.num_computed
        for k, (st, new_tokens, chunk, lookahead) in enumerate(zip(states, tokens, chunks, lookaheads, strict=True)):
            known = st.tokens
            num_before, computed_before = len(known), st.num_computed_tokens
            num_tokens = num_before + len(new_tokens)
            computed = num_tokens if chunk is None else computed_before + chunk
            # Lookahead blocks from earlier steps are kept: a group never shrinks here.
            n_total = max(-(-(computed + lookahead) // bs), len(st.blocks[0]))
            need = 0
            for blocks in st.blocks:
                need += n_total - len(blocks)
            if need > num_free:
                return k
            if isinstance(known, np.ndarray):  # a list from the first append on
                known = st.tokens = known.tolist()
            known.extend(new_tokens)
            for blocks in st.blocks:
                n = n_total - len(blocks)
                if n:  # allocating none changes nothing
                    blocks.extend(pool.allocate(n))
            num_free -= need
            st.num_computed_tokens = computed
            row_tokens[st.row], row_computed[st.row] = num_tokens, computed
            if filled is not None and (num_tokens // bs > num_before // bs or computed // bs > computed_before // bs):
                filled.append(st)
        return None

    def cache_running(self, states: list[RequestState]) -> None:
        """Cache the blocks running requests filled, request by request; the
        hashing is done first for all of them at once (it reads no pool state,
        so doing it early changes nothing)."""
        self._s.digests.extend(states)
        bs = self._s.block_size
        for st in states:
            # Every full block is hashed now, so only a group that has not
            # cached all of them gives ``cache_full_blocks`` anything to do.
            num_full = st.num_computed_tokens // bs
            for cached in st.num_cached_blocks:
                if cached < num_full:
                    self.cache_full_blocks(st)
                    break

    def cache_full_blocks(self, st: RequestState) -> None:
        """Cache the request's full computed blocks not cached yet, group by
        group (a stored-block event each, with events on)."""
        s = self._s
        if not s.enable_caching:
            return
        bs = s.block_size
        num_full = st.num_computed_tokens // bs
        if len(st.tokens) // bs <= len(st.block_hashes):  # nothing left to hash
            for cached in st.num_cached_blocks:
                if cached < num_full:
                    break
            else:  # and every group has cached its full blocks already
                return
        s.digests.extend([st])
        for g in range(s.num_groups):
            for i in range(st.num_cached_blocks[g], num_full):
                self._cache_one(st, g, i)
            st.num_cached_blocks[g] = max(st.num_cached_blocks[g], num_full)

    def _cache_one(self, st: RequestState, g: int, i: int) -> None:
        s = self._s
        b = st.blocks[g][i]
        if b == NULL_BLOCK or s.pool.cached_info(b) is not None:
            return
        digests, bs = s.digests, s.block_size
        s.pool.cache(b, CachedBlockInfo(st.block_hashes[i], g, digests.parent(st, i), digests.token_bytes(st, i),
                                        st.extras[i]))
        if s.event_log is not None:
            s.event_log.append(BlockStored([st.block_hashes[i]], st.block_hashes[i - 1] if i else None,
                                            [int(t) for t in st.tokens[i * bs:(i + 1) * bs]], bs, st.lora_id, g))
