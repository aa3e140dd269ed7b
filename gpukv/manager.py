"""The device block manager: the reference's request-level calls and batched
step, with every piece of pool state and every block table on the device.

Plan on the host, run on the device: the host knows every request's token
count, so it lays out, with numpy, which (request, group, position) entries a
step touches, frees, allocates and caches. The device decides what only it can
know (hits, admission, whether a running update fits) and applies it. A step
reads the device at most once (a small status tensor, at the end); a step with
no new requests whose allocations fit the host's lower bound of free blocks
reads nothing.

Device tensors per request row (rows are recycled): ``tokens`` int32[R, T]
(T = ``max_model_len``), ``digests`` int64[R, M, 2] (M = T / block size,
rounded up) and ``extras`` (same layout), and the block tables
``block_table`` int32[G, R, M] that an attention kernel can read directly
(``block_table_for``).

Hybrid models: any mix of full-attention and sliding-window groups sharing
the pool, as the reference does them (a window group holds the null block
where its window no longer reaches).

Streams: a manager is bound to the CUDA stream current when it was built
(``torch.cuda.current_stream(device)``); every launch, upload, staging event
and read of its calls runs on that stream. A call made while another stream
is current is ordered, in one place (``DeviceManager._enter_stream``, run by
the ``gpukv.failstop`` wrappers of every public call, and by ``_read``): the
manager's stream first waits for the caller's (so tokens a model runner
sampled there are written before the manager reads them), the call runs on
the manager's stream, and the caller's stream then waits for the manager's
(so an attention kernel launched there after ``block_table_for`` or
``decode`` reads the tables they wrote); a device tensor the call returns is
marked used on the caller's stream (``record_stream``). Two calls made from
two streams are thus both ordered on the manager's stream, in call order. A
call on the manager's own stream costs one ``current_stream`` query more.
Without CUDA there are no streams and nothing is done. The decode's parts
(``plan_decode`` ... ``finish_decode``) are run by ``decode`` (and
``gpukv.graphs``) inside its ordering, not on their own.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from gpukv import _runtime, hashing
from gpukv.admission import AdmissionBuffers, plan_admission
from gpukv.api import manager_args_from_config
from gpukv.errors import InvalidInputError, InvalidTypeError
from gpukv.event_log import DeviceEventLog
from gpukv.events import AllBlocksCleared, EventQueue, KVEventBatch
from gpukv.failstop import FailStop, mutating, reading
from gpukv.kernels import _common
from gpukv.kernels import decode as decode_ops
from gpukv.kernels import lookup as lookup_ops
from gpukv.kernels import prefill as prefill_ops
from gpukv.kernels._common import pow2_at_least
from gpukv.kernels.block_hash import hash_rows, hash_rows_host, key_lanes
from gpukv.metrics import PrefixCacheStats
from gpukv.outputs import OutputGather, StepGather
from gpukv.pool import DevicePool
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
    normalize_computed,
    normalize_device,
    normalize_step,
    normalize_token_ids,
    normalize_windows,
    request_id_type_error,
    resolve_key,
    stale_computed_blocks,
    unknown_request,
)
from gpukv.rows import DeviceRows, entry_layout
from gpukv.running import RunningBatch, RunningRows, normalize_rows, normalize_running
from gpukv.staging import Staging, StepCounters, TorchOpCounter
from gpukv.windows import policies

# Under Triton's interpreter (no CUDA) one BLAKE3 compression of the hashing
# kernel costs 0.1-0.3 s, which made a short replay take minutes; there the
# digests come from the same function on the host (the ``blake3`` package),
# held bit-identical to the kernel by tests/kernels/test_block_hash.py.
# GPUKV_HASH_KERNEL=1 forces the kernel (the compile and fault tests launch it).
_hash_rows = (hash_rows_host if _runtime.INTERPRETED and os.environ.get("GPUKV_HASH_KERNEL") != "1"
              else hash_rows)


#: The largest element of a non-empty array: the ufunc's reduce, without
#: ``ndarray.max``'s Python wrapper (a decode plan takes three).
_max = np.maximum.reduce


def _block_counter(block_size: int):
    """``tokens -> tokens // block_size`` for int64 arrays: a shift where the
    block size is a power of two (numpy's integer division is the slower)."""
    if block_size & (block_size - 1):
        return lambda a: a // block_size
    shift = block_size.bit_length() - 1
    return lambda a: a >> shift


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


def _lanes(d: bytes) -> tuple[int, int]:
    return _signed(int.from_bytes(d[:8], "little")), _signed(int.from_bytes(d[8:], "little"))


def device_bytes(num_blocks: int, block_size: int, num_groups: int, max_model_len: int,
                 max_num_reqs: int) -> dict[str, int]:
    """Bytes the device manager allocates at construction, by the argument
    that drives them (``gpukv.pool`` and the request rows below), so a size
    that cannot fit is refused before anything is allocated."""
    N, M = num_blocks, -(-max_model_len // block_size)
    cap = pow2_at_least(2 * N)  # free-queue ring and hash-table slots
    pool = N * (4 + 4 * block_size + 32 + 16 + 8 + 4 + 8 + 8) + cap * (4 + 24)
    rows = max_num_reqs * (4 * max_model_len + 2 * 16 * M + 4 * num_groups * M)
    return {"num_blocks": pool, "max_model_len": rows}  # rows: max_num_reqs of them, sized by max_model_len


def _checked_args(num_blocks, block_size, sliding_windows, max_model_len, max_num_reqs, device,
                  hash_key) -> tuple[int, int, list, int, int, torch.device, bytes]:
    """The constructor's arguments checked, and the memory they take
    estimated, before anything is allocated (numpy integers are accepted as
    sizes)."""
    block_size = check_size(block_size, "block_size", 1)
    windows = list(normalize_windows(sliding_windows))
    num_blocks = check_size(num_blocks, "num_blocks", 2, MAX_NUM_BLOCKS)
    max_model_len = check_size(max_model_len, "max_model_len", 1, MAX_MODEL_LEN)
    max_num_reqs = check_size(max_num_reqs, "max_num_reqs", 1, MAX_NUM_REQS)
    dev = (normalize_device(device, _runtime.INTERPRETED, _runtime.CUDA_AVAILABLE) if device is not None
           else _runtime.default_device())
    key = resolve_key(hash_key)
    check_memory(device_bytes(num_blocks, block_size, len(windows), max_model_len, max_num_reqs), dev,
                 "the device manager", also="max_num_reqs")
    return num_blocks, block_size, windows, max_model_len, max_num_reqs, dev, key


def _warn_waiting_property(name: str) -> None:
    warnings.warn(f"DeviceManager.{name} waits for the GPU (a device read hidden in an attribute); call "
                  f"read_{name}() instead", DeprecationWarning, stacklevel=3)


#: KV-cache events the device buffer holds between two reads (more are
#: dropped and reported): about 9 MB with 16-token blocks.
KV_EVENTS_CAPACITY = 65_536

#: The arrays of a decode plan the host uploads (the rest ``decode_fit`` writes).
_UPLOADED = frozenset({"rows", "ntok", "nnew", "comp0", "comp1", "held", "need", "cum",
                       "r_grp", "r_row", "r_pos", "r_call", "r_valid"})


class _StepAccounting:
    """``DeviceManager._counting``'s context: a plain class, not a generator
    (it wraps every step, and a generator-based context manager costs a few
    microseconds of the decode's host budget)."""

    __slots__ = ("m", "base", "torch_ops")

    def __init__(self, manager: DeviceManager) -> None:
        self.m = manager

    def __enter__(self) -> None:
        m = self.m
        m._counting_depth += 1
        if m._counting_depth > 1:
            return
        c = m.counters
        c.h2d = c.d2h = c.torch_ops = 0
        self.base = _common.launches()
        m._staging.begin_step()
        self.torch_ops = TorchOpCounter(c) if c.count_torch_ops else None
        if self.torch_ops is not None:
            self.torch_ops.__enter__()

    def __exit__(self, *exc: Any) -> None:
        m = self.m
        m._counting_depth -= 1
        if m._counting_depth > 0:
            return
        if self.torch_ops is not None:
            self.torch_ops.__exit__(*exc)
        c = m.counters
        c.launches = _common.launches() - self.base
        c.steps += 1
        m._staging.end_step()


@dataclass
class DecodePlan:
    """A batched decode step as the host plans it (``DeviceManager.decode``):
    the rows, what they need and hold after it; its packed int32 plan is in
    this step's host array of the bucket (``_host_plan``), uploaded once into
    the bucket's fixed device buffer (layout: ``gpukv/kernels/decode.py``)."""

    rows: np.ndarray  # int64[B]
    # (BP, k, L, A, C): rows, tokens per row, window releases per row and
    # group, new blocks and newly cached blocks per row and group
    bucket: tuple
    num_new_blocks: int  # the blocks all rows need (all groups)
    cum: np.ndarray  # int64[B] the blocks the rows up to each one need (all groups)
    held_before: np.ndarray  # int64[B] block positions rows hold per group before the step
    num_tokens: np.ndarray  # int64[B] rows' known tokens after the step
    computed: np.ndarray  # int64[B] rows' computed tokens after the step
    held: np.ndarray  # int64[B] rows' block positions per group after the step
    window_stops: np.ndarray | None  # int64[B, G] rows' null-block boundaries after the step (windows only)
    fits_known: bool  # the host's free-block lower bound covers the whole batch
    # The phases with work (``DECODE_PHASES``); an eager step launches only
    # those, a graph replays them all.
    phases: frozenset[str] = frozenset()

    def blocks_popped(self, num_fit: int) -> int:
        """The blocks the first ``num_fit`` rows took (the only ones popped)."""
        return int(self.cum[num_fit - 1]) if num_fit else 0


#: A decode step's phases, in launch order (``DeviceManager.launch_decode``):
#: window releases, the fit and token write (always), new blocks, digests of
#: blocks the appended tokens fill, caching of blocks the computed tokens fill.
DECODE_PHASES = ("release", "fit", "allocate", "hash", "cache")
_DECODE_PART = {p: f"decode.{p}" for p in DECODE_PHASES}  # their launches' keys in ``DecodeBuffers.prepared``
_ALL_DECODE_PHASES = frozenset(DECODE_PHASES)


@functools.cache
def _decode_phases(release: bool, allocate: bool, hash_: bool, cache: bool) -> frozenset[str]:
    """The decode phases with work (``DecodePlan.phases``): one set per combination."""
    flags = {"release": release, "fit": True, "allocate": allocate, "hash": hash_, "cache": cache}
    return frozenset(p for p in DECODE_PHASES if flags[p])


@dataclass
class DecodeBuffers:
    """Fixed device buffers of one decode bucket: the uploaded plan, its
    views, the new tokens and every kernel's scratch (nothing is allocated
    inside a decode step, so a CUDA graph can capture it)."""

    plan: torch.Tensor
    uploaded: torch.Tensor  # the part of ``plan`` the host sends (``_UPLOADED``)
    views: dict
    new_tokens: torch.Tensor
    count: torch.Tensor
    status: torch.Tensor
    popped: torch.Tensor
    release_scratch: torch.Tensor
    release_workspace: torch.Tensor
    record_scratch: torch.Tensor
    record_seq: torch.Tensor
    prepared: dict = field(default_factory=dict)  # phase's part -> (rows generation, replayable launches)
    runs: dict = field(default_factory=dict)  # phases -> (rows generation, their launches in order)


@dataclass
class ReleaseBuffers:
    """Fixed device buffers of one release bucket (``_release_entries``):
    the uploaded entries (int32[5, EP]: group, row, position, call, valid),
    the kernels' scratch, and the kept launches."""

    plan: torch.Tensor
    scratch: torch.Tensor
    workspace: torch.Tensor
    prepared: dict = field(default_factory=dict)  # "release" -> (rows generation, replayable launches)


@dataclass
class _RunningPhase:
    """A step's phase 2 once launched: the rows, the block positions each
    holds per group before and after (if it fits), the blocks they take, how
    many fit (an int64[1] device tensor to read, None when the host knows all
    do), and ``finish(n_ok)``, which brings the host's mirror up to date."""

    rows: np.ndarray
    held_before: np.ndarray
    held_after: np.ndarray
    total: int
    n_ok: torch.Tensor | None
    finish: Any

    @property
    def size(self) -> int:
        return len(self.rows)


#: A step that hands back nothing beyond its decisions.
_NO_OUTPUTS = StepOutputs()


class DeviceManager(FailStop):
    """Device-resident manager with the reference's API (``gpukv.reference``),
    plus the batched ``decode(rows, new_token_ids)`` entry for serving loops.

    Bound to the CUDA stream current at construction: a call made while
    another stream is current waits for that stream's work, runs on the
    manager's stream, and makes the caller's stream wait for its work (the
    module docstring, "Streams")."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        sliding_windows: Sequence[int | None] = (None,),
        enable_caching: bool = True,
        uncached_first: bool = True,
        hash_key: bytes | str | None = None,
        max_model_len: int = 8192,
        max_num_reqs: int = 64,
        device: torch.device | str | None = None,
        enable_kv_cache_events: bool = False,
    ) -> None:
        num_blocks, block_size, windows, max_model_len, max_num_reqs, device, key = _checked_args(
            num_blocks, block_size, sliding_windows, max_model_len, max_num_reqs, device, hash_key)
        self.device = device
        # The stream every call runs on (module docstring, "Streams"); None without CUDA.
        self._stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        self.block_size = block_size
        self._blocks_of = _block_counter(block_size)  # full blocks in a number of tokens
        self.sliding_windows = windows
        self.num_groups = len(windows)
        self._policies = policies(windows, block_size)  # one per group (``gpukv.windows``)
        # Blocks a window group must still see at a hit boundary; -1 = full attention.
        self._window_blocks = [p.boundary_blocks for p in self._policies]
        self._window_groups = [g for g, w in enumerate(windows) if w is not None]
        self._win_dev = torch.tensor(self._window_blocks, dtype=torch.int32, device=self.device)
        self.max_model_len = max_model_len
        self.uncached_first = bool(uncached_first)
        # Without caching no lookup runs (every hit is 0, the stats still count
        # the queries, as the reference's) and no block is ever recorded.
        self.enable_caching = bool(enable_caching)
        self.pool = DevicePool(num_blocks, block_size, self.device, uncached_first=uncached_first)
        self._key = key
        self._limits = ManagerLimits(block_size, num_blocks, tuple(windows), max_model_len, self.enable_caching)
        self._root = hashing.root_digest(self._key)
        self._root_lanes = _lanes(self._root)
        self._key_dev = key_lanes(self._key, self.device)
        # Request rows: tokens, digests and block tables on the device, counts
        # mirrored on the host (``gpukv.rows.DeviceRows``).
        self._rows = DeviceRows(max_num_reqs, num_groups=self.num_groups, max_model_len=max_model_len,
                                block_size=block_size, device=self.device)
        self._reqs: dict[str, int] = {}  # request id -> row
        self._row_ids: dict[int, str] = {}
        # KV-cache events (``gpukv.events``): written on the device as the cache
        # changes, drained by the reads the host makes (``gpukv.event_log``).
        self._events = (DeviceEventLog(KV_EVENTS_CAPACITY, block_size, device) if enable_kv_cache_events
                        else None)
        self._event_queue = EventQueue()
        self._init_step_state()
        # Counted on the host from the hits each step reads anyway (no read of its own).
        self._stats = PrefixCacheStats()
        self._reset_flag = False
        self._free_lower_bound = num_blocks - 1

    def _init_step_state(self) -> None:
        """What steps reuse: accounting, the pinned staging buffers, and the
        per-bucket plans and device buffers (made on a bucket's first step)."""
        self.counters = StepCounters()
        self._staging = Staging(self.device, self.counters)
        self._counting_depth = 0
        self._decode_bufs: dict[tuple, DecodeBuffers] = {}
        self._host_plans: dict[tuple, dict] = {}  # (bucket, staging parity) -> views
        self._admission_bufs: dict[tuple, AdmissionBuffers] = {}
        self._release_bufs: dict[int, ReleaseBuffers] = {}  # by entries (padded), for ``_release_entries``
        self._admission_plans: dict[tuple, np.ndarray] = {}
        self._blocked = torch.zeros(1, dtype=torch.int32, device=self.device)  # a running update did not fit
        self._gather = OutputGather(self)  # what a step hands back (``gpukv.outputs``)

    @property
    def rows_generation(self) -> int:
        """Bumped when the row tensors are reallocated (captured graphs and
        prepared launches hold the old ones)."""
        return self._rows.generation

    @classmethod
    def from_config(cls, config, **kwargs) -> DeviceManager:
        """A manager for a ``KVCacheConfig`` (``gpukv.get_kv_cache_config``):
        one group per config group, ``kwargs`` as the constructor's."""
        num_blocks, block_size, windows = manager_args_from_config(config)
        return cls(num_blocks, block_size, sliding_windows=windows, **kwargs)

    def __repr__(self) -> str:  # never show the key
        return (f"DeviceManager(device={self.device}, num_blocks={self.num_blocks}, "
                f"block_size={self.block_size}, groups={self.sliding_windows})")

    # ------------------------------------------------------------ properties
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
        """Deprecated here (it waits for the GPU): ``read_num_free_blocks()``."""
        _warn_waiting_property("num_free_blocks")
        return self.read_num_free_blocks()

    @property
    def num_evictions(self) -> int:
        """Deprecated here (it waits for the GPU): ``read_num_evictions()``."""
        _warn_waiting_property("num_evictions")
        return self.read_num_evictions()

    @reading
    def read_num_free_blocks(self) -> int:
        """Free blocks now; reads the device (waits for the GPU)."""
        return int(self._read(self.pool.free_count)[0])

    @reading
    def read_num_evictions(self) -> int:
        """Cached blocks evicted so far; reads the device (waits for the GPU)."""
        return int(self._read(self.pool.evictions)[0])

    @property
    def usage(self) -> float:
        """Deprecated here (it waits for the GPU): ``read_usage()``."""
        _warn_waiting_property("usage")
        return self.read_usage()

    @reading
    def read_usage(self) -> float:
        """Fraction of the pool (null block excluded) that is referenced, as
        vLLM's ``KVCacheManager.usage``; reads the device (waits for the GPU)."""
        return 1.0 - self.read_num_free_blocks() / (self.num_blocks - 1)

    @reading
    def free_queue(self) -> list[int]:
        """The free block ids, front (reused first) to back; reads the device."""
        return self.pool.free_queue_list()

    @reading
    def request_ids(self) -> list[str]:
        """The running requests' ids, in admission order (host only)."""
        return list(self._reqs)

    @reading
    def row_of(self, request_id: str) -> int:
        """The row a running request holds (``gpukv.rows``; ``decode`` takes rows)."""
        return self._state(request_id)

    @reading
    def get_block_ids(self, request_id: str) -> list[list[int]]:
        """The request's block ids per group, position by position (the null
        block 0 where a window dropped them); reads the device."""
        row = self._state(request_id)
        return self._read(self._rows.block_table[:, row, : self._num_blocks(row)])

    @reading
    def block_table_for(self, request_ids: Sequence[str]) -> torch.Tensor:
        """int32[G, len(request_ids), M] block tables of these requests (a
        device gather; positions past a request's blocks are not its blocks:
        read only the first ``len(get_block_ids(id)[g])``). Called between
        steps, its upload is a staging step of its own (``gpukv.staging``), and
        on another stream the caller's stream waits for the gather (the
        module docstring, "Streams")."""
        ids = check_request_ids(request_ids, "request_ids", self._reqs)
        rows = self._staging.upload(np.array([self._reqs[r] for r in ids], dtype=np.int64))
        return self._rows.block_table[:, rows]

    @reading
    def num_blocks_held(self, request_id: str) -> int:
        """The block positions the request holds, per group (host only; the
        null block counts where a window dropped one)."""
        return self._num_blocks(self._state(request_id))

    @reading
    def read_block_ids(self, spans: Sequence[tuple[str, int, int]], group: int = 0) -> list[list[int]]:
        """Group ``group``'s block ids of each ``(request_id, start, end)``
        span's request at positions ``[start, end)``, in one device read (a
        gather at the positions, planned on the host from its block counts;
        none when every span is empty): a serving loop's new blocks of a
        step, for many requests at once."""
        group = check_group(group, self.num_groups)
        spans = check_block_spans(spans, "spans", self.num_blocks_held)
        counts = np.fromiter((end - start for _, start, end in spans), np.int64, len(spans))
        if not counts.sum():
            return [[] for _ in spans]
        rows = np.repeat(np.fromiter((self._reqs[rid] for rid, _, _ in spans), np.int64, len(spans)), counts)
        first = np.repeat(np.fromiter((start for _, start, _ in spans), np.int64, len(spans)), counts)
        pos = first + np.arange(len(rows)) - np.repeat(np.cumsum(counts) - counts, counts)
        rows_t, pos_t = self._up_packed(rows, pos)
        ids = self._read(self._rows.block_table[group, rows_t.long(), pos_t.long()])
        ends = np.cumsum(counts).tolist()
        return [ids[e - c: e] for e, c in zip(ends, counts.tolist(), strict=True)]

    @reading
    def row_token_counts(self, rows: Any) -> tuple[np.ndarray, np.ndarray]:
        """The known and the computed tokens of the requests at ``rows``
        (host ints, each a running request's), as int64 arrays; host only."""
        rows_np = normalize_rows(rows, self._rows.in_use, distinct=False)
        return self._rows.num_tokens[rows_np], self._rows.num_computed[rows_np]

    @reading
    def num_computed_tokens(self, request_id: str) -> int:
        """Tokens of the request computed so far, its hit included (host only)."""
        return int(self._rows.num_computed[self._state(request_id)])

    @reading
    def get_num_common_prefix_blocks(self, request_id: str, num_running_requests: int) -> list[int]:
        """Per group, how many leading blocks of this request every one of the
        ``num_running_requests`` running requests holds (vLLM's, for cascade
        attention): blocks whose count equals that number, up to the first
        that does not; a sliding-window group gives 0. Reads the device."""
        row = self._state(request_id)
        count = check_count(num_running_requests, "num_running_requests")
        n = self._num_blocks(row)
        refs = self._read(self.pool.ref_cnt[self._rows.block_table[:, row, :n].long()])
        return [0 if w is not None else common_prefix_length(r, count)
                for w, r in zip(self.sliding_windows, refs, strict=True)]

    @reading
    def block_hashes(self, request_id: str) -> list[bytes]:
        """The digests of the request's full known blocks; reads the device."""
        row = self._state(request_id)
        n = int(self._rows.num_tokens[row]) // self.block_size
        lanes = np.array(self._read(self._rows.digests[row, :n]), dtype=np.int64)
        return hashing.lanes_to_digests(lanes.reshape(-1, 2))

    @mutating
    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """The prefix-cache stats since the last call (then zeroed); host only."""
        self._begin_changes()
        stats, self._stats = self._stats, PrefixCacheStats()
        stats.reset = self._reset_flag
        self._reset_flag = False
        return stats

    @mutating
    def reset_prefix_cache(self) -> bool:
        """Forget every cached block, when no request holds a block (else
        False, nothing changed); reads the device."""
        self._begin_changes()
        if self.read_num_free_blocks() != self.num_blocks - 1:
            return False
        if self._events is not None:
            if self._events.bound:  # what came before the reset, first
                self._drained(self._read(torch.cat(self._drain_parts())))
            self._event_queue.add([AllBlocksCleared()])
        self.pool.reset_prefix_cache()
        self._reset_flag = True
        return True

    @reading
    def check_invariants(self, *, verify_digests: bool = True) -> None:
        """The pool's invariants (see ``DevicePool.check_invariants``), and each
        block's count equals the number of block-table rows that hold it."""
        self._check_invariants(verify_digests)

    def _check_invariants(self, verify_digests: bool) -> None:
        self.pool.check_invariants(self._key, verify_digests=verify_digests)
        held = np.zeros(self.num_blocks, dtype=np.int64)
        bt = self._rows.block_table.cpu().numpy()
        for row in self._reqs.values():
            for g in range(self.num_groups):
                for b in bt[g, row, : self._num_blocks(row)]:
                    if b:
                        held[b] += 1
        assert held[1:].tolist() == self.pool.ref_counts()[1:], "reference counts disagree with the block tables"
        assert sorted(self._reqs.values()) == sorted(np.flatnonzero(self._rows.in_use).tolist()), "row leak"

    # ----------------------------------------------------- request-level API
    @mutating
    def get_computed_blocks(self, request: NewRequest) -> ComputedBlocks:
        """Look a new request up (counts in the stats); changes no block."""
        (request,) = self._normalize((), (), [request], single=True, defer_admissible=True).new
        with self._counting():  # (the point of first change is in the lookup: counting it in the stats)
            return self._lookup_only(request, count_stats=True)

    @mutating
    def allocate_slots(self, request: NewRequest | str, new_token_ids: Sequence[int] = (),
                       computed: ComputedBlocks | None = None, num_tokens: int | None = None,
                       num_lookahead_tokens: int | None = None) -> list[list[int]] | None:
        """vLLM's ``allocate_slots(request, num_tokens, new_computed_blocks,
        num_lookahead_tokens)``, with the reference's arguments and results
        (``gpukv.reference.ReferenceManager.allocate_slots``); reads the device
        (the step's status, then the new block ids)."""
        if isinstance(request, NewRequest):
            if len(normalize_token_ids(new_token_ids, "new_token_ids")):
                raise InvalidInputError("a new request brings its tokens in NewRequest.token_ids",
                                        argument="new_token_ids", fix="pass new_token_ids=() with a NewRequest")
            (request,) = self._normalize((), (), [request], single=True, defer_admissible=True).new
            computed = normalize_computed(computed, self._limits)
            check_computed_for(request, computed, self._limits)
            request = apply_allocate_args(request, computed.num_tokens if computed is not None else 0, num_tokens,
                                          num_lookahead_tokens, self._limits)
            with self._counting():
                cap = 0
                if computed is not None:
                    # Checked before anything changes: the given hit must still be
                    # what a lookup capped at its length finds now (a longer hit
                    # would move a window group's null blocks).
                    cap = computed.num_tokens // self.block_size
                    now = self._lookup_only(request, count_stats=False, hit_cap=cap)
                    if now.num_tokens != computed.num_tokens or any(
                            list(computed.block_ids[g]) != now.block_ids[g] for g in range(self.num_groups)):
                        raise stale_computed_blocks()
                # (the dry lookup above wrote only a free row and scratch buffers)
                self._begin_changes()
                res = self._step((), (), [request], count_stats=False, hit_caps=[cap])
            if res.num_admitted == 0:
                return None
            got = res.num_computed_tokens[0]
            blocks = self.get_block_ids(request.request_id)
            return [g[got // self.block_size:] for g in blocks]
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
        before = self._num_blocks(self._state(request))
        self._begin_changes()
        with self._counting():
            res = self._step((), [update], ())
        if not res.ok:
            return None
        return [g[before:] for g in self.get_block_ids(request)]

    @mutating
    def free(self, request_id: str) -> None:
        """Give back a request's blocks (tail first, group by group) and forget it."""
        (request_id,) = self._normalize([request_id], (), (), single=True).finished
        self._begin_changes()
        with self._counting():
            self._step([request_id], (), ())

    @mutating
    def step(self, finished: Sequence[str] = (), running: Sequence[RunningUpdate] | RunningBatch = (),
             new: Sequence[NewRequest] = (), *, token_budget: int | None = None, block_ids: bool = False,
             prefix_of: str | None = None, graphs=None) -> StepResult:
        """The batched step; same phases, arguments and results as the
        reference's (``gpukv.reference.ReferenceManager.step``), and the same
        argument checks (``gpukv.request.normalize_step``): a refused call
        raises a ``gpukv.errors`` class and changes nothing.
        ``token_budget`` (vLLM's waiting loop, applied on the device in the
        admission): the tokens the new requests may compute beyond their hits,
        None for no budget. A ``RunningBatch`` runs as ``decode`` does (its
        plan, kept launches, and no read when the host's bound says it fits).
        ``block_ids`` and ``prefix_of`` come back in the step's one read
        (``gpukv.outputs``). ``graphs`` (a ``gpukv.graphs.AdmissionGraphs``)
        replays the admission's kernels as CUDA graphs instead of launching
        them."""
        step, batch = self._normalize_step(finished, running, new)
        token_budget = check_token_budget(token_budget)
        outputs = check_step_outputs(block_ids, prefix_of, self._reqs, step.finished, step.new)
        self._begin_changes()
        with self._counting():
            return self._step(list(step.finished), list(step.running) if batch is None else batch, list(step.new),
                              token_budget=token_budget, graphs=graphs, outputs=outputs)

    def _normalize_step(self, finished, running, new) -> tuple[Step, RunningRows | None]:
        """``step()``'s arguments checked; a ``RunningBatch`` apart."""
        if not isinstance(running, RunningBatch):
            return self._normalize(finished, running, new), None
        step = self._normalize(finished, (), new)
        return step, self._normalize_running(running, [self._reqs[rid] for rid in step.finished])

    @mutating
    def decode(self, rows: Sequence[int] | np.ndarray, new_token_ids, *, num_new_tokens=None,
               num_tokens_to_compute=None, num_lookahead_tokens=0, graphs=None) -> StepResult:
        """The running requests at ``rows`` (``StepResult.rows`` / ``row_of``)
        each append their new tokens and get their blocks: the same result as
        ``step(running=[RunningUpdate(id, tokens, chunk, lookahead) ...])`` in
        row order (``running_failed_at`` indexes ``rows``), at a host cost
        that does not grow with the batch. The arguments are
        ``gpukv.RunningBatch``'s (``gpukv.running``).

        ``rows``: host ints (list, numpy or CPU tensor), distinct, each a
        running request's. ``new_token_ids``: ``[B]``, ``[B, k]``, or None
        (``k = 0``: the rows only continue a chunked prefill); with
        ``num_new_tokens`` (one count per row) a flat host list of every
        row's tokens (a ragged batch). A tensor on the manager's CUDA device
        (a model runner's sampled tokens) is read only by the device, which
        checks each id is in ``[0, 2**32)``: an id out of range is never
        cached (``kernels/decode.py``: ``POISON``) and stops the manager at
        the step's read, or the next step's when this one reads nothing (a
        fault: the step has changed state by then). Anything else (lists,
        numpy, CPU tensors) is checked on the host, as ``step()``'s tokens
        are, before anything changes.
        ``num_tokens_to_compute``: None (each row computes every known token)
        or one chunk per row; ``num_lookahead_tokens``: slots reserved beyond
        the computed tokens (speculative decoding), one int or one per row,
        never cached.

        The host plans the step with numpy (no Python per request) into one
        int32 buffer, uploads it through pinned memory, and launches a fixed
        sequence of kernels per batch bucket (rows padded to a power of two);
        ``gpukv.graphs.DecodeGraphs`` replays that sequence as a CUDA graph.
        The host reads the device only when its lower bound of free blocks
        does not cover the batch (then once, with the kernels' error words).
        ``graphs`` (a ``gpukv.graphs.DecodeGraphs``) replays the kernels as
        a CUDA graph instead of launching them.
        """
        run = self._normalize_running(RunningBatch(rows, new_token_ids, num_new_tokens, num_tokens_to_compute,
                                                   num_lookahead_tokens))
        if not len(run.rows):
            return StepResult()
        self._begin_changes()
        with self._counting():
            plan, bufs = self._launch_running(run, graphs)
            return self.finish_decode(plan, bufs)

    def _normalize_running(self, batch: Any, finished_rows: Sequence[int] = ()) -> RunningRows:
        """A ``RunningBatch`` checked (``gpukv.running.normalize_running``);
        ``finished_rows``: rows the same step frees first (not running then)."""
        rows = self._rows
        in_use = rows.in_use
        if finished_rows:
            in_use = in_use.copy()
            in_use[list(finished_rows)] = False
        return normalize_running(batch, in_use, rows.num_tokens.__getitem__, rows.num_computed.__getitem__,
                                 self._limits, self.device)

    def _launch_running(self, run: RunningRows, graphs=None) -> tuple[DecodePlan, DecodeBuffers]:
        """Plan, stage and launch a running batch (``decode``'s kernels); the
        host's mirror is brought up to date by ``finish_decode``."""
        plan = self.plan_decode(run.rows, run.tokens.shape[1], run.num_tokens, chunks=run.chunks,
                                lookahead=run.lookahead, num_new=run.counts)
        bufs = self.stage_decode(plan, run.tokens)
        if graphs is not None:
            graphs.launch(plan.bucket, bufs)
        else:
            self.launch_decode(plan.bucket, bufs, plan.phases)
        return plan, bufs

    # --------------------------------------------------------- decode, in parts
    # ``decode`` is these four calls; ``gpukv.graphs`` runs the same plan,
    # stage and finish around a captured ``launch_decode``.
    def plan_decode(self, rows: np.ndarray, k: int, num_tokens: np.ndarray | None = None, *,
                    chunks: np.ndarray | None = None, lookahead: int | np.ndarray = 0,
                    num_new: np.ndarray | None = None) -> DecodePlan:
        """The host plan of a decode of ``k`` tokens for each of ``rows``
        (``num_new``: fewer for some, at most ``k`` each; checked by
        ``decode``): per row its token counts (known, computed before and
        after), the blocks it holds and needs and the running total of those
        (the device derives every entry from these, ``kernels/decode.py``),
        and the window releases; a few vectorised numpy operations, no Python
        per request. ``num_tokens``: the rows' known token counts, when the
        caller has them already; ``chunks``: tokens each row computes (None:
        all it knows after the append); ``lookahead``: slots per row (or for
        every row) beyond them."""
        self._raise_if_failed()  # (a part of decode, refused after a fault as any call)
        bs, G = self.block_size, self.num_groups
        B = len(rows)
        n = self._rows.num_tokens[rows] if num_tokens is None else num_tokens
        comp0, held0 = self._rows.num_computed[rows], self._rows.num_held[rows]
        ntok1 = n + (k if num_new is None else num_new)
        comp1 = ntok1 if chunks is None else comp0 + chunks
        blocks_of = self._blocks_of  # (a shift where the block size is a power of two)
        held1 = np.maximum(held0, blocks_of(comp1 + (lookahead + bs - 1)))  # lookahead blocks held are kept
        need_pg = held1 - held0
        need = need_pg * G if G > 1 else need_pg  # new blocks, all groups
        cum = np.add.accumulate(need)
        filled = blocks_of(comp1) - blocks_of(comp0)
        # Entries per row and group: what a plain decode of k tokens can need
        # (so a steady decode keeps one bucket), more when a row needs more.
        need_max, filled_max = int(_max(need_pg)), int(_max(filled))
        la_max = lookahead if type(lookahead) is int else int(_max(lookahead))
        A = max(-(-(k + la_max) // bs), pow2_at_least(need_max))
        C = max(-(-k // bs), pow2_at_least(filled_max))
        wg = self._window_groups
        stops: np.ndarray | None = None
        if wg:
            starts = self._rows.null_until[rows]
            stops = self._window_stops(comp0, starts)
            released = (stops - starts)[:, wg]
            L = pow2_at_least(max(1, int(released.max())))
        else:
            stops, L = None, 0
        bucket = (pow2_at_least(max(B, 8)), k, L, A, C)
        if self._events is not None:  # (each phase's event entries are drained whether it ran or not)
            phases = _ALL_DECODE_PHASES
        else:  # the phases with work: a block to release, to pop, to hash (a known one filled), to cache
            # (a known block fills whether or not a computed one does: a row appending beyond its chunk)
            fills_known = k > 0 and int(_max(n % bs + (k if num_new is None else num_new))) >= bs
            phases = _decode_phases(bool(wg) and int(released.max()) > 0, need_max > 0, fills_known, filled_max > 0)
        v = self._host_plan(bucket)
        v["rows"][:B] = rows
        v["ntok"][:B] = n
        v["nnew"][:B] = k if num_new is None else num_new
        v["comp0"][:B] = comp0
        v["comp1"][:B] = comp1
        v["held"][:B] = held0
        v["need"][:B] = need_pg
        v["cum"][:B] = cum
        if v["padded_from"] != B:  # (the rows past the batch: no row, beyond every total)
            v["rows"][B:] = -1
            v["cum"][B:] = decode_ops.BIG
            v["padded_from"] = B
        if stops is not None and L:
            ell = np.arange(L)
            v["r_row"][:B] = rows[:, None, None]
            v["r_pos"][:B] = np.maximum(stops[:, wg][:, :, None] - 1 - ell, 0)
            v["r_valid"][:B] = ell < released[:, :, None]
            v["r_valid"][B:] = 0
        total = int(cum[-1])
        return DecodePlan(rows, bucket, total, cum, held0, ntok1, comp1, held1, stops,
                          total <= self._free_lower_bound, phases)

    def _host_plan(self, bucket: tuple):
        """Named views of this step's host plan array of the bucket (the
        uploaded part of its layout: ``Staging.host_array``, written in place
        and sent as it is), with the parts that never change filled in."""
        parity = self._staging.parity
        cached = self._host_plans.get((bucket, parity))
        if cached is not None:
            return cached
        BP, L = bucket[0], bucket[2]
        uploaded = [(name, size) for name, size in self._decode_layout(bucket) if name in _UPLOADED]
        packed = self._staging.host_array(("decode", bucket), sum(size for _, size in uploaded))
        views: dict[str, Any] = {}
        off = 0
        for name, size in uploaded:
            views[name] = packed[off: off + size]
            off += size
        if L:
            W, G = len(self._window_groups), self.num_groups
            for name in ("r_grp", "r_row", "r_pos", "r_call", "r_valid"):
                views[name] = views[name].reshape(BP, W, L)
            views["r_grp"][:] = np.array(self._window_groups)[None, :, None]
            views["r_call"][:] = np.arange(BP)[:, None, None] * G + views["r_grp"]
        views["padded_from"] = -1  # the batch size whose padding the views hold (none yet)
        self._host_plans[(bucket, parity)] = views
        return views

    def stage_decode(self, plan: DecodePlan, tokens) -> DecodeBuffers:
        """Upload the plan and the new tokens into the bucket's fixed buffers
        (pinned, non-blocking; tokens already on the device are copied there)."""
        self._raise_if_failed()  # (a part of decode, refused after a fault as any call)
        bufs = self._decode_buffers(plan.bucket)
        self._staging.upload_host(("decode", plan.bucket), bufs.uploaded)
        B = len(plan.rows)
        if isinstance(tokens, torch.Tensor):
            bufs.new_tokens[:B].copy_(tokens)  # as int64 (int32 sign-extended): decode_fit checks the range
        else:
            self._staging.upload(tokens, out=bufs.new_tokens)  # int64, checked on the host
        return bufs

    def launch_decode(self, bucket: tuple, bufs: DecodeBuffers, phases: frozenset[str] | None = None) -> None:
        """The decode step's kernels: for a bucket, a fixed sequence reading
        only its fixed buffers and the pool (what a CUDA graph captures:
        ``phases`` None, every phase). An eager step passes its plan's
        ``phases`` and launches nothing for a phase with no work (a launch
        costs host time whatever it does). The first step of a bucket to run
        a phase runs its launchers and keeps the launches; later steps replay
        them, skipping the launchers' Python."""
        self._raise_if_failed()  # (a part of decode, refused after a fault as any call)
        key = _ALL_DECODE_PHASES if phases is None else phases
        kept = bufs.runs.get(key)
        if kept is not None and kept[0] == self.rows_generation and self._events is None:
            _common.run_prepared(kept[1])  # (the phases' kept launches, in order: no lookup per phase)
            return
        run = [p for p in DECODE_PHASES if p in key and (p != "release" or bucket[2])]  # (no window group: none)
        for phase in run:
            self._replayed(bufs.prepared, _DECODE_PART[phase], lambda p=phase: self._launch_decode_phase(p, bufs))
        if self._events is None:
            gen = self.rows_generation
            bufs.runs[key] = (gen, [one for p in run for one in bufs.prepared[_DECODE_PART[p]][1]])

    def _launch_decode_phase(self, phase: str, bufs: DecodeBuffers) -> None:
        v, pool = bufs.views, self.pool
        if phase == "release":  # window groups release what their window left behind
            pool.release(self._rows.block_table, v["r_grp"], v["r_row"], v["r_pos"], v["r_call"], valid=v["r_valid"],
                         scratch=bufs.release_scratch, workspace=bufs.release_workspace)
        elif phase == "fit":
            decode_ops.decode_fit(v["rows"], v["ntok"], v["nnew"], v["comp0"], v["comp1"], v["held"], v["need"],
                                  v["cum"], v["h_start"], v["h_count"], v["alloc"], v["record"], bufs.new_tokens,
                                  tokens=self._rows.tokens, extras=self._rows.extras,
                                  fq_counters=pool.free_queue.counters, count=bufs.count,
                                  status=bufs.status, blocked=self._blocked, num_groups=self.num_groups,
                                  block_size=self.block_size)
        elif phase == "allocate":
            grp, row, pos, want, rank = v["alloc"]
            pool.allocate(bufs.count, want, grp, row, pos, block_table=self._rows.block_table, rank=rank,
                          popped=bufs.popped, on_popped=self._popped_hook())
        elif phase == "hash":
            self._hash_launch(v["rows"], v["h_start"], v["h_count"])
        else:
            self._cache_blocks(*v["record"], scratch=bufs.record_scratch, seq=bufs.record_seq)

    def finish_decode(self, plan: DecodePlan, bufs: DecodeBuffers) -> StepResult:
        """Bring the host's mirror up to date; reads the device only when the
        host could not tell that the whole batch fits. (Also the table's
        rebuild when due: decided on the host, never part of a graph.)"""
        self._raise_if_failed()  # (a part of decode, refused after a fault as any call)
        B = len(plan.rows)
        self._expect_events(bufs.views["alloc"].shape[1] + bufs.views["record"].shape[1])
        if plan.fits_known:
            n_fit = B
            self._free_lower_bound -= plan.num_new_blocks
        else:
            parts = self._drain_parts()
            status = self._read(torch.cat([bufs.status, *parts]) if parts else bufs.status)
            if parts:
                self._drained(status[decode_ops.NUM_STATUS:])
            self._check_errors(status[decode_ops.ST_QUEUE_ERRORS], "new_token_ids")
            n_fit = int(status[decode_ops.ST_FIT])
            self._free_lower_bound = int(status[decode_ops.ST_FREE_AFTER])
        self._finish_running(plan, n_fit)
        return StepResult(running_failed_at=None if n_fit == B else n_fit)

    def _finish_running(self, plan: DecodePlan, n_fit: int) -> None:
        """The host's mirror after a running batch of which the first
        ``n_fit`` rows got their blocks (every row released behind its
        window), and the table's rebuild when what they popped makes it due
        (after the fit is known: rows that did not fit popped nothing)."""
        self._rebuild_if_due(plan.blocks_popped(n_fit))
        rows, done = self._rows, plan.rows[:n_fit]
        rows.num_tokens[done], rows.num_computed[done], rows.num_held[done] = (
            plan.num_tokens[:n_fit], plan.computed[:n_fit], plan.held[:n_fit])
        if plan.window_stops is not None:
            rows.null_until[plan.rows] = plan.window_stops

    def _decode_layout(self, bucket: tuple) -> list[tuple[str, int]]:
        """(name, length) of each int32 array of a bucket's device plan, in
        order: first the ones the host uploads (``_UPLOADED``), then the ones
        ``decode_fit`` writes (``kernels/decode.py``)."""
        BP, k, L, A, C = bucket
        G, W = self.num_groups, len(self._window_groups)
        names = [(x, BP) for x in ("rows", "ntok", "nnew", "comp0", "comp1", "held", "need", "cum")]
        names += [(f"r_{x}", BP * W * L) for x in ("grp", "row", "pos", "call", "valid")] if L else []
        return names + [("h_start", BP), ("h_count", BP), ("alloc", 5 * BP * G * A), ("record", 4 * BP * G * C)]

    def _decode_buffers(self, bucket: tuple) -> DecodeBuffers:
        bufs = self._decode_bufs.get(bucket)
        if bufs is not None:
            return bufs
        BP, k = bucket[:2]
        dev = self.device
        sizes = dict(self._decode_layout(bucket))
        EA, E, ER = sizes["alloc"] // 5, sizes["record"] // 4, max(sizes.get("r_grp", 0), 1)
        plan = torch.zeros(sum(sizes.values()), dtype=torch.int32, device=dev)
        views, off = {}, 0
        for name, size in sizes.items():
            views[name] = plan[off: off + size]
            off += size
        views["alloc"], views["record"] = views["alloc"].view(5, EA), views["record"].view(4, E)
        uploaded = sum(size for name, size in sizes.items() if name in _UPLOADED)
        bufs = DecodeBuffers(
            plan=plan, uploaded=plan[:uploaded], views=views,
            new_tokens=torch.zeros((BP, k), dtype=torch.int64, device=dev),
            count=torch.zeros(1, dtype=torch.int64, device=dev),
            status=torch.zeros(decode_ops.NUM_STATUS, dtype=torch.int64, device=dev),
            popped=torch.zeros(EA, dtype=torch.int32, device=dev),
            release_scratch=torch.zeros((2, ER), dtype=torch.int32, device=dev),
            release_workspace=torch.zeros(ER, dtype=torch.int64, device=dev),
            record_scratch=torch.zeros((4, E), dtype=torch.int64, device=dev),
            record_seq=torch.zeros(E, dtype=torch.int64, device=dev))
        self._decode_bufs[bucket] = bufs
        return bufs

    # -------------------------------------------------------------- internals
    def _state(self, request_id: str) -> int:
        """The row of a running request (InvalidTypeError for an id that is
        not a plain str, UnknownRequestError for one not held)."""
        if type(request_id) is not str:
            raise request_id_type_error(request_id, "request_id")
        try:
            return self._reqs[request_id]
        except KeyError:
            raise unknown_request(request_id) from None

    def _num_blocks(self, row: int) -> int:
        return int(self._rows.num_held[row])

    def _normalize(self, finished, running, new, *, single: bool = False, defer_admissible: bool = False) -> Step:
        """Every argument checked and normalised (``gpukv.request``), before anything changes."""
        return normalize_step(finished, running, new, known=self._reqs, limits=self._limits,
                              num_tokens=lambda rid: int(self._rows.num_tokens[self._reqs[rid]]),
                              num_computed=lambda rid: int(self._rows.num_computed[self._reqs[rid]]), single=single,
                              defer_admissible=defer_admissible)

    def _counting(self) -> _StepAccounting:
        """One step's accounting (``counters``) and staging buffer; nested
        calls (a lookup inside an admission) count in the outer step."""
        return _StepAccounting(self)

    def _read(self, t: torch.Tensor) -> list:
        """A device-to-host read (counted): the host waits for the GPU (on the
        manager's stream: ``read_num_free_blocks`` and the like are not
        wrapped calls)."""
        self.counters.d2h += 1
        entered = self._enter_stream()
        try:
            return t.cpu().tolist()
        finally:
            if entered is not None:
                self._leave_stream(entered, None)

    def _enter_stream(self) -> tuple | None:
        """Order a call made on another stream than the manager's (module
        docstring, "Streams"): the manager's stream waits for the caller's,
        and the call runs on the manager's. None (nothing to undo) without
        CUDA, or when the caller is on the manager's stream (a nested call
        always is)."""
        own = self._stream
        if own is None:
            return None
        caller = torch.cuda.current_stream(self.device)
        if caller == own:
            return None
        own.wait_stream(caller)
        switch = torch.cuda.stream(own)
        switch.__enter__()
        return caller, switch

    def _leave_stream(self, entered: tuple, out: Any) -> None:
        """Back on the caller's stream, which waits for the manager's; a
        device tensor the call returns is marked used there (the allocator
        then does not hand its memory to the manager's stream while the
        caller's kernels may still read it)."""
        caller, switch = entered
        switch.__exit__(None, None, None)
        caller.wait_stream(self._stream)
        if isinstance(out, torch.Tensor) and out.device.type == "cuda":
            out.record_stream(caller)

    def _device_tokens_bad(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """int64[1] on the device: ``ERR_BAD_TOKEN`` if any id of these token
        tensors (``step()``'s and lookups' tokens on the device, which the
        host never reads) is outside ``[0, 2**32)``, else 0. A step ORs it
        into the free queue's sticky error word, which its read raises
        (``_check_errors``); a lookup reads it with the hit. A few torch
        operations per tensor, only on this path (the batched decode checks
        in its kernel)."""
        bad = torch.zeros(1, dtype=torch.int64, device=self.device)
        for t in tensors:
            out = (t < 0).any() if t.dtype == torch.int32 else (torch.bitwise_right_shift(t, 32) != 0).any()
            bad.bitwise_or_(out.to(torch.int64) * decode_ops.ERR_BAD_TOKEN)
        return bad

    def _check_errors(self, queue_errors: int, tokens_argument: str = "token_ids") -> None:
        """Raise when the free queue's sticky error word (as a read brought
        it) is set: ``ERR_BAD_TOKEN`` (token ids on the device out of range;
        an input error, but found after the step changed state, so a fault)
        or a kernel's broken contract."""
        if queue_errors & decode_ops.ERR_BAD_TOKEN:
            raise InvalidInputError(
                "token ids handed over on the device were outside [0, 2**32) (negative, or past uint32), in this "
                "step or an earlier one that read nothing; a step's read finds them only after the step changed "
                "state, so the manager stops (no call returned a hit on them)", argument=tokens_argument,
                fix="hand over only ids in [0, 2**32) (check the sampler's output, e.g. no -1 placeholders)")
        if queue_errors:
            raise RuntimeError(f"free-queue error flags {queue_errors:#x} set on the device: a kernel broke the "
                               "queue's contract (a bug; the manager stops)")

    def _on_popped(self, popped: torch.Tensor) -> None:
        """Removal events for the popped blocks that are still cached."""
        assert self._events is not None  # (only hooked with events on)
        self._events.removes(popped, self.pool.table)

    def _popped_hook(self):
        return self._on_popped if self._events is not None else None

    def _expect_events(self, num_entries: int) -> None:
        """Launches with this many entries may write events: a drain reads that many rows more."""
        if self._events is not None:
            self._events.bound += num_entries

    def _drain_parts(self) -> list[torch.Tensor]:
        return self._events.drain_parts() if self._events is not None else []

    def _drained(self, values: list) -> None:
        """The events a read brought, as one batch (an overflow is reported)."""
        assert self._events is not None  # (only read with events on)
        events, dropped = self._events.drained(values)
        if dropped:
            warnings.warn(f"gpukv: {dropped} KV-cache events were dropped (more than {self._events.capacity} "
                          "between two reads of the device); the batch says how many", RuntimeWarning,
                          stacklevel=3)
        self._event_queue.add(events, dropped)

    @mutating
    def take_events(self) -> list[KVEventBatch]:
        """The KV-cache event batches made since the last call (``gpukv.events``),
        oldest first; empty unless built with ``enable_kv_cache_events``. A
        batch is made at each read of the step status; events of steps that
        read nothing (a decode the host proved fits) are read here, one read."""
        self._begin_changes()
        if self._events is not None and self._events.bound:
            with self._counting():
                self._drained(self._read(torch.cat(self._drain_parts())))
        return self._event_queue.take()

    def _up(self, a, dtype=np.int32) -> torch.Tensor:
        """A host array on the device (pinned staging, non-blocking)."""
        return self._staging.upload(np.asarray(a, dtype=dtype))

    def _window_stops(self, num_tokens: np.ndarray, starts: np.ndarray) -> np.ndarray:
        """Per (request, group): where the null blocks end once the window
        groups release what ``num_tokens`` computed tokens no longer see."""
        stops = starts.copy()
        for g in self._window_groups:
            stops[:, g] = np.maximum(self._policies[g].skipped(num_tokens), starts[:, g])
        return stops

    def _hash_launch(self, rows_t, starts_t, counts_t) -> None:
        """Chained digests of blocks ``[start, start + count)`` of each row, on
        the device, from the tokens and extra digests already there."""
        args = (self._key_dev, rows_t, starts_t, counts_t)
        kw: dict[str, Any] = dict(tokens=self._rows.tokens, digests=self._rows.digests, extras=self._rows.extras,
                                  root=self._root_lanes, block_size=self.block_size)
        if _hash_rows is hash_rows_host:  # the interpreter's host stand-in: counted and timed as a kernel
            _common.host_launch("block_hash._hash_rows_kernel", hash_rows_host, *args, **kw)
        else:
            _hash_rows(*args, **kw)

    def _rebuild_if_due(self, max_popped: int) -> None:
        """The hash table's rebuild, when the host's bound on its tombstones
        says it is due (``DevicePool.rebuild_if_due``); a step calls it after
        its pops and outside its prepared launches and graphs, which are the
        same every step."""
        if self.enable_caching and max_popped:  # (no cached block, no tombstone)
            self.pool.rebuild_if_due(max_popped)

    def _cache_blocks(self, grp, rw, ps, valid, *, scratch=None, seq=None) -> None:
        """Cache the blocks at the valid (group, row, position) entries (the
        pool's ``record``), with their stored-block events."""
        if not self.enable_caching:
            return
        rows = self._rows
        inserted = self.pool.record(grp, rw, ps, valid, block_table=rows.block_table, tokens=rows.tokens,
                                    digests=rows.digests, extras=rows.extras, root=self._root_lanes, scratch=scratch,
                                    seq=seq)
        if self._events is not None and inserted is not None:
            blk, ok, key = inserted
            self._events.stores(ok, blk, key, grp, rw, ps, blk_parent=self.pool.blk_parent,
                                blk_tokens=self.pool.blk_tokens, row_lora=self._rows.lora)

    # The step ----------------------------------------------------------------
    def _step(self, finished, running, new, *, count_stats: bool = True, hit_caps=None,
              token_budget: int | None = None, graphs=None, outputs: StepOutputs = _NO_OUTPUTS) -> StepResult:
        """A step on normalised arguments (``_normalize``): nothing here refuses input."""
        if finished:  # phase 1
            self._release_requests(finished)
        run = self._run_phase(running)  # phase 2
        lead = [run.n_ok] if run is not None and run.n_ok is not None else []  # (rides on the step's read)
        if not self.enable_caching:
            hit_caps = [0] * len(new)  # no lookup: every hit is 0
        result = StepResult()
        tail = self._output_gather(run, outputs, new) if outputs.block_ids or outputs.prefix_of is not None else None
        # The one device-to-host read of the step (none when nothing is unknown),
        # and one more per admission round after a deferral.
        host, deferred = None, False
        if new:  # phases 3-5
            deferred, host = self._admission_round(new, result, hit_caps, token_budget, count_stats, graphs, lead,
                                                   tail)
        elif lead or tail is not None:
            host = self._read_step_status(lead + ([] if tail is None else tail.parts()))
            if tail is not None:
                tail.took(host[len(lead):])
        if run is not None:
            n_ok = int(host[0]) if lead and host is not None else run.size
            if not lead:  # no read: every update fit, and the bound drops by what they took
                self._free_lower_bound -= run.total
            run.finish(n_ok)
            result.running_failed_at = None if n_ok == run.size else n_ok
        while new and deferred:  # vLLM looks the rest up after the admitted ones' pops: another round
            deferred, _ = self._admission_round(new, result, hit_caps, token_budget, count_stats, graphs, (), tail)
        if tail is not None:
            self._take_outputs(result, run, outputs, tail)
        return result

    def _output_gather(self, run: _RunningPhase | None, outputs: StepOutputs, new) -> StepGather:
        """The step's output gather (``gpukv.outputs``): the running rows'
        new blocks, and ``prefix_of``'s blocks up to the most it holds after
        (a new request's: from its admission's own entries)."""
        running = None if run is None else (run.rows, run.held_before, run.held_after)
        prefix = prefix_new = None
        if outputs.prefix_of is not None and outputs.prefix_of not in self._reqs:
            prefix_new = next(i for i, r in enumerate(new) if r.request_id == outputs.prefix_of)
        elif outputs.prefix_of is not None:
            row = self._reqs[outputs.prefix_of]
            n = int(self._rows.num_held[row])
            at = np.flatnonzero(run.rows == row) if run is not None else np.zeros(0, np.int64)
            if run is not None and len(at):
                n = int(run.held_after[at[0]])  # (if it fits; the read says, and _take_outputs cuts)
            prefix = (row, n)
        return StepGather(self._gather, running, prefix, outputs.block_ids, self.num_groups, prefix_new)

    def _take_outputs(self, result: StepResult, run: _RunningPhase | None, outputs: StepOutputs,
                      tail: StepGather) -> None:
        """What the step hands back, from its last read's gather."""
        n_fit = 0 if run is None else run.size if result.running_failed_at is None else result.running_failed_at
        row = None if outputs.prefix_of is None else self._reqs.get(outputs.prefix_of)
        held = 0 if row is None else int(self._rows.num_held[row])
        running, admitted, prefix = tail.finish(n_fit, held, self.sliding_windows)
        if outputs.block_ids:
            result.running_block_ids, result.admitted_block_ids = running, admitted
        if row is not None:
            result.prefix_ref_counts = prefix

    def _run_phase(self, running) -> _RunningPhase | None:
        """Phase 2 launched, as the batched decode runs it (its plan and kept
        launches, ``_launch_running``): a normalised ``RunningBatch``, or
        ``RunningUpdate``s laid out as one (``_running_rows``); None when
        nothing runs. Whether all fit rides on the step's read unless the
        host's bound covers them (tokens on the device: always, so that an id
        out of range raises in this step). The admission's kernels read
        ``_blocked``, which ``decode_fit`` writes."""
        if not isinstance(running, RunningRows):
            running = self._running_rows(running) if running else None
        if running is None or not len(running.rows):
            self._blocked.zero_()
            return None
        plan, bufs = self._launch_running(running)
        self._expect_events(bufs.views["alloc"].shape[1] + bufs.views["record"].shape[1])
        read = not plan.fits_known or isinstance(running.tokens, torch.Tensor)
        n_ok = bufs.status[decode_ops.ST_FIT: decode_ops.ST_FIT + 1] if read else None
        return _RunningPhase(plan.rows, plan.held_before, plan.held, plan.num_new_blocks, n_ok,
                             lambda n: self._finish_running(plan, n))

    def _running_rows(self, running: Sequence[RunningUpdate]) -> RunningRows:
        """Normalised ``RunningUpdate``s as the batch they are: rows, their
        tokens padded into ``[B, K]`` rows (a device tensor when any update's
        are on the device), chunks and lookahead per row."""
        rows = np.fromiter((self._reqs[u.request_id] for u in running), np.int64, len(running))
        adds = [u.new_token_ids for u in running]
        counts = np.fromiter((len(a) for a in adds), np.int64, len(adds))
        width = int(counts.max())
        if any(isinstance(a, torch.Tensor) for a in adds):  # (kept on the device, unread: decode_fit checks them)
            tokens: Any = torch.zeros((len(adds), width), dtype=torch.int64, device=self.device)
            for i, a in enumerate(adds):
                tokens[i, : len(a)] = torch.as_tensor(a, device=self.device)
        else:
            tokens = np.zeros((len(adds), width), dtype=np.int64)
            if width:
                tokens[np.arange(width)[None, :] < counts[:, None]] = np.concatenate(adds)
        num_tokens = self._rows.num_tokens[rows]
        remaining = num_tokens + counts - self._rows.num_computed[rows]
        chunks = np.fromiter((r if u.num_tokens_to_compute is None else u.num_tokens_to_compute
                              for u, r in zip(running, remaining.tolist(), strict=True)), np.int64, len(running))
        lookahead = np.fromiter((u.num_lookahead_tokens for u in running), np.int64, len(running))
        return RunningRows(rows, tokens, None if int(counts.min()) == width else counts, num_tokens, chunks,
                           lookahead)

    def _admission_round(self, new, result: StepResult, hit_caps, token_budget: int | None, count_stats: bool,
                         graphs=None, lead: Sequence[torch.Tensor] = (), tail: StepGather | None = None
                         ) -> tuple[bool, list]:
        """Admit the new requests after the ``result.num_admitted`` admitted
        so far (all of them in the step's first round; after a deferral,
        ``_admit_kernel``, the rest), with what the budget has left, in one
        read that also carries ``lead`` (int64[1] tensors); ``result`` grows.
        Returns whether it deferred again, and ``lead``'s values."""
        done = result.num_admitted
        rest = new[done:]
        budget_left = None if token_budget is None else token_budget - sum(result.num_new_tokens)
        rows = [self._rows.take() for _ in rest]
        try:
            status, hits, computed = self._admit_new(rest, rows, self._blocked,
                                                     None if hit_caps is None else hit_caps[done:],
                                                     token_budget=budget_left, graphs=graphs)
        except BaseException:
            self._rows.give_back_unused(rows)  # no row leaks, whatever went wrong
            raise
        gathered = [] if tail is None else tail.parts((np.asarray(rows, dtype=np.int64), self._most_blocks(rest)),
                                                      first=done)
        host = self._read_step_status([*lead, status[: lookup_ops.NUM_STATUS], hits.to(torch.int64),
                                       computed.to(torch.int64), *gathered])
        part = StepResult()
        deferred = self._finish_admission(rest, rows, host[len(lead):], part, count_stats)
        if tail is not None:
            adm = np.asarray(part.rows, dtype=np.int64)
            tail.took(host[len(lead) + lookup_ops.NUM_STATUS + 2 * len(rest):], adm, self._rows.num_held[adm])
        result.num_admitted += part.num_admitted
        result.num_computed_tokens += part.num_computed_tokens
        result.rows += part.rows
        result.num_new_tokens += part.num_new_tokens
        result.refused_hit_tokens = part.refused_hit_tokens
        return deferred, host[: len(lead)]

    def _most_blocks(self, new: Sequence[NewRequest]) -> np.ndarray:
        """The most block positions each new request can hold after its
        admission (its whole prompt computed, and its lookahead)."""
        bs = self.block_size
        return np.fromiter((-(-(len(r.token_ids) + r.num_lookahead_tokens) // bs) for r in new), np.int64, len(new))

    def _read_step_status(self, parts: list) -> list:
        """Read the step's status ``parts`` (int64), the free count and the free
        queue's sticky error word in one read (with the events drained so
        far); raises when the error word is set. Returns the parts' values."""
        fq = self.pool.free_queue
        parts = parts + [fq.counter("num_free"), fq.counter("error")]
        main = sum(t.numel() for t in parts)
        events = self._drain_parts()  # the events ride on the step's one read
        host = self._read(torch.cat(parts + events))
        if events:
            self._drained(host[main:])
        self._check_errors(host[main - 1])
        self._free_lower_bound = host[main - 2]
        return host[: main - 2]

    def _finish_admission(self, new, cand_rows: list[int], host: list, result: StepResult,
                          count_stats: bool) -> bool:
        """The admitted requests keep their rows; the others give theirs back.
        Returns whether the admission deferred the rest (``ST_DEFERRED``)."""
        K, S = len(new), lookup_ops.NUM_STATUS
        stat, hits, comp = host[:S], host[S: S + K], host[S + K: S + 2 * K]
        if count_stats:
            self._count_lookups(new, hits)
        admitted = int(stat[lookup_ops.ST_ADMITTED])
        bs = self.block_size
        result.num_admitted = admitted
        if admitted < K and hits[admitted] >= 0:  # looked up, then refused
            result.refused_hit_tokens = int(hits[admitted]) * bs
        result.num_computed_tokens = [int(h) * bs for h in hits[:admitted]]
        result.num_new_tokens = [int(c) - int(h) * bs for c, h in zip(comp[:admitted], hits[:admitted], strict=True)]
        result.rows = cand_rows[:admitted]
        if admitted:
            adm = np.asarray(cand_rows[:admitted], dtype=np.int64)
            h = np.asarray(hits[:admitted], dtype=np.int64)
            n = np.fromiter((len(r.token_ids) for r in new[:admitted]), np.int64, admitted)
            lookahead = np.fromiter((r.num_lookahead_tokens for r in new[:admitted]), np.int64, admitted)
            computed = np.asarray(comp[:admitted], dtype=np.int64)  # the admission's (``_admit_kernel``)
            self._rows.num_tokens[adm], self._rows.num_computed[adm] = n, computed
            self._rows.num_held[adm] = -(-(computed + lookahead) // bs)
            w = np.asarray(self._window_blocks, dtype=np.int64)
            self._rows.null_until[adm] = np.where(w < 0, 0, np.maximum(0, h[:, None] - w))
            for req, row in zip(new[:admitted], result.rows, strict=True):
                self._reqs[req.request_id] = row
                self._row_ids[row] = req.request_id
        self._rows.give_back_unused(cand_rows[admitted:])
        return bool(stat[lookup_ops.ST_DEFERRED])

    def _count_lookups(self, new, hits: list) -> None:
        """Stats of the lookups the admission made: every request it looked
        at (a hit >= 0; it stops after the first refused one)."""
        bs = self.block_size
        for req, h in zip(new, hits, strict=True):
            if h < 0:
                break
            n = 0 if req.skip_prefix_cache else len(req.token_ids)
            self._stats.record(num_tokens=n, num_hit_tokens=int(h) * bs, num_blocks=-(-n // bs), num_hit_blocks=int(h),
                               preempted=req.num_preemptions > 0)

    def _release_requests(self, request_ids: Sequence[str]) -> None:
        """Free whole requests: one free call per request and group, tail first."""
        rows = np.array([self._reqs.pop(rid) for rid in request_ids], dtype=np.int64)
        nb = self._rows.num_held[rows]
        idx, grp, ps, call = entry_layout(np.zeros((len(rows), self.num_groups), dtype=np.int64),
                                          np.repeat(nb[:, None], self.num_groups, 1), reverse=True)
        if len(idx):
            self._release_entries(rows[idx], grp, ps, call)
        for row in rows.tolist():
            del self._row_ids[row]
        self._rows.release(rows)

    def _release_entries(self, rows, grp, pos, call) -> None:
        """Release the blocks at these block-table entries: one upload into
        fixed buffers of a size bucket (entries padded to a power of two from
        16, the padding masked off), whose three launches the first release
        of the bucket keeps and later ones replay (``_replayed``), as the
        decode's: a free launched anew went through Triton's whole launch
        path three times, and its launchers' checks, every step that
        finished a request."""
        E = len(grp)
        EP = pow2_at_least(max(E, 16))
        bufs = self._release_buffers(EP)
        host = self._staging.host_array(("release", EP), 5 * EP).reshape(5, EP)
        host[:4, :E] = (grp, rows, pos, call)
        host[4, :E] = 1
        if E < EP:  # padding: no entry, and a call of its own after the last (calls never decrease)
            host[3, E:] = int(call[-1]) + 1
            host[4, E:] = 0
        self._staging.upload_host(("release", EP), bufs.plan)
        self._replayed(bufs.prepared, "release", lambda: self._launch_release(bufs))

    def _launch_release(self, bufs: ReleaseBuffers) -> None:
        grp, row, pos, call, valid = bufs.plan.view(5, -1)
        self.pool.release(self._rows.block_table, grp, row, pos, call, valid=valid, scratch=bufs.scratch,
                          workspace=bufs.workspace)

    def _release_buffers(self, EP: int) -> ReleaseBuffers:
        bufs = self._release_bufs.get(EP)
        if bufs is None:
            dev = self.device
            bufs = self._release_bufs[EP] = ReleaseBuffers(
                plan=torch.zeros(5 * EP, dtype=torch.int32, device=dev),
                scratch=torch.zeros((2, EP), dtype=torch.int32, device=dev),
                workspace=torch.zeros(EP, dtype=torch.int64, device=dev))
        return bufs

    def _up_packed(self, *arrays: np.ndarray) -> list[torch.Tensor]:
        """Int32 host arrays on the device in one upload: their views, each
        starting 32-byte aligned (Triton specialises pointers on it)."""
        sizes = [len(a) for a in arrays]
        starts = np.concatenate([[0], np.cumsum([-(-n // 8) * 8 for n in sizes])])
        packed = np.zeros(int(starts[-1]), dtype=np.int32)
        for a, o, n in zip(arrays, starts.tolist(), sizes, strict=False):  # starts has one more
            packed[o: o + n] = a
        dev = self._up(packed)
        return [dev[o: o + n] for o, n in zip(starts.tolist(), sizes, strict=False)]

    def _write_extra_keys(self, new: Sequence[NewRequest], rows: list[int]) -> None:
        """The extra-key digests of new requests that have extra keys (their
        rows were zeroed by the admission's first launch): their prompt
        blocks' (LoRA, multimodal items, salt) and, for every later block, the
        LoRA-only digest (later tokens carry no multimodal item or salt), so
        running steps and decodes never compute extra keys."""
        if self._events is not None:  # the LoRA id each row's stored blocks report
            lora = [(0, 0) if r.lora_id is None else (1, r.lora_id - 2**64 if r.lora_id >= 2**63 else r.lora_id)
                    for r in new]
            self._rows.lora[self._up(rows, np.int64)] = self._up(np.array(lora, dtype=np.int64).reshape(-1, 2),
                                                                np.int64)
        bs = self.block_size
        for r, row in zip(new, rows, strict=True):
            if r.lora_id is None and not r.mm_items and r.cache_salt is None:
                continue
            nb = -(-len(r.token_ids) // bs)
            ds = hashing.extra_key_digests(self._key, nb, bs, lora_id=r.lora_id, mm_items=r.mm_items,
                                           cache_salt=r.cache_salt)
            extras = self._rows.extras
            extras[row, :nb] = self._up(hashing.digests_to_lanes(ds).view(np.int64), np.int64)
            if r.lora_id is not None and nb < self._rows.max_blocks:
                (later,) = hashing.extra_key_digests(self._key, 1, bs, lora_id=r.lora_id, first_block=max(nb, 1))
                extras[row, nb:] = self._up(hashing.digests_to_lanes([later]).view(np.int64), np.int64)

    def _lookup_only(self, request: NewRequest, count_stats: bool, hit_cap: int | None = None) -> ComputedBlocks:
        """The hit a step would give this request now (at most ``hit_cap``
        blocks), changing no block."""
        row = self._rows.take()
        try:
            blocked = torch.zeros(1, dtype=torch.int32, device=self.device)
            caps = [0] if not self.enable_caching else None if hit_cap is None else [hit_cap]
            _, hit, _, cache = self._admit_new([request], [row], blocked, caps, dry=True)
            if isinstance(request.token_ids, torch.Tensor):  # checked on the device: the verdict rides with the hit
                bad = self._device_tokens_bad([request.token_ids])
                n, errors = self._read(torch.cat([hit.to(torch.int64), bad]))
                self._check_errors(errors, "request.token_ids")  # before any change: a refusal
            else:
                n = int(self._read(hit)[0])
            if count_stats:
                self._begin_changes()  # get_computed_blocks' point of first change
                self._count_lookups([request], [n])
            blocks = self._read(cache[0, :n].T) if n else [[] for _ in range(self.num_groups)]
        finally:
            self._rows.give_back_unused([row])
        for g, w in enumerate(self._window_blocks):
            if w >= 0:  # a window group holds the null block before its last W hit positions
                blocks[g] = [0 if p < n - w else b for p, b in enumerate(blocks[g])]
        return ComputedBlocks(blocks, n * self.block_size)

    def _admit_new(self, new, rows, blocked, hit_caps=None, dry: bool = False, token_budget: int | None = None,
                   graphs=None):
        """Phases 3-5 of a step: the new requests into ``rows``, their
        digests, lookups and admission, then (unless ``dry``) their blocks.
        Planned on the host from the requests' lengths and uploaded once;
        every entry after that is derived on the device
        (``gpukv.kernels.prefill``), by launches prepared once per bucket and
        replayed. Returns the admission's status, the hits (int32[K]) and the
        tokens each request has computed after the step (int32[K]; and with
        ``dry`` the cached hits, int32[KP, P, G])."""
        plan = plan_admission(new, rows, self.block_size, hit_caps, self._admission_plans, token_budget)
        bufs = self._admission_buffers(plan.bucket)
        self._staging.upload(plan.packed, out=bufs.plan)
        if plan.device_tokens and not dry:  # (a dry lookup reads its own verdict: ``_lookup_only``)
            errors = self.pool.free_queue.counter("error")
            errors.bitwise_or_(self._device_tokens_bad([t for _, t in plan.device_tokens]))
        for off, t in plan.device_tokens:
            bufs.views["tokens"][off: off + t.numel()].copy_(t)  # int64 ids wrap to their uint32 bits
        def write_rows() -> None:
            prefill_ops.write_rows(bufs.views, tokens=self._rows.tokens, extras=self._rows.extras)

        if dry:  # (a lookup only: not worth a graph)
            graphs = None
        self._admission_part(plan.bucket, bufs, "rows", write_rows, graphs)
        self._write_extra_keys(new, rows)  # (host work, only for requests with extra keys)
        if dry:  # a lookup only (``get_computed_blocks``): not worth preparing
            self._find_and_admit(bufs, blocked)
            return bufs.status, bufs.hit[: len(new)], bufs.views["comp"][: len(new)], bufs.cache
        def admit_and_take() -> None:
            self._find_and_admit(bufs, blocked)
            self._take_admitted_blocks(bufs)

        self._admission_part(plan.bucket, bufs, "admit", admit_and_take, graphs)
        self._rebuild_if_due(plan.max_new_blocks * self.num_groups)
        self._expect_events(bufs.alloc.shape[1] + bufs.record.shape[1])
        return bufs.status, bufs.hit[: len(new)], bufs.views["comp"][: len(new)]

    def _admission_part(self, bucket: tuple, bufs: AdmissionBuffers, part: str, launch, graphs) -> None:
        """One fixed part of the admission's launches: a CUDA graph replay
        (``graphs``: ``gpukv.graphs.AdmissionGraphs``; not with KV-cache
        events), else its kept launches replayed (``_replayed``)."""
        if graphs is not None and self._events is None:
            graphs.run((bucket, part), launch)
        else:
            self._replayed(bufs.prepared, part, launch)

    def _replayed(self, prepared: dict, part: str, launch) -> None:
        """Run ``launch`` (a fixed sequence of launches on fixed buffers) the
        first time, keeping its launches in ``prepared[part]``; later, replay
        them, skipping the launchers' Python (the plan/run split). Not with
        KV-cache events (their launches are not all Triton's), and anew once
        the row tensors were reallocated."""
        if self._events is not None:
            launch()
            return
        kept = prepared.get(part)
        if kept is not None and kept[0] == self.rows_generation:
            _common.run_prepared(kept[1])
            return
        with _common.preparing() as launches:
            launch()
        prepared[part] = (self.rows_generation, launches)

    def _find_and_admit(self, bufs: AdmissionBuffers, blocked) -> None:
        """The prompts' digests, their verified cached blocks, the chains of
        the step's requests sharing a block, and the sequential admission."""
        v, pool = bufs.views, self.pool
        self._hash_launch(v["rows"], bufs.zeros, v["nfull"])
        rows = self._rows
        shared = dict(tokens=rows.tokens, digests=rows.digests, extras=rows.extras, root=self._root_lanes)
        prefill_ops.lookup(v, bufs.cache, table=pool.table, blk_tokens=pool.blk_tokens, blk_parent=pool.blk_parent,
                           blk_extra=pool.blk_extra, **shared)
        prefill_ops.chains(v, bufs.head, bufs.next, bufs.same, block_size=self.block_size, **shared)
        lookup_ops.admit(bufs.cache, None, v["max_hit"], v["nblocks"], v["ntok"], v["skip"], ref_cnt=pool.ref_cnt,
                         touched=pool.touched, stamp=pool.stamp, num_free=pool.free_count, blocked=blocked,
                         block_size=self.block_size, hit_out=bufs.hit, status=bufs.status,
                         window_blocks=self._win_dev, chains=(bufs.head, bufs.next, bufs.same),
                         resolved=bufs.resolved, start=bufs.start, compute=v["comp"], lookahead=v["lookahead"],
                         num_requests=v["num_requests"], token_budget=v["token_budget"],
                         free_queue=pool.free_queue)

    def _take_admitted_blocks(self, bufs: AdmissionBuffers) -> None:
        """The admitted requests' blocks: first touches of their cached hits,
        their new blocks, their hits into their block tables (a pending hit
        takes a reference to the block an earlier request just got), and the
        full blocks of their chunks cached, each in (request, group,
        position) order."""
        pool = self.pool
        prefill_ops.admission_entries(bufs.views, bufs.status, bufs.hit, bufs.start, bufs.cache, self._win_dev,
                                      bufs.touch, bufs.alloc, bufs.record, block_size=self.block_size)
        pool.touch(bufs.cache.view(-1), bufs.touch)
        grp, row, pos, want, rank = bufs.alloc
        count = bufs.status[lookup_ops.ST_NEW_BLOCKS: lookup_ops.ST_NEW_BLOCKS + 1]
        pool.allocate(count, want, grp, row, pos, block_table=self._rows.block_table, rank=rank, popped=bufs.popped,
                      on_popped=self._popped_hook())
        prefill_ops.place_hits(bufs.views, bufs.status, bufs.hit, bufs.cache, bufs.resolved, self._win_dev,
                               bufs.hit_blocks, bufs.pending, block_table=self._rows.block_table)
        pool.touch(bufs.hit_blocks, bufs.pending)
        self._cache_blocks(*bufs.record, scratch=bufs.record_scratch, seq=bufs.record_seq)

    def _admission_buffers(self, bucket: tuple) -> AdmissionBuffers:
        bufs = self._admission_bufs.get(bucket)
        if bufs is None:
            bufs = self._admission_bufs[bucket] = AdmissionBuffers.create(bucket, self.num_groups, self.device)
        return bufs


#: The name this class had before the two managers were told apart (kept for
#: code that imports it; both modules used to call their manager so).
KVCacheManager = DeviceManager
