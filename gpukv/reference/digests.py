"""The reference's request state and block digests.

A request's digests are always computed by the manager, from its own tokens
and extra keys (``gpukv.core.hashing``, one chain-hashing driver): what a caller
hands in as ``block_hashes`` decides nothing (``docs/design.md``). Digests a
request hashed are remembered when it may come back (refused this step,
looked up by ``get_computed_blocks``, freed to be resumed) and reused only
for the same id, extra keys and leading tokens, so they are exactly what
hashing again would give; LRU, bounded in digests.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from gpukv.core import hashing
from gpukv.core.checks import token_array_for_host
from gpukv.core.requests import NewRequest


@dataclass(frozen=True)
class CachedBlockInfo:
    """What a cached block was computed from: enough to verify a hit exactly."""

    digest: bytes
    group: int
    parent: bytes
    tokens: bytes  # the block's token ids as little-endian uint32, as hashed
    extra: bytes


@dataclass
class RequestState:
    """A request as the reference holds it: its tokens and extra keys, its
    digests (and extra-key digests) so far, its blocks per group, and how
    far each group has cached them."""

    request_id: str
    tokens: np.ndarray | list[int]  # an array until the first append, then a list
    lora_id: int | None
    mm_items: tuple
    cache_salt: str | None
    skip_prefix_cache: bool
    block_hashes: list[bytes] = field(default_factory=list)
    extras: list[bytes] = field(default_factory=list)
    num_computed_tokens: int = 0
    blocks: list[list[int]] = field(default_factory=list)
    # per group: blocks at positions below this are cached (or null)
    num_cached_blocks: list[int] = field(default_factory=list)
    row: int = -1  # gpukv.device.rows: set at admission
    # the admission's chunk (tokens beyond the hit; None: every token) and lookahead slots
    chunk: int | None = None
    lookahead: int = 0
    preempted: bool = False  # a re-admission after a preemption (stats count it apart)

    @property
    def has_extra_keys(self) -> bool:
        return self.lora_id is not None or bool(self.mm_items) or self.cache_salt is not None


class Digests:
    """The block digests of a manager's requests under ``key`` (the module
    docstring), with the memo of those that may come back (at most
    ``memo_limit`` digests, least recently remembered dropped first)."""

    def __init__(self, key: bytes, block_size: int, num_groups: int, memo_limit: int) -> None:
        self._key = key
        self.block_size = block_size
        self.num_groups = num_groups
        self.root = hashing.root_digest(key)
        self._memo: OrderedDict[str, tuple] = OrderedDict()
        self._memo_digests = 0
        self._memo_limit = memo_limit

    def new_state(self, r: NewRequest) -> RequestState:
        """A normalised new request's state, its digests recalled when it
        hashed the same id, extra keys and tokens before."""
        st = RequestState(
            request_id=r.request_id,
            tokens=token_array_for_host(r.token_ids),  # type: ignore[arg-type]  # normalised: an array or tensor
            lora_id=r.lora_id,
            mm_items=r.mm_items,
            cache_salt=r.cache_salt,
            skip_prefix_cache=r.skip_prefix_cache,
            chunk=r.num_tokens_to_compute,
            lookahead=r.num_lookahead_tokens,
            preempted=r.num_preemptions > 0,
            blocks=[[] for _ in range(self.num_groups)],
            num_cached_blocks=[0] * self.num_groups,
        )
        self._recall(st)
        return st

    def remember(self, st: RequestState) -> None:
        """Keep the request's digests for when it comes back."""
        if not st.block_hashes:
            return
        old = self._memo.pop(st.request_id, None)
        if old is not None:
            self._memo_digests -= len(old[2])
        n = len(st.block_hashes)
        tokens = np.asarray(st.tokens[: n * self.block_size], dtype=np.int64)
        self._memo[st.request_id] = (tokens, (st.lora_id, st.mm_items, st.cache_salt), list(st.block_hashes),
                                     list(st.extras[:n]))
        self._memo_digests += n
        while self._memo_digests > self._memo_limit and len(self._memo) > 1:
            _, (_, _, digests, _) = self._memo.popitem(last=False)
            self._memo_digests -= len(digests)

    def _recall(self, st: RequestState) -> None:
        entry = self._memo.pop(st.request_id, None)
        if entry is None:
            return
        tokens, extra_keys, digests, extras = entry
        self._memo_digests -= len(digests)
        if (extra_keys == (st.lora_id, st.mm_items, st.cache_salt) and len(st.tokens) >= len(tokens)
                and np.array_equal(st.tokens[: len(tokens)], tokens)):
            st.block_hashes, st.extras = digests, extras

    def _extras(self, st: RequestState, first: int, count: int) -> list[bytes]:
        if not st.has_extra_keys:
            return [hashing.NO_EXTRA] * count
        return hashing.extra_key_digests(
            self._key, count, self.block_size,
            lora_id=st.lora_id, mm_items=st.mm_items, cache_salt=st.cache_salt, first_block=first,
        )

    def extend(self, states: list[RequestState]) -> None:
        """Hash every full block not hashed yet, all requests at once
        (``gpukv.core.hashing.extend_chains``)."""
        bs = self.block_size
        work = []
        for st in states:
            start, stop = len(st.block_hashes), len(st.tokens) // bs
            if stop > start:
                st.extras.extend(self._extras(st, start, stop - start))
                work.append((st, start, stop))
        if not work:
            return
        chains = hashing.extend_chains(
            self._key, [st.block_hashes[-1] if st.block_hashes else self.root for st, _, _ in work],
            [np.asarray(st.tokens[s * bs:e * bs], dtype=np.int64) for st, s, e in work], bs,
            [st.extras[s:e] for st, s, e in work])
        for (st, _, _), digests in zip(work, chains, strict=True):
            st.block_hashes.extend(digests)

    def token_bytes(self, st: RequestState, i: int) -> bytes:
        """Block ``i``'s token ids as little-endian uint32, as hashed."""
        bs = self.block_size
        return np.asarray(st.tokens[i * bs:(i + 1) * bs], dtype="<u4").tobytes()

    def parent(self, st: RequestState, i: int) -> bytes:
        """The digest block ``i`` chains from (the root for the first)."""
        return st.block_hashes[i - 1] if i > 0 else self.root
