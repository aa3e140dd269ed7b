"""The sequential reference block manager: the executable spec of gpukv.

Plain Python, one request at a time, written to be read. The device pool
(``gpukv.pool`` / ``gpukv.manager``) must produce exactly what this module
produces: the same block ids, hits, reference counts, free-queue order, table
contents and stats, after every step.

Semantics (``docs/design.md`` says why each rule is what it is):

* Block 0 is the null block: never allocated, never freed, its reference count
  not kept. Sliding-window groups put it where their window no longer reaches.
* The free queue starts as ``1..N-1``. Allocation pops from the front; a popped
  block that still has a hash is evicted then (lazy eviction).
* Freeing gives a request's blocks back tail first. A block whose count drops to
  0 goes to the back if it is cached and to the front if not; the blocks one free
  call sends to the front keep their relative order there. With
  ``uncached_first=False`` every block goes to the back.
* A hit on a free block takes it out of the middle of the queue; every hit adds
  one reference.
* A hash maps to every block cached under it, oldest first; a lookup returns
  the oldest, and a hit is verified: the stored parent digest, tokens and
  extra-key digest must equal the request's.
* A request hits its longest run of leading full cached blocks, never its last
  token.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch

from gpukv import hashing
from gpukv.api import manager_args_from_config
from gpukv.errors import (
    InvalidInputError,
    InvalidTypeError,
    NoFreeBlocksError,
)
from gpukv.events import AllBlocksCleared, BlockRemoved, BlockStored, EventQueue, KVEventBatch
from gpukv.failstop import FailStop, mutating, reading
from gpukv.metrics import PrefixCacheStats, StepCounters
from gpukv.request import (
    MAX_MODEL_LEN,
    MAX_NUM_BLOCKS,
    MAX_NUM_REQS,
    ComputedBlocks,
    ManagerLimits,
    NewRequest,
    RunningUpdate,
    Step,
    StepOutputs,
    StepResult,
    apply_allocate_args,
    blocks_after_admission,
    check_block_spans,
    check_computed_for,
    check_count,
    check_group,
    check_memory,
    check_request_ids,
    check_size,
    check_step_outputs,
    check_token_budget,
    common_prefix_length,
    new_tokens_at_admission,
    normalize_computed,
    normalize_step,
    normalize_token_ids,
    normalize_windows,
    request_id_type_error,
    resolve_key,
    stale_computed_blocks,
    token_array_for_host,
    unknown_request,
)
from gpukv.rows import RowAllocator
from gpukv.running import RunningBatch, RunningRows, normalize_rows, normalize_running
from gpukv.windows import policies

NULL_BLOCK = 0

__all__ = ["NULL_BLOCK", "BlockPool", "CachedBlockInfo", "ComputedBlocks", "KVCacheManager", "NoFreeBlocksError",
           "ReferenceManager"]

# Host bytes per block of a full reference pool (counts, free-queue links,
# cached-block records and table entries), for the check before allocating.
_HOST_BYTES_PER_BLOCK = 640


@dataclass(frozen=True)
class CachedBlockInfo:
    """What a cached block was computed from: enough to verify a hit exactly."""

    digest: bytes
    group: int
    parent: bytes
    tokens: bytes  # the block's token ids as little-endian uint32, as hashed
    extra: bytes


def _host_device(device) -> torch.device:
    """The reference's ``device``: None or the CPU."""
    if device is None:
        return torch.device("cpu")
    try:
        dev = torch.device(device)
    except (TypeError, RuntimeError):
        raise InvalidTypeError(f"must be None, 'cpu' or a torch.device, got {device!r}", argument="device",
                               fix="pass device=None (the reference lives on the host)") from None
    if dev.type != "cpu":
        raise InvalidInputError(f"the reference manager lives on the host, got {dev}", argument="device",
                                fix="pass device=None, or use gpukv.manager.DeviceManager on a GPU")
    return dev


class _PopReach:
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


class BlockPool:
    """Reference counts, the free queue and the block-hash table.

    Invariants (``check_invariants`` asserts them): every block but the null
    block is either in the free queue (count 0) or referenced (count > 0),
    never both; every cached block is in the table exactly once, under its own
    (digest, group); the table holds nothing else.
    """

    def __init__(self, num_blocks: int, *, uncached_first: bool = True, enable_caching: bool = True) -> None:
        self.num_blocks = check_size(num_blocks, "num_blocks", 2, MAX_NUM_BLOCKS)
        check_memory({"num_blocks": self.num_blocks * _HOST_BYTES_PER_BLOCK}, None, "the reference pool")
        self.uncached_first = bool(uncached_first)
        self.enable_caching = bool(enable_caching)
        self.ref_cnt = [0] * self.num_blocks
        # OrderedDict = a doubly linked list with O(1) pop-front, append,
        # prepend and removal from the middle.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, self.num_blocks))
        self._info: list[CachedBlockInfo | None] = [None] * self.num_blocks
        # (digest, group) -> its blocks in insertion order (dict keeps order).
        self._table: dict[tuple[bytes, int], dict[int, None]] = {}
        self.num_evictions = 0
        # called with a block's CachedBlockInfo as it is evicted (KV-cache events)
        self.on_evict: Callable[[CachedBlockInfo], None] | None = None

    # ---------------------------------------------------------------- reading
    @property
    def num_free_blocks(self) -> int:
        """Blocks in the free queue."""
        return len(self._free)

    def free_queue(self) -> list[int]:
        """Block ids of the free queue, front (next to be reused) to back."""
        return list(self._free)

    def free_blocks_in_order(self) -> Iterator[int]:
        """The free queue, front first, lazily (valid until the queue changes)."""
        return iter(self._free)

    def cached_info(self, block_id: int) -> CachedBlockInfo | None:
        return self._info[block_id]

    def table(self) -> dict[tuple[bytes, int], list[int]]:
        """(digest, group) -> cached blocks, oldest first."""
        return {key: list(blocks) for key, blocks in self._table.items()}

    def lookup(self, digest: bytes, group: int) -> int | None:
        """The oldest block cached under (digest, group), or None."""
        blocks = self._table.get((digest, group))
        return next(iter(blocks)) if blocks else None

    def verify(self, block_id: int, parent: bytes, tokens: bytes, extra: bytes) -> bool:
        """Whether a cached block was computed from exactly these inputs. A
        digest match whose parent, tokens or extra digest differ is a miss."""
        info = self._info[block_id]
        assert info is not None, f"block {block_id} is not cached"
        return info.parent == parent and info.extra == extra and info.tokens == tokens

    # --------------------------------------------------------------- changing
    def touch(self, block_ids: Iterable[int]) -> None:
        """Add a reference to each block; a free one leaves the free queue."""
        block_ids = list(block_ids)
        for b in block_ids:
            if b != NULL_BLOCK and self.ref_cnt[b] == 0 and self._info[b] is None:
                raise ValueError(f"touch: block {b} is free and not cached; only cached or referenced blocks can "
                                 "be hit")
        for b in block_ids:
            if b == NULL_BLOCK:
                continue
            if self.ref_cnt[b] == 0:
                del self._free[b]
            self.ref_cnt[b] += 1

    def allocate(self, num_blocks: int) -> list[int]:
        """Pop ``num_blocks`` blocks from the front, each with one reference.

        A popped block that is still cached loses its hash here (lazy eviction).
        """
        num_blocks = check_size(num_blocks, "num_blocks", 0)
        if num_blocks > len(self._free):
            raise NoFreeBlocksError(
                f"cannot allocate {num_blocks} blocks: only {len(self._free)} are free"
            )
        out = []
        for _ in range(num_blocks):
            b, _ = self._free.popitem(last=False)
            if self._info[b] is not None:
                self._evict(b)
            self.ref_cnt[b] = 1
            out.append(b)
        return out

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block, in the order given (callers pass
        a request's blocks tail first). Nothing changes if any block would go
        below zero."""
        block_ids = list(block_ids)
        drops: dict[int, int] = {}
        for b in block_ids:
            if b == NULL_BLOCK:
                continue
            if not 0 < b < self.num_blocks:
                raise ValueError(f"free: block id {b} is outside 1..{self.num_blocks - 1}")
            drops[b] = drops.get(b, 0) + 1
            if drops[b] > self.ref_cnt[b]:
                raise ValueError(f"free: block {b} has {self.ref_cnt[b]} references, cannot drop {drops[b]} "
                                 "(double free?)")
        to_front = []
        for b in block_ids:
            if b == NULL_BLOCK:
                continue
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                if self.uncached_first and self._info[b] is None:
                    to_front.append(b)
                else:
                    self._free[b] = None
        for b in reversed(to_front):
            self._free[b] = None
            self._free.move_to_end(b, last=False)

    def cache(self, block_id: int, info: CachedBlockInfo) -> None:
        """Give a referenced, uncached block its hash; it joins the end of its
        hash's list (a duplicate of an existing hash is kept, as in vLLM)."""
        if self.ref_cnt[block_id] == 0 or self._info[block_id] is not None:
            raise ValueError(f"cache: block {block_id} must be referenced and not cached yet")
        self._info[block_id] = info
        self._table.setdefault((info.digest, info.group), {})[block_id] = None

    def reset_prefix_cache(self) -> bool:
        """Drop every hash, only when every block but the null block is free."""
        if len(self._free) != self.num_blocks - 1:
            return False
        self._table.clear()
        self._info = [None] * self.num_blocks
        return True

    def _evict(self, block_id: int) -> None:
        info = self._info[block_id]
        assert info is not None, f"block {block_id} is not cached"
        key = (info.digest, info.group)
        blocks = self._table[key]
        del blocks[block_id]
        if not blocks:
            del self._table[key]
        self._info[block_id] = None
        self.num_evictions += 1
        if self.on_evict is not None:
            self.on_evict(info)

    # ----------------------------------------------------------------- checks
    def check_invariants(self) -> None:
        assert NULL_BLOCK not in self._free, "the null block is in the free queue"
        for b in range(1, self.num_blocks):
            in_free = b in self._free
            assert self.ref_cnt[b] >= 0, f"block {b} has a negative count"
            assert in_free == (self.ref_cnt[b] == 0), f"block {b}: count {self.ref_cnt[b]}, in free queue: {in_free}"
        seen = 0
        for (digest, group), blocks in self._table.items():
            assert blocks, f"empty table entry for {digest.hex()}"
            for b in blocks:
                info = self._info[b]
                assert info is not None and info.digest == digest and info.group == group, \
                    f"stale table entry -> block {b}"
                seen += 1
        assert seen == sum(info is not None for info in self._info), "a cached block is missing from the table"


# ---------------------------------------------------------------------------
# The request-level manager


@dataclass
class _RequestState:
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
    row: int = -1  # gpukv.rows: set at admission
    # the admission's chunk (tokens beyond the hit; None: every token) and lookahead slots
    chunk: int | None = None
    lookahead: int = 0
    preempted: bool = False  # a re-admission after a preemption (stats count it apart)

    @property
    def has_extra_keys(self) -> bool:
        return self.lora_id is not None or bool(self.mm_items) or self.cache_salt is not None


class _Available(Sequence):
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
class _Plan:
    """A new request's admission plan within one step."""

    state: _RequestState
    num_hit_blocks: int
    # per group, per hit position: a block id, or (plan index, position) for a
    # block an earlier new request of this step will compute and cache.
    hits: Sequence[Sequence[int | tuple[int, int]]]
    num_new_blocks: int
    num_computed_tokens: int  # the hit plus the tokens it computes this step


class ReferenceManager(FailStop):
    """Request-level calls over one shared ``BlockPool``.

    ``sliding_windows`` has one entry per KV-cache group: None for full
    attention, else the window in tokens. All groups share the pool and the
    block size; a request holds one block list per group. A sliding-window
    group keeps only the blocks its window still reaches and the null block
    before them.

    ``max_model_len`` (None: no limit) refuses requests longer than it, as
    the device manager does; every argument of every call is checked by
    ``gpukv.request.normalize_step`` before anything changes.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        sliding_windows: Sequence[int | None] = (None,),
        enable_caching: bool = True,
        uncached_first: bool = True,
        hash_key: bytes | str | None = None,
        max_model_len: int | None = None,
        max_num_reqs: int = 64,
        device: torch.device | str | None = None,
        enable_kv_cache_events: bool = False,
    ) -> None:
        """Arguments as the device manager's (``gpukv.manager``); ``device``
        is where ``block_table_for`` puts its tensor: None or the CPU (this
        manager's state is host memory). ``enable_kv_cache_events``: keep
        ``gpukv.events`` batches for ``take_events``."""
        self.device = _host_device(device)
        self.block_size = check_size(block_size, "block_size", 1)
        max_num_reqs = check_size(max_num_reqs, "max_num_reqs", 1, MAX_NUM_REQS)
        windows = list(normalize_windows(sliding_windows))
        num_blocks = check_size(num_blocks, "num_blocks", 2, MAX_NUM_BLOCKS)
        if max_model_len is not None:
            max_model_len = check_size(max_model_len, "max_model_len", 1, MAX_MODEL_LEN)
        self.max_model_len = max_model_len
        self.sliding_windows = windows
        self.num_groups = len(windows)
        self._policies = policies(windows, self.block_size)  # one per group (``gpukv.windows``)
        self.enable_caching = bool(enable_caching)
        self._key = resolve_key(hash_key)
        self.pool = BlockPool(num_blocks, uncached_first=uncached_first, enable_caching=enable_caching)
        # KV-cache events of the call under way (None: not kept), and the batches made.
        self._event_log: list | None = [] if enable_kv_cache_events else None
        self._event_queue = EventQueue()
        if enable_kv_cache_events:
            def log_eviction(info: CachedBlockInfo) -> None:
                assert self._event_log is not None  # kept: take_events only swaps the list
                self._event_log.append(BlockRemoved([info.digest], info.group))

            self.pool.on_evict = log_eviction
        self._limits = ManagerLimits(self.block_size, num_blocks, tuple(windows), max_model_len, self.enable_caching)
        self._root = hashing.root_digest(self._key)
        self._requests: dict[str, _RequestState] = {}
        self._rows = RowAllocator(max_num_reqs, on_grow=self._grow_rows)  # handed out as the device manager does
        self._row_ids: dict[int, str] = {}
        # Per row (as the device manager mirrors them): the request's state,
        # its known and its computed tokens, so a batch addressed by rows is
        # read with numpy (each count written where the request's changes).
        self._row_state = np.empty(self._rows.capacity, dtype=object)
        self._row_tokens = np.zeros(self._rows.capacity, dtype=np.int64)
        self._row_computed = np.zeros(self._rows.capacity, dtype=np.int64)
        self.stats = PrefixCacheStats()
        # The device manager's per-step accounting, for the same API: always zero
        # here (no launches, uploads or device reads).
        self.counters = StepCounters()
        # Digests this manager computed for requests that may come back (refused
        # this step, looked up by get_computed_blocks, freed to be resumed):
        # reused only for the same id, extra keys and leading tokens, so they
        # are exactly what hashing again would give. LRU, bounded in digests.
        self._digest_memo: OrderedDict[str, tuple] = OrderedDict()
        self._memo_digests = 0
        self._memo_limit = 2 * num_blocks + 1024

    @classmethod
    def from_config(cls, config, **kwargs) -> ReferenceManager:
        """A manager for a ``KVCacheConfig`` (``gpukv.get_kv_cache_config``):
        one group per config group, ``kwargs`` as the constructor's."""
        num_blocks, block_size, windows = manager_args_from_config(config)
        return cls(num_blocks, block_size, sliding_windows=windows, **kwargs)

    def __repr__(self) -> str:  # never show the key
        return (f"ReferenceManager(num_blocks={self.pool.num_blocks}, block_size={self.block_size}, "
                f"groups={self.sliding_windows})")

    # ------------------------------------------------------------ public API
    @property
    def hash_key(self) -> bytes:
        """The 16-byte key of the block hash (never printed by ``repr``)."""
        return self._key

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool, the null block 0 included."""
        return self.pool.num_blocks

    @property
    def limits(self) -> ManagerLimits:
        """What every call is checked against (block size, pool size, windows,
        ``max_model_len``): ``gpukv.request.min_blocks_to_admit(n, m.limits,
        can_hit)`` is the bound past which a new request is refused up front."""
        return self._limits

    @property
    def num_free_blocks(self) -> int:
        """Free blocks now (``read_num_free_blocks``)."""
        return self.read_num_free_blocks()

    @property
    def num_evictions(self) -> int:
        """Cached blocks evicted so far (``read_num_evictions``)."""
        return self.read_num_evictions()

    @reading
    def free_queue(self) -> list[int]:
        """Free block ids, front (reused first) to back."""
        return self.pool.free_queue()

    @property
    def usage(self) -> float:
        """Fraction of the pool (null block excluded) that is referenced."""
        return self.read_usage()

    @reading
    def read_num_free_blocks(self) -> int:
        """Free blocks now (the device manager's name; nothing to wait for here)."""
        return self.pool.num_free_blocks

    @reading
    def read_num_evictions(self) -> int:
        """Cached blocks evicted so far (the device manager's name)."""
        return self.pool.num_evictions

    @reading
    def read_usage(self) -> float:
        """Fraction of the pool (null block excluded) that is referenced, as
        vLLM's ``KVCacheManager.usage``."""
        return 1.0 - self.pool.num_free_blocks / (self.pool.num_blocks - 1)

    @reading
    def block_table_for(self, request_ids: Sequence[str]) -> torch.Tensor:
        """int32[G, len(request_ids), M] block tables of these requests, as
        the device manager gives them (M = blocks per request at
        ``max_model_len``, or the most any of them holds without a limit;
        positions past a request's blocks hold 0)."""
        states = [self._requests[r] for r in check_request_ids(request_ids, "request_ids", self._requests)]
        if self.max_model_len is not None:
            width = -(-self.max_model_len // self.block_size)
        else:
            width = max([len(st.blocks[0]) for st in states], default=0)
        table = torch.zeros((self.num_groups, len(states), width), dtype=torch.int32)
        for i, st in enumerate(states):
            for g, blocks in enumerate(st.blocks):
                table[g, i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        return table.to(self.device)

    @reading
    def get_num_common_prefix_blocks(self, request_id: str, num_running_requests: int) -> list[int]:
        """Per group, how many leading blocks of this request every one of the
        ``num_running_requests`` running requests holds (vLLM's, for cascade
        attention): blocks whose count equals that number, up to the first
        that does not. A sliding-window group gives 0 (cascade attention
        needs full attention)."""
        st = self._state(request_id)
        count = check_count(num_running_requests, "num_running_requests")
        ref = self.pool.ref_cnt
        return [0 if w is not None else common_prefix_length([ref[b] for b in st.blocks[g]], count)
                for g, w in enumerate(self.sliding_windows)]

    @reading
    def request_ids(self) -> list[str]:
        """The running requests' ids, in admission order."""
        return list(self._requests)

    @reading
    def get_block_ids(self, request_id: str) -> list[list[int]]:
        """The request's block ids per group, position by position."""
        return [list(b) for b in self._state(request_id).blocks]

    @reading
    def num_blocks_held(self, request_id: str) -> int:
        """The block positions the request holds, per group (the null block
        counts where a window dropped one)."""
        return len(self._state(request_id).blocks[0])

    @reading
    def read_block_ids(self, spans: Sequence[tuple[str, int, int]], group: int = 0) -> list[list[int]]:
        """Group ``group``'s block ids of each ``(request_id, start, end)``
        span's request at positions ``[start, end)`` (a serving loop's new
        blocks of a step, for many requests at once)."""
        group = check_group(group, self.num_groups)
        spans = check_block_spans(spans, "spans", self.num_blocks_held)
        return [self._requests[rid].blocks[group][start:end] for rid, start, end in spans]

    @reading
    def row_token_counts(self, rows: Any) -> tuple[np.ndarray, np.ndarray]:
        """The known and the computed tokens of the requests at ``rows``
        (host ints, each a running request's), as int64 arrays."""
        rows_np = normalize_rows(rows, self._rows.in_use, distinct=False)
        return self._row_tokens[rows_np], self._row_computed[rows_np]

    @reading
    def num_computed_tokens(self, request_id: str) -> int:
        """Tokens of the request computed so far, its hit included."""
        return self._state(request_id).num_computed_tokens

    @reading
    def block_hashes(self, request_id: str) -> list[bytes]:
        """Digests of the request's full blocks (to carry over a preemption,
        as vLLM's ``Request.block_hashes`` does)."""
        return list(self._state(request_id).block_hashes)

    @mutating
    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """Hand out the stats gathered since the last call and start afresh."""
        self._begin_changes()
        stats, self.stats = self.stats, PrefixCacheStats()
        return stats

    @mutating
    def reset_prefix_cache(self) -> bool:
        """Forget every cached block, when no request holds a block (else
        False, nothing changed)."""
        self._begin_changes()
        ok = self.pool.reset_prefix_cache()
        if ok and self._event_log is not None:
            self._event_log.append(AllBlocksCleared())
        if ok:  # every block was free, so no request holds a cached block
            self.stats.reset = True
        return ok

    @mutating
    def get_computed_blocks(self, request: NewRequest) -> ComputedBlocks:
        """Look a new request up (counts in the stats); changes nothing else."""
        (request,) = self._normalize((), (), [request], single=True, defer_admissible=True).new
        self._begin_changes()  # the lookup remembers digests and counts in the stats
        plan = self._plan(self._new_state(request), [])
        self._remember_digests(plan.state)
        self._count_lookup(plan)
        # No earlier plan in this call: every hit is a block id, none a pending (plan, position).
        return ComputedBlocks(cast("list[list[int]]", [[b for b in g] for g in plan.hits]),
                              plan.num_hit_blocks * self.block_size)

    @mutating
    def allocate_slots(
        self,
        request: NewRequest | str,
        new_token_ids: Sequence[int] = (),
        computed: ComputedBlocks | None = None,
        num_tokens: int | None = None,
        num_lookahead_tokens: int | None = None,
    ) -> list[list[int]] | None:
        """Give a request the blocks for the tokens it computes now, as vLLM's
        ``allocate_slots(request, num_tokens, new_computed_blocks,
        num_lookahead_tokens)``.

        A ``NewRequest`` (with the ``computed`` that ``get_computed_blocks``
        returned for it, or none for no hit) is admitted; a request id is a
        running request, ``new_token_ids`` appended first. ``num_tokens``:
        tokens computed now beyond those computed (for a new request: beyond
        the hit), None for all known tokens (or a new request's own
        ``num_tokens_to_compute``); ``num_lookahead_tokens``: slots beyond
        them, never cached (None: 0, or a new request's own). Returns the
        newly allocated block ids per group, or None when they do not fit, in
        which case nothing changed.
        """
        if isinstance(request, NewRequest):
            if len(normalize_token_ids(new_token_ids, "new_token_ids")):
                raise InvalidInputError("a new request brings its tokens in NewRequest.token_ids",
                                        argument="new_token_ids", fix="pass new_token_ids=() with a NewRequest")
            return self._allocate_new(request, computed, num_tokens, num_lookahead_tokens)
        if not isinstance(request, str):
            raise InvalidTypeError(f"must be a NewRequest or a running request's id (str), got "
                                   f"{type(request).__name__}", argument="request",
                                   fix="pass a NewRequest to admit, or the id of a running request")
        if computed is not None:
            raise InvalidInputError("computed blocks are for new requests only", argument="computed",
                                    fix="pass computed=None with a running request's id")
        lookahead = 0 if num_lookahead_tokens is None else num_lookahead_tokens  # (checked next, not truth-tested)
        update = RunningUpdate(request, new_token_ids, num_tokens, lookahead)
        (update,) = self._normalize((), [update], (), single=True).running
        num_before = [len(b) for b in self._state(request).blocks]
        self._begin_changes()
        st = self._state(request)
        self._release_skipped(st)
        states, work = self._running_work([update])
        if self._run_all(states, *work) is not None:
            return None
        self._cache_running(states)
        return [self._state(request).blocks[g][num_before[g]:] for g in range(self.num_groups)]

    @mutating
    def free(self, request_id: str) -> None:
        """Give back a request's blocks (tail first, group by group) and forget it."""
        (request_id,) = self._normalize([request_id], (), (), single=True).finished
        self._begin_changes()
        self._free_request(request_id)

    @mutating
    def step(
        self,
        finished: Sequence[str] = (),
        running: Sequence[RunningUpdate] | RunningBatch = (),
        new: Sequence[NewRequest] = (),
        *,
        token_budget: int | None = None,
        block_ids: bool = False,
        prefix_of: str | None = None,
    ) -> StepResult:
        """One scheduling step, phase by phase (see ``docs/design.md``):

        1. free the finished requests, in order;
        2. sliding-window groups of every running update's request release the
           blocks behind their window (as vLLM does, before any fit check);
           then each running update gets its blocks, in order; the first that
           does not fit is reported and it and the rest get nothing (nor is any
           new request looked at);
        3. hash and look up the new requests, against the cache and against
           blocks earlier new requests of this step will cache;
        4. admit the longest prefix of new requests whose needs fit (a request
           needs its new blocks plus the free cached blocks it is the first in
           the step to hit), each computing its hit plus ``min(tokens - hit,
           num_tokens_to_compute, budget left)`` tokens (vLLM's waiting loop:
           ``token_budget`` tokens for this step's new requests, None for no
           budget; admission stops where the budget is spent, before that
           request is looked up);
        5. touch the hits of every admitted request, then allocate for each in
           order, then cache the blocks that will be full.

        ``running``: ``RunningUpdate``s, or a ``RunningBatch`` (the same work
        as arrays, addressed by row: ``gpukv.running``). What a serving loop
        reads after the step comes back with it, in the step's one device
        read on the device manager: ``block_ids=True`` gives each running
        update's new blocks and each admitted request's blocks
        (``StepResult.running_block_ids``, ``admitted_block_ids``);
        ``prefix_of`` (a request held before the step and not finished in
        it) its blocks' reference counts after the step, for
        ``StepResult.num_common_prefix_blocks`` (vLLM's cascade-attention
        prefix).

        Every argument is checked before anything changes (``gpukv.request``:
        containers may be lists, tuples or iterators, materialised once; a str
        is not a list of ids); a refused call raises a ``gpukv.errors`` class
        and changes nothing.
        """
        step, batch = self._normalize_step(finished, running, new)
        token_budget = check_token_budget(token_budget)
        outputs = check_step_outputs(block_ids, prefix_of, self._requests, step.finished, step.new)
        self._begin_changes()
        return self._step(step.finished, step.running if batch is None else batch, step.new, token_budget, outputs)

    def _normalize_step(self, finished, running, new) -> tuple[Step, RunningRows | None]:
        """``step()``'s arguments checked; a ``RunningBatch`` apart."""
        if not isinstance(running, RunningBatch):
            return self._normalize(finished, running, new), None
        step = self._normalize(finished, (), new)
        rows = [self._requests[rid].row for rid in step.finished]
        return step, self._normalize_running(running, rows)

    def _normalize_running(self, batch: Any, finished_rows: Sequence[int] = ()) -> RunningRows:
        """A ``RunningBatch`` checked (``gpukv.running.normalize_running``);
        ``finished_rows``: rows the same step frees first."""
        in_use = self._rows.in_use
        if finished_rows:
            in_use = in_use.copy()
            in_use[list(finished_rows)] = False
        return normalize_running(batch, in_use, self._row_tokens.__getitem__, self._row_computed.__getitem__,
                                 self._limits, None)

    def _step(self, finished, running, new, token_budget: int | None, outputs: StepOutputs) -> StepResult:
        """A step on normalised arguments (``step``): nothing here refuses input."""
        for rid in finished:
            self._free_request(rid)
        grown, work = self._running_work(running)
        if any(w is not None for w in self.sliding_windows):  # full attention releases nothing
            for st in grown:
                self._release_skipped(st)
        held_before = [len(st.blocks[0]) for st in grown] if outputs.block_ids else []
        filled: list[_RequestState] = []
        failed_at = self._run_all(grown, *work, filled=filled)
        self._cache_running(filled)
        if failed_at is not None:
            result = StepResult(running_failed_at=failed_at)
        else:
            result = self._admit_new(new, token_budget)
        if outputs.block_ids:
            fit = len(grown) if failed_at is None else failed_at
            result.running_block_ids = [[st.blocks[g][h:] for st, h in zip(grown[:fit], held_before, strict=False)]
                                        for g in range(self.num_groups)]
            admitted = [self._requests[self._row_ids[r]] for r in result.rows]
            result.admitted_block_ids = [[list(st.blocks[g]) for st in admitted] for g in range(self.num_groups)]
        if outputs.prefix_of is not None and outputs.prefix_of in self._requests:
            st = self._requests[outputs.prefix_of]
            ref = self.pool.ref_cnt
            result.prefix_ref_counts = [None if w is not None else [ref[b] for b in st.blocks[g]]
                                        for g, w in enumerate(self.sliding_windows)]
        return result

    def _running_work(self, running) -> tuple[list[_RequestState], tuple[list, list, Any]]:
        """The running requests' states and, per request, its new tokens (a
        list), its chunk (None: all) and its lookahead slots, from
        ``RunningUpdate``s or a normalised ``RunningBatch``."""
        if isinstance(running, RunningRows):
            states = self._row_state[running.rows].tolist()
            tokens = running.tokens.tolist()
            if running.counts is not None:
                tokens = [t[:c] for t, c in zip(tokens, running.counts.tolist(), strict=True)]
            chunks = [None] * len(states) if running.chunks is None else running.chunks.tolist()
            la = running.lookahead
            return states, (tokens, chunks, [la] * len(states) if isinstance(la, int) else la.tolist())
        requests = self._requests
        states = [requests[u.request_id] for u in running]
        tokens = []
        for u in running:
            t: Any = u.new_token_ids  # normalised (gpukv.request): an int64 array or a tensor
            tokens.append((t if type(t) is np.ndarray else token_array_for_host(t)).tolist())
        return states, (tokens, [u.num_tokens_to_compute for u in running], [u.num_lookahead_tokens for u in running])

    def _admit_new(self, new, token_budget: int | None) -> StepResult:
        """Phases 3-5 for the step's new requests."""
        # Each request is hashed when its lookup comes (in ``_plan``), so the
        # requests after the first refused one are not hashed at all.
        states = [self._new_state(r) for r in new]
        plans: list[_Plan] = []
        refused_hit: int | None = None
        while True:  # a round per deferral (``_plan_admissions``): vLLM's order exactly
            budget_left = None if token_budget is None else token_budget - sum(
                p.num_computed_tokens - p.num_hit_blocks * self.block_size for p in plans)
            admitted, deferred, refused_hit = self._plan_admissions(states[len(plans):], budget_left)
            self._admit(admitted)
            plans += admitted
            if not deferred:
                break
        for st in states[len(plans):]:
            self._remember_digests(st)
        hit_tokens = [p.num_hit_blocks * self.block_size for p in plans]
        return StepResult(
            num_admitted=len(plans),
            num_computed_tokens=hit_tokens,
            rows=[p.state.row for p in plans],
            num_new_tokens=[p.num_computed_tokens - h for p, h in zip(plans, hit_tokens, strict=True)],
            refused_hit_tokens=refused_hit,
        )

    def _allocate_new(self, request: NewRequest, computed: ComputedBlocks | None, num_tokens: int | None,
                      num_lookahead_tokens: int | None) -> list[list[int]] | None:
        """``allocate_slots`` for a new request: admitted with the hit its
        ``computed`` blocks give (checked against its own digests), if its
        new blocks and first touches fit."""
        (request,) = self._normalize((), (), [request], single=True, defer_admissible=True).new
        computed = normalize_computed(computed, self._limits)
        check_computed_for(request, computed, self._limits)
        hit_tokens = computed.num_tokens if computed is not None else 0
        request = apply_allocate_args(request, hit_tokens, num_tokens, num_lookahead_tokens, self._limits)
        state = self._new_state(request)
        hits = computed.block_ids if computed is not None else [[] for _ in range(self.num_groups)]
        num_hit = hit_tokens // self.block_size
        self._check_computed(state, hits, num_hit)
        self._begin_changes()  # (before it, only the digest memo was read: ``_new_state``)
        plan = self._plan_for_hit(state, num_hit, hits)
        need = plan.num_new_blocks + len({b for g in hits for b in g if b != NULL_BLOCK and self.pool.ref_cnt[b] == 0})
        if need > self.pool.num_free_blocks:
            self._remember_digests(state)
            return None
        before = [list(g) for g in hits]
        self._admit([plan])
        return [self._state(state.request_id).blocks[g][len(before[g]):] for g in range(self.num_groups)]

    def _plan_admissions(self, states: list[_RequestState],
                         token_budget: int | None = None) -> tuple[list[_Plan], bool, int | None]:
        """Phases 3 and 4, interleaved: a request's lookup depends only on the
        requests before it, so looking up stops at the first refused one, or
        before the first one the budget has nothing left for (vLLM's
        ``while token_budget > 0``). Returns the admitted requests' plans (a
        prefix of ``states``); whether it stopped before a request to look it
        up again once these are admitted (deferred: vLLM pops the earlier
        requests' blocks before it looks the next one up, and those pops
        evict a free cached block this one hits); and the hit, in tokens, of
        the request it looked up and refused (None: none was)."""
        num_free = self.pool.num_free_blocks
        plans: list[_Plan] = []
        used = new_blocks = 0
        budget_left = token_budget
        touched: set[int] = set()
        evicted = _PopReach(self.pool.free_blocks_in_order(), touched)
        for state in states:
            if budget_left is not None and budget_left <= 0:
                break
            plan = self._plan(state, plans, budget_left)
            first_touch = {
                b for g in plan.hits for b in g
                if isinstance(b, int) and b != NULL_BLOCK and self.pool.ref_cnt[b] == 0 and b not in touched
            }
            if first_touch and evicted.any_of(first_touch, new_blocks):
                return plans, True, None
            self._count_lookup(plan)
            need = plan.num_new_blocks + len(first_touch)
            if used + need > num_free:
                return plans, False, plan.num_hit_blocks * self.block_size
            plans.append(plan)
            used += need
            new_blocks += plan.num_new_blocks
            touched |= first_touch
            if budget_left is not None:
                budget_left -= plan.num_computed_tokens - plan.num_hit_blocks * self.block_size
        return plans, False, None

    @mutating
    def decode(self, rows: Sequence[int], new_token_ids, *, num_new_tokens=None, num_tokens_to_compute=None,
               num_lookahead_tokens=0) -> StepResult:
        """The running requests at ``rows`` (``StepResult.rows``) each append
        their new tokens and get their blocks: ``step(running=RunningBatch(
        rows, new_token_ids, ...))``, the same as ``step(running=
        [RunningUpdate(id_of_row, tokens, chunk, lookahead)...])`` in row order
        (``running_failed_at`` indexes ``rows``). The arguments are
        ``gpukv.RunningBatch``'s (``gpukv.running``). The device manager's
        batched decode entry, on the host."""
        run = self._normalize_running(RunningBatch(rows, new_token_ids, num_new_tokens, num_tokens_to_compute,
                                                   num_lookahead_tokens))
        self._begin_changes()
        return self._step((), run, (), None, StepOutputs())

    @mutating
    def take_events(self) -> list[KVEventBatch]:
        """The KV-cache event batches made since the last call (``gpukv.events``;
        one per call that changed the cache), oldest first; empty unless built
        with ``enable_kv_cache_events``."""
        self._begin_changes()
        return self._event_queue.take()

    def _after_call(self) -> None:
        if self._event_log:
            self._event_queue.add(self._event_log)
            self._event_log = []

    @reading
    def row_of(self, request_id: str) -> int:
        """The row a running request holds (``gpukv.rows``)."""
        return self._state(request_id).row

    @reading
    def check_invariants(self) -> None:
        """Pool invariants, plus: each block's count equals the number of
        request block lists that hold it."""
        self.pool.check_invariants()
        held = [0] * self.pool.num_blocks
        for st in self._requests.values():
            for blocks in st.blocks:
                for b in blocks:
                    if b != NULL_BLOCK:
                        held[b] += 1
        assert held[1:] == self.pool.ref_cnt[1:], "reference counts disagree with the requests' block lists"
        for st in self._requests.values():
            assert self._row_state[st.row] is st, f"row {st.row} does not hold request {st.request_id!r}"
            assert (self._row_tokens[st.row], self._row_computed[st.row]) == (len(st.tokens), st.num_computed_tokens), \
                f"row {st.row}'s counts are not request {st.request_id!r}'s"

    # ------------------------------------------------------------- checking
    def _state(self, request_id: str) -> _RequestState:
        if type(request_id) is not str:
            raise request_id_type_error(request_id, "request_id")
        try:
            return self._requests[request_id]
        except KeyError:
            raise unknown_request(request_id) from None

    def _normalize(self, finished, running, new, *, single: bool = False, defer_admissible: bool = False) -> Step:
        """Every argument checked and normalised (``gpukv.request``), before anything changes."""
        return normalize_step(finished, running, new, known=self._requests, limits=self._limits,
                              num_tokens=lambda rid: len(self._requests[rid].tokens),
                              num_computed=lambda rid: self._requests[rid].num_computed_tokens, single=single,
                              defer_admissible=defer_admissible, keep_device_tokens=False)

    def _check_computed(self, state: _RequestState, hits, num_hit: int) -> None:
        if len(hits) != self.num_groups or any(len(g) != num_hit for g in hits):
            raise InvalidInputError("the computed blocks do not match this manager's groups", argument="computed",
                                    fix="pass what get_computed_blocks returned for this request")
        self._extend_hashes([state])  # incremental: a recalled shorter list is completed
        for g, blocks in enumerate(hits):
            for i, b in enumerate(blocks):
                if b == NULL_BLOCK:
                    continue
                info = self.pool.cached_info(b)
                if info is None or info.digest != state.block_hashes[i] or info.group != g:
                    raise stale_computed_blocks()

    # ------------------------------------------------------------- hashing
    def _remember_digests(self, st: _RequestState) -> None:
        if not st.block_hashes:
            return
        old = self._digest_memo.pop(st.request_id, None)
        if old is not None:
            self._memo_digests -= len(old[2])
        n = len(st.block_hashes)
        tokens = np.asarray(st.tokens[: n * self.block_size], dtype=np.int64)
        self._digest_memo[st.request_id] = (tokens, (st.lora_id, st.mm_items, st.cache_salt),
                                            list(st.block_hashes), list(st.extras[:n]))
        self._memo_digests += n
        while self._memo_digests > self._memo_limit and len(self._digest_memo) > 1:
            _, (_, _, digests, _) = self._digest_memo.popitem(last=False)
            self._memo_digests -= len(digests)

    def _recall_digests(self, st: _RequestState) -> None:
        entry = self._digest_memo.pop(st.request_id, None)
        if entry is None:
            return
        tokens, extra_keys, digests, extras = entry
        self._memo_digests -= len(digests)
        if (extra_keys == (st.lora_id, st.mm_items, st.cache_salt) and len(st.tokens) >= len(tokens)
                and np.array_equal(st.tokens[: len(tokens)], tokens)):
            st.block_hashes, st.extras = digests, extras

    def _new_state(self, r: NewRequest) -> _RequestState:
        """A normalised new request's state. Its digests are always computed
        by this manager, from its own tokens and extra keys (or recalled from
        when it hashed the same id, extra keys and tokens before): what a
        caller hands in as ``block_hashes`` decides nothing (``docs/design.md``)."""
        st = _RequestState(
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
        self._recall_digests(st)
        return st

    def _extras(self, st: _RequestState, first: int, count: int) -> list[bytes]:
        if not st.has_extra_keys:
            return [hashing.NO_EXTRA] * count
        return hashing.extra_key_digests(
            self._key, count, self.block_size,
            lora_id=st.lora_id, mm_items=st.mm_items, cache_salt=st.cache_salt, first_block=first,
        )

    def _extend_hashes(self, states: list[_RequestState]) -> None:
        """Hash every full block not hashed yet, all requests at once
        (``gpukv.hashing.extend_chains``, the one chain-hashing driver)."""
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
            self._key, [st.block_hashes[-1] if st.block_hashes else self._root for st, _, _ in work],
            [np.asarray(st.tokens[s * bs:e * bs], dtype=np.int64) for st, s, e in work], bs,
            [st.extras[s:e] for st, s, e in work])
        for (st, _, _), digests in zip(work, chains, strict=True):
            st.block_hashes.extend(digests)

    def _token_bytes(self, st: _RequestState, i: int) -> bytes:
        bs = self.block_size
        return np.asarray(st.tokens[i * bs:(i + 1) * bs], dtype="<u4").tobytes()

    def _parent(self, st: _RequestState, i: int) -> bytes:
        return st.block_hashes[i - 1] if i > 0 else self._root

    # ------------------------------------------------------------- lookups
    def _num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _plan(self, st: _RequestState, plans: list[_Plan], budget_left: int | None = None) -> _Plan:
        """Find the request's hit, against the cache and against the blocks the
        earlier ``plans`` of this step will compute and cache; it computes
        ``new_tokens_at_admission`` tokens past it (``budget_left``: what the
        step's token budget has left, None for no budget)."""
        self._extend_hashes([st])
        bs = self.block_size
        num_tokens = len(st.tokens)
        max_hit = (num_tokens - 1) // bs
        probe = {}

        def block_at(i: int, g: int):
            if (i, g) not in probe:
                found = None
                if self.enable_caching:
                    found = self.pool.lookup(st.block_hashes[i], g)
                    if found is not None and not self.pool.verify(
                        found, self._parent(st, i), self._token_bytes(st, i), st.extras[i]
                    ):
                        found = None
                    if found is None:
                        found = self._pending_hit(st, i, plans)
                probe[(i, g)] = found
            return probe[(i, g)]

        def has_block(i: int, g: int) -> bool:
            return block_at(i, g) is not None

        if st.skip_prefix_cache or not self.enable_caching:
            hit = 0
        else:
            hit = max_hit
            while True:
                new_hit = hit
                for g, policy in enumerate(self._policies):
                    # (read lazily: full attention stops at its first miss)
                    new_hit = policy.hit(_Available(functools.partial(has_block, g=g), new_hit))
                if new_hit == hit:
                    break
                hit = new_hit
        hits = []
        for g, policy in enumerate(self._policies):
            first_real = policy.first_real(hit)
            hits.append([NULL_BLOCK if i < first_real else block_at(i, g) for i in range(hit)])
        return self._plan_for_hit(st, hit, hits, budget_left)

    def _plan_for_hit(self, st: _RequestState, hit: int, hits, budget_left: int | None = None) -> _Plan:
        """The plan of admitting ``st`` with a hit of ``hit`` blocks (``hits``: per group, the blocks)."""
        bs = self.block_size
        new = new_tokens_at_admission(hit, len(st.tokens), st.chunk, bs, budget_left)
        n_alloc = blocks_after_admission(hit, len(st.tokens), st.chunk, st.lookahead, bs, budget_left)
        return _Plan(st, hit, hits, (n_alloc - hit) * self.num_groups, hit * bs + new)

    def _pending_hit(self, st: _RequestState, i: int, plans: list[_Plan]):
        """(plan index, i) for the first earlier request of the step that
        computes a block with our digest at position ``i`` (one that did not
        hit it: a window group may hit a position with the null block, so an
        earlier request sharing the block need not hold it; and whose chunk
        reaches past the block, so it caches it), if that block verifies
        against ours; else None. As in vLLM, where each admission caches its
        full computed blocks before the next request is looked up."""
        digest = st.block_hashes[i]
        bs = self.block_size
        for j, plan in enumerate(plans):
            other = plan.state
            if (i < len(other.block_hashes) and other.block_hashes[i] == digest and plan.num_hit_blocks <= i
                    and i < plan.num_computed_tokens // bs):
                if (
                    self._token_bytes(other, i) != self._token_bytes(st, i)
                    or other.extras[i] != st.extras[i]
                    or self._parent(other, i) != self._parent(st, i)
                ):
                    return None
                return (j, i)
        return None


    def _count_lookup(self, plan: _Plan) -> None:
        """The stats of one request's lookup (as the device's ``_count_lookups``)."""
        st = plan.state
        if st.skip_prefix_cache:
            self.stats.record(num_tokens=0, num_hit_tokens=0, num_blocks=0, num_hit_blocks=0, preempted=st.preempted)
            return
        n_tok = len(st.tokens)
        self.stats.record(num_tokens=n_tok, num_hit_tokens=plan.num_hit_blocks * self.block_size,
                          num_blocks=self._num_blocks_for(n_tok), num_hit_blocks=plan.num_hit_blocks,
                          preempted=st.preempted)

    # ------------------------------------------------------------- changing
    def _admit(self, plans: list[_Plan]) -> None:
        for plan in plans:
            self.pool.touch(b for g in plan.hits for b in g if isinstance(b, int))
        for plan in plans:
            st = plan.state
            for g in range(self.num_groups):
                resolved = []
                for b in plan.hits[g]:
                    if isinstance(b, tuple):
                        j, pos = b
                        b = plans[j].state.blocks[g][pos]
                        self.pool.touch([b])
                    resolved.append(b)
                st.blocks[g] = resolved
                st.num_cached_blocks[g] = plan.num_hit_blocks
            for g in range(self.num_groups):
                st.blocks[g].extend(self.pool.allocate(plan.num_new_blocks // self.num_groups))
            st.num_computed_tokens = plan.num_computed_tokens
            st.row = row = self._rows.take()
            self._row_ids[row] = st.request_id
            self._row_state[row] = st
            self._row_tokens[row], self._row_computed[row] = len(st.tokens), st.num_computed_tokens
            self._requests[st.request_id] = st
        for plan in plans:
            self._cache_full_blocks(plan.state)

    def _release_skipped(self, st: _RequestState) -> None:
        """Sliding-window groups give back the blocks no token computed from now
        on can see (vLLM's ``remove_skipped_blocks``): freed tail first, one
        free call per group, replaced by the null block. Done before the fit
        check, as vLLM does; the blocks are useless to the request either way."""
        for g, skip in enumerate(self._skipped_blocks(st)):
            released = [b for b in st.blocks[g][:skip] if b != NULL_BLOCK]
            if released:
                self.pool.free(list(reversed(released)))
                for i in range(skip):
                    st.blocks[g][i] = NULL_BLOCK

    def _run_all(self, states: Sequence[_RequestState], tokens: Sequence[list], chunks: Sequence[int | None],
                 lookaheads: Sequence[int], filled: list[_RequestState] | None = None) -> int | None:
        """Each running request in order (``states``) appends its ``tokens``
        and gets blocks for the tokens it computes (``chunks``: None for all)
        and its lookahead slots: the index of the first whose blocks do not
        fit, it and the later ones left unchanged, or None when all fit.
        ``filled`` gets the requests a block of whose filled up (known or
        computed): the only ones with anything to hash or cache."""
        bs = self.block_size
        pool = self.pool
        free = pool._free  # len(free) is pool.num_free_blocks
        row_tokens, row_computed = self._row_tokens, self._row_computed
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
            if need > len(free):
                return k
            if isinstance(known, np.ndarray):  # a list from the first append on
                known = st.tokens = known.tolist()
            known.extend(new_tokens)
            for blocks in st.blocks:
                n = n_total - len(blocks)
                if n:  # allocating none changes nothing
                    blocks.extend(pool.allocate(n))
            st.num_computed_tokens = computed
            row_tokens[st.row], row_computed[st.row] = num_tokens, computed
            if filled is not None and (num_tokens // bs > num_before // bs or computed // bs > computed_before // bs):
                filled.append(st)
        return None

    def _cache_running(self, states: list[_RequestState]) -> None:
        """Cache the blocks running requests filled, request by request; the
        hashing is done first for all of them at once (it reads no pool state,
        so doing it early changes nothing)."""
        self._extend_hashes(states)
        bs = self.block_size
        for st in states:
            # Every full block is hashed now, so only a group that has not
            # cached all of them gives ``_cache_full_blocks`` anything to do.
            num_full = st.num_computed_tokens // bs
            for cached in st.num_cached_blocks:
                if cached < num_full:
                    self._cache_full_blocks(st)
                    break

    def _skipped_blocks(self, st: _RequestState) -> list[int]:
        """Per group, how many leading blocks no token computed from now on can
        see (vLLM: tokens before ``num_computed - window + 1``)."""
        return [int(policy.skipped(st.num_computed_tokens)) for policy in self._policies]

    def _cache_full_blocks(self, st: _RequestState) -> None:
        if not self.enable_caching:
            return
        bs = self.block_size
        num_full = st.num_computed_tokens // bs
        if len(st.tokens) // bs <= len(st.block_hashes):  # nothing left to hash
            for cached in st.num_cached_blocks:
                if cached < num_full:
                    break
            else:  # and every group has cached its full blocks already
                return
        self._extend_hashes([st])
        for g in range(self.num_groups):
            for i in range(st.num_cached_blocks[g], num_full):
                b = st.blocks[g][i]
                if b == NULL_BLOCK or self.pool.cached_info(b) is not None:
                    continue
                self.pool.cache(b, CachedBlockInfo(
                    st.block_hashes[i], g, self._parent(st, i), self._token_bytes(st, i), st.extras[i]
                ))
                if self._event_log is not None:
                    self._event_log.append(BlockStored(
                        [st.block_hashes[i]], st.block_hashes[i - 1] if i else None,
                        [int(t) for t in st.tokens[i * bs:(i + 1) * bs]], bs, st.lora_id, g))
            st.num_cached_blocks[g] = max(st.num_cached_blocks[g], num_full)

    def _grow_rows(self, capacity: int) -> None:
        for name in ("_row_state", "_row_tokens", "_row_computed"):
            old = getattr(self, name)
            grown = np.empty(capacity, dtype=object) if old.dtype == object else np.zeros(capacity, dtype=np.int64)
            grown[: len(old)] = old
            setattr(self, name, grown)

    def _free_request(self, request_id: str) -> None:
        st = self._requests.pop(request_id)
        self._rows.give_back(st.row)
        del self._row_ids[st.row]
        self._row_state[st.row] = None
        self._remember_digests(st)  # a preempted request comes back with the same prefix
        for g in range(self.num_groups):
            self.pool.free(list(reversed(st.blocks[g])))


#: The name this class had before the two managers were told apart (kept for
#: code that imports it; both modules used to call their manager so).
KVCacheManager = ReferenceManager
