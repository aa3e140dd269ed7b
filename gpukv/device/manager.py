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

The parts (``gpukv.device``; docs/design.md, "Layout"): ``DecodePath``
(plan -> stage -> launch -> finish), ``Admission`` (a step's new requests,
in rounds), ``Releases`` (finished requests' blocks), ``DeviceEvents`` (the
KV-cache events) and ``DeviceReads`` (every read that waits on the device),
over the pool (``gpukv.device.pool.DevicePool``) and the request rows
(``gpukv.device.rows.DeviceRows``). This class is the request-level API over them:
it checks every argument (``gpukv.core.checks``), marks each call's point of
first change (``gpukv.core.failstop``), runs a step's phases in order
(``_step``), and holds what the parts share: the stream, the staging, the
one read (``_read``) and the verbs both the decode and the admission launch
(hashing, caching, the kept-launch replay).

Streams: on CUDA a manager runs on a stream of its own, made at
construction (its state is built there too); every launch, upload, staging
event and read of its calls runs on that stream, so a read (``.cpu()``)
waits for the manager's own work, never for a model's forward queued on
another stream. It is ordered against the caller's stream only where data is
shared, in one place (``gpukv.device.calls.CallContext``: ``_enter_stream``,
run by the ``gpukv.core.failstop`` wrappers of every public call and by ``_read``;
``_leave_stream``; ``_wait_for_caller``): a call runs on the manager's stream
without waiting for the caller's; device tensors it takes from the caller
(tokens a model runner sampled there) make the manager's stream wait on an
event recorded on the caller's stream at the call (``_normalize``); when the
call returns, the caller's stream waits for the manager's (on the device: an
attention kernel launched there after ``block_table_for`` or ``decode``
reads the tables they wrote, the host does not wait), and a device tensor
the call returns is marked used on the caller's stream (``record_stream``).
Two calls made from two streams are thus both ordered on the manager's
stream, in call order. The figures a serving loop asks each step (the free
count: vLLM's ``usage``) come from a host mirror each step refreshes
without waiting (``gpukv.device.reads.FreeCountMirror``). Without CUDA
there are no streams and nothing is done. The decode's parts
(plan, stage, launch, finish) run only inside one ``decode`` (or step) call,
under its call lock and its ordering (``DecodePath.launch_staged``: why).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import numpy as np
import torch

from gpukv import _runtime
from gpukv.core import hashing
from gpukv.core.blocks import ManagerLimits, check_count
from gpukv.core.checks import (
    check_block_spans,
    check_group,
    check_max_num_batched_tokens,
    check_request_ids,
    check_size,
    check_step_outputs,
    check_token_budget,
    normalize_device,
    normalize_step,
    normalize_windows,
    request_id_type_error,
    resolve_key,
    unknown_request,
)
from gpukv.core.failstop import mutating, reading
from gpukv.core.limits import MAX_MODEL_LEN, MAX_NUM_BLOCKS, MAX_NUM_REQS
from gpukv.core.manager_base import SharedManagerAPI
from gpukv.core.memory import check_memory
from gpukv.core.metrics import PrefixCacheStats
from gpukv.core.requests import ComputedBlocks, NewRequest, PrefixHit, RunningUpdate, Step, StepOutputs, StepResult
from gpukv.core.running_batch import RunningBatch
from gpukv.core.windows import policies
from gpukv.device.admission import Admission
from gpukv.device.admission_plan import single_prompt_buckets
from gpukv.device.calls import CallContext, OwnStream
from gpukv.device.decode import (
    DECODE_PHASES,
    DecodeBuffers,
    DecodePath,
    DecodePlan,
)
from gpukv.device.event_buffer import DeviceEventLog
from gpukv.device.events import DeviceEvents
from gpukv.device.launches import SharedLaunches
from gpukv.device.outputs import OutputGather, step_gather, take_step_outputs
from gpukv.device.pool import DevicePool
from gpukv.device.reads import DeviceReads, FreeCountMirror
from gpukv.device.releases import ReleaseBuffers, Releases, single_request_buckets
from gpukv.device.rows import DeviceRows, entry_layout  # (entry_layout: imported from here by older code)
from gpukv.device.staging import Staging, StepCounters
from gpukv.device.state import DeviceCalls, DeviceState
from gpukv.events.schema import KVEventBatch
from gpukv.kernels.block_hash import key_lanes
from gpukv.kernels.toolkit import pow2_at_least

__all__ = ["DECODE_PHASES", "KV_EVENTS_CAPACITY", "DecodeBuffers", "DecodePlan", "DeviceManager",
           "ReleaseBuffers", "device_bytes", "entry_layout"]

def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


def _lanes(d: bytes) -> tuple[int, int]:
    return _signed(int.from_bytes(d[:8], "little")), _signed(int.from_bytes(d[8:], "little"))


def device_bytes(num_blocks: int, block_size: int, num_groups: int, max_model_len: int,
                 max_num_reqs: int) -> dict[str, int]:
    """Bytes the device manager allocates at construction, by the argument
    that drives them (``gpukv.device.pool`` and the request rows below), so a size
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


#: KV-cache events the device buffer holds between two reads (more are
#: dropped and reported): about 9 MB with 16-token blocks.
KV_EVENTS_CAPACITY = 65_536


#: A step that hands back nothing beyond its decisions.
_NO_OUTPUTS = StepOutputs()


class DeviceManager(CallContext, SharedManagerAPI):
    """Device-resident manager with the reference's API (``gpukv.reference.manager``),
    plus the batched ``decode(rows, new_token_ids)`` entry for serving loops:
    the request-level API over the parts the module docstring names.

    On CUDA it runs on a stream of its own: a call made on another stream
    does not wait for that stream's work (only for device tensors it takes
    from it), runs on the manager's stream, and makes the caller's stream
    wait for its work (the module docstring, "Streams").

    ``max_num_batched_tokens``: the most tokens the engine computes in one
    step (vLLM's ``max_num_batched_tokens``; None: no bound). It changes
    no decision: an admission's device buffers are sized by the prompt's
    length (``gpukv.device.admission_plan``), and by this where a prompt is
    longer, so a long prompt's admission does not size its entries by the
    whole prompt when a step computes at most this much of it."""

    _PROPERTIES_WAIT = True  # (``num_free_blocks``, ``num_evictions``, ``usage``: deprecated here)

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
        max_num_batched_tokens: int | None = None,
    ) -> None:
        num_blocks, block_size, windows, max_model_len, max_num_reqs, device, key = _checked_args(
            num_blocks, block_size, sliding_windows, max_model_len, max_num_reqs, device, hash_key)
        self._max_chunk = check_max_num_batched_tokens(max_num_batched_tokens)
        self.device = device
        # The manager's own stream, every call runs on it (module docstring, "Streams"); None without CUDA.
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        with OwnStream(self._stream, device):
            self._build(num_blocks, block_size, windows, max_model_len, max_num_reqs, key, enable_caching,
                        uncached_first, enable_kv_cache_events)

    def _build(self, num_blocks: int, block_size: int, windows: list, max_model_len: int, max_num_reqs: int,
               key: bytes, enable_caching: bool, uncached_first: bool, enable_kv_cache_events: bool) -> None:
        self.block_size = block_size
        self.sliding_windows = windows
        self.num_groups = len(windows)
        self._policies = policies(windows, block_size)  # one per group (``gpukv.core.windows``)
        # Blocks a window group must still see at a hit boundary; -1 = full attention.
        self._window_blocks = [p.boundary_blocks for p in self._policies]
        self._win_dev = torch.tensor(self._window_blocks, dtype=torch.int32, device=self.device)
        self.max_model_len = max_model_len
        self.uncached_first = bool(uncached_first)
        # Without caching no lookup runs (hits 0, queries still counted, as the reference's); no block is recorded.
        self.enable_caching = bool(enable_caching)
        self.pool = DevicePool(num_blocks, block_size, self.device, uncached_first=uncached_first)
        self._key = key
        self._limits = ManagerLimits(block_size, num_blocks, tuple(windows), max_model_len, self.enable_caching)
        self._root_lanes = _lanes(hashing.root_digest(self._key))
        self._key_dev = key_lanes(self._key, self.device)
        # Request rows: tokens, digests, block tables on the device, counts on the host (``device.rows.DeviceRows``).
        self._rows = DeviceRows(max_num_reqs, num_groups=self.num_groups, max_model_len=max_model_len,
                                block_size=block_size, device=self.device)
        self._reqs: dict[str, int] = {}  # request id -> row
        self._row_ids: dict[int, str] = {}
        # KV-cache events (``gpukv.events.schema``): written on the device as the cache
        # changes, drained by the reads the host makes (``gpukv.device.events``).
        self._events = DeviceEvents(DeviceEventLog(KV_EVENTS_CAPACITY, block_size, self.device)
                                    if enable_kv_cache_events else None, self.pool.table)
        self._reset_flag = False
        self._init_parts()

    def _init_parts(self) -> None:
        """What steps reuse: accounting, the pinned staging buffers, and the
        parts, each with the per-bucket plans and device buffers it makes on
        a bucket's first step."""
        self.counters = StepCounters()
        staging = Staging(self.device, self.counters)
        self._blocked = torch.zeros(1, dtype=torch.int32, device=self.device)  # a running update did not fit
        self._mirror = FreeCountMirror(self.pool.free_queue, self.device)  # the free count, host side
        # What the parts share, typed (``gpukv.device.state``); the host figures they change live only there.
        s = self._shared = DeviceState(
            device=self.device, block_size=self.block_size, sliding_windows=self.sliding_windows,
            enable_caching=self.enable_caching, pool=self.pool, key=self._key, key_dev=self._key_dev,
            root_lanes=self._root_lanes, limits=self._limits, policies=self._policies,
            window_blocks=self._window_blocks, win_dev=self._win_dev, rows=self._rows, reqs=self._reqs,
            row_ids=self._row_ids, events=self._events, counters=self.counters, staging=staging,
            mirror=self._mirror, blocked=self._blocked, free_lower_bound=self.pool.num_blocks - 1)
        # The calls the parts run, bound once (``gpukv.device.state.DeviceCalls``: public names, no manager held).
        calls = self._calls = DeviceCalls(
            read=self._read_device, step=self._step, normalize=self._normalize, begin_changes=self._begin_changes,
            counting=self._counting, hook=self._hook, get_block_ids=self.get_block_ids)
        self._reads = DeviceReads(s, calls)
        self._launches = SharedLaunches(s)  # what more than one part launches
        self._decode = DecodePath(s, calls, self._reads, self._launches)
        self._gather = OutputGather(s, self._launches)  # what a step hands back (``gpukv.device.outputs``)
        self._admission = Admission(s, calls, self._reads, self._launches, self._max_chunk)
        self._releases = Releases(s, self._launches)

    @property
    def _staging(self) -> Staging:
        """The staging buffers (the shared state's: a swap reaches every part)."""
        return self._shared.staging

    @_staging.setter
    def _staging(self, staging: Staging) -> None:
        self._shared.staging = staging

    def _batch_device(self) -> torch.device:
        return self.device  # a RunningBatch's tokens may be a tensor on it (a model runner's sampled ids)

    @property
    def rows_generation(self) -> int:
        """Bumped when the row tensors are reallocated (captured graphs and prepared launches hold the old ones)."""
        return self._rows.generation

    # A model runner in the scheduler's process reads these between calls
    # (``gpukv.vllm.v0_33.binding``): host only, no read, no call lock.
    @property
    def block_table(self) -> torch.Tensor:
        """int32[G, rows, M]: every row's block table, the device tensor
        itself (not a copy; a row's positions past ``blocks_held_per_row``
        are not its blocks). A new tensor when the rows are reallocated
        (``rows_generation`` then changes)."""
        return self._rows.block_table

    @property
    def request_rows(self) -> Mapping[str, int]:
        """Each running request's row (``row_of`` without its checks), a
        read-only view that follows the admissions and frees."""
        return MappingProxyType(self._reqs)

    @property
    def stream(self) -> torch.cuda.Stream | None:
        """The CUDA stream the manager's work runs on (None without CUDA):
        what a reader of ``block_table`` orders its reads after."""
        return self._stream

    @property
    def blocks_held_per_row(self) -> np.ndarray:
        """int64[rows]: the block positions each row holds (every group),
        the host's counts themselves (read, do not write)."""
        return self._rows.num_held

    def __repr__(self) -> str:  # never show the key
        return (f"DeviceManager(device={self.device}, num_blocks={self.num_blocks}, "
                f"block_size={self.block_size}, groups={self.sliding_windows})")

    # ----------------------------------------------------------------- reads
    # (``gpukv.device.reads``: each waits on the device.)
    @reading
    def read_num_free_blocks(self) -> int:
        """Free blocks now: the host mirror the last step refreshed, or a device
        read if the pool changed outside a step (``FreeCountMirror``)."""
        return self._reads.num_free_blocks()

    @reading
    def free_blocks_lower_bound(self) -> int:
        """Free blocks there are at least: the last read's count less what was taken since (host only, no read)."""
        return int(self._shared.free_lower_bound)

    @reading
    def read_num_evictions(self) -> int:
        """Cached blocks evicted so far; reads the device (waits for the GPU)."""
        return self._reads.num_evictions()

    @reading
    def free_queue(self) -> list[int]:
        """The free block ids, front (reused first) to back; reads the device."""
        return self.pool.free_queue_list()

    @reading
    def get_block_ids(self, request_id: str) -> list[list[int]]:
        """The request's block ids per group, position by position (the null
        block 0 where a window dropped them); reads the device."""
        return self._reads.block_ids(self._state(request_id))

    @reading
    def read_block_ids(self, spans: Sequence[tuple[str, int, int]], group: int = 0) -> list[list[int]]:
        """Group ``group``'s block ids of each ``(request_id, start, end)``
        span's request at positions ``[start, end)``, in one device read (a
        gather at the positions, planned on the host from its block counts;
        none when every span is empty): a serving loop's new blocks of a
        step, for many requests at once."""
        group = check_group(group, self.num_groups)
        spans = check_block_spans(spans, "spans", self.num_blocks_held)
        rows = np.fromiter((self._reqs[rid] for rid, _, _ in spans), np.int64, len(spans))
        starts = np.fromiter((start for _, start, _ in spans), np.int64, len(spans))
        counts = np.fromiter((end - start for _, start, end in spans), np.int64, len(spans))
        return self._reads.block_ids_at(rows, starts, counts, group)

    @reading
    def get_num_common_prefix_blocks(self, request_id: str, num_running_requests: int) -> list[int]:
        """Per group, how many leading blocks of this request every one of the
        ``num_running_requests`` running requests holds (vLLM's, for cascade
        attention): blocks whose count equals that number, up to the first
        that does not; a sliding-window group gives 0. Reads the device."""
        row = self._state(request_id)
        count = check_count(num_running_requests, "num_running_requests")
        return self._reads.common_prefix_blocks(row, count, self.sliding_windows)

    @reading
    def block_hashes(self, request_id: str) -> list[bytes]:
        """The digests of the request's full known blocks; reads the device."""
        return self._reads.block_hashes(self._state(request_id), self.block_size)

    @reading
    def check_invariants(self, *, verify_digests: bool = True) -> None:
        """The pool's invariants (see ``DevicePool.check_invariants``), and each
        block's count equals the number of block-table rows that hold it."""
        self.pool.check_invariants(self._key, verify_digests=verify_digests)
        self._rows.check_against(self.pool, self._reqs)
        self._reads.check_free_lower_bound()

    # ------------------------------------------------------- host-only reads
    @reading
    def request_ids(self) -> list[str]:
        """The running requests' ids, in admission order (host only)."""
        return list(self._reqs)

    @reading
    def row_of(self, request_id: str) -> int:
        """The row a running request holds (``gpukv.device.rows``; ``decode`` takes rows)."""
        return self._state(request_id)

    @reading
    def block_table_for(self, request_ids: Sequence[str]) -> torch.Tensor:
        """int32[G, len(request_ids), M] block tables of these requests (a
        device gather; positions past a request's blocks are not its blocks:
        read only the first ``len(get_block_ids(id)[g])``). Called between
        steps, its upload is a staging step of its own (``gpukv.device.staging``), and
        on another stream the caller's stream waits for the gather (the
        module docstring, "Streams")."""
        ids = check_request_ids(request_ids, "request_ids", self._reqs)
        rows = self._staging.upload(np.array([self._reqs[r] for r in ids], dtype=np.int64))
        return self._rows.block_table[:, rows]

    @reading
    def num_blocks_held(self, request_id: str) -> int:
        """The block positions the request holds, per group (host only; the
        null block counts where a window dropped one)."""
        return int(self._rows.num_held[self._state(request_id)])

    @reading
    def request_counts(self, request_id: str) -> tuple[int, int, int, int]:
        """A running request's row, block positions held per group, computed
        and known tokens, in one call (``row_of``, ``num_blocks_held``,
        ``num_computed_tokens`` and its ``row_token_counts``); host only."""
        row = self._state(request_id)
        rows = self._rows
        return row, int(rows.num_held[row]), int(rows.num_computed[row]), int(rows.num_tokens[row])

    @reading
    def num_null_blocks(self, request_id: str) -> tuple[int, ...]:
        """Per group, the leading block positions the request holds as the
        null block (a hit's blocks before its window, and the blocks its
        window released; 0 in a full-attention group); host only."""
        return tuple(int(n) for n in self._rows.null_until[self._state(request_id)])

    @reading
    def num_computed_tokens(self, request_id: str) -> int:
        """Tokens of the request computed so far, its hit included (host only)."""
        return int(self._rows.num_computed[self._state(request_id)])

    # ----------------------------------------------------- request-level API
    @property
    def stats(self) -> PrefixCacheStats:
        """The lookups counted since ``make_prefix_cache_stats`` last handed
        them out (host only), as the reference's."""
        return self._shared.stats

    @mutating
    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """The prefix-cache stats since the last call (then zeroed); host only."""
        self._begin_changes(cache=False)
        shared = self._shared
        stats, shared.stats = shared.stats, PrefixCacheStats()
        stats.reset, self._reset_flag = self._reset_flag, False
        return stats

    @mutating
    def reset_prefix_cache(self) -> bool:
        """Forget every cached block, when no request holds a block (else False, nothing changed); reads the device."""
        self._begin_changes()
        self._mirror.fresh = False  # (the pool changes outside a step: the next free count is read)
        if self.read_num_free_blocks() != self.num_blocks - 1:
            return False
        if self._events.log is not None:
            if self._events.pending:  # what came before the reset, first
                self._reads.events()
            self._events.cleared()
        self.pool.reset_prefix_cache()
        self._reset_flag = True
        return True

    @mutating
    def take_events(self) -> list[KVEventBatch]:
        """The KV-cache event batches made since the last call (``gpukv.events.schema``),
        oldest first; empty unless built with ``enable_kv_cache_events``. A
        batch is made at each read of the step status; events of steps that
        read nothing (a decode the host proved fits) are read here, one read."""
        self._begin_changes(cache=False)
        if self._events.pending:
            with self._counting():
                self._reads.events()
        return self._events.take()

    @mutating
    def get_computed_blocks(self, request: NewRequest) -> ComputedBlocks:
        """Look a new request up (counts in the stats); changes no block."""
        (request,) = self._normalize((), (), [request], single=True, defer_admissible=True).new
        with self._counting(lookup=True):  # (the point of first change is in the lookup: counting it in the stats)
            return self._admission.lookup_only(request, count_stats=True)

    @mutating
    def read_prefix_hit(self, request: NewRequest) -> PrefixHit:
        """``get_computed_blocks`` by its size (counts in the stats; changes
        no block): the hit in tokens and its blocks no request holds, read
        in one read of two numbers; its block ids stay on the device (for
        ``admit``)."""
        (request,) = self._normalize((), (), [request], single=True, defer_admissible=True).new
        with self._counting(lookup=True):
            return self._admission.lookup_size(request, count_stats=True)

    def _admit_sized(self, request: NewRequest, hit: Any, num_tokens: int | None,
                     num_lookahead_tokens: int | None) -> bool:
        return self._admission.admit_sized(request, hit, num_tokens, num_lookahead_tokens)

    def _allocate_new(self, request: NewRequest, computed: ComputedBlocks | None, num_tokens: int | None,
                      num_lookahead_tokens: int | None) -> list[list[int]] | None:
        return self._admission.allocate_new(request, computed, num_tokens, num_lookahead_tokens)

    def _allocate_running(self, update: RunningUpdate) -> list[list[int]] | None:
        row = self._state(update.request_id)
        before = int(self._rows.num_held[row])
        self._begin_changes()
        with self._counting():
            res = self._step((), [update], ())
        if not res.ok:
            return None
        if int(self._rows.num_held[row]) == before:  # no new position: nothing to read
            return [[] for _ in range(self.num_groups)]
        return [g[before:] for g in self.get_block_ids(update.request_id)]

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
        reference's (``gpukv.reference.manager.ReferenceManager.step``), and the same
        argument checks (``gpukv.core.checks.normalize_step``): a refused call
        raises a ``gpukv.errors`` class and changes nothing.
        ``token_budget`` (vLLM's waiting loop, applied on the device in the
        admission): the tokens the new requests may compute beyond their hits,
        None for no budget. A ``RunningBatch`` runs as ``decode`` does (its
        plan, kept launches, and no read when the host's bound says it fits).
        ``block_ids`` and ``prefix_of`` come back in the step's one read
        (``gpukv.device.outputs``). ``graphs`` (a ``gpukv.device.graphs.AdmissionGraphs``)
        replays the admission's kernels as CUDA graphs instead of launching
        them."""
        step, batch = self._normalize_step(finished, running, new)
        token_budget = check_token_budget(token_budget)
        outputs = check_step_outputs(block_ids, prefix_of, self._reqs, step.finished, step.new)
        self._begin_changes()
        with self._counting():
            return self._step(list(step.finished), list(step.running) if batch is None else batch, list(step.new),
                              token_budget=token_budget, graphs=graphs, outputs=outputs)

    @mutating
    def decode(self, rows: Sequence[int] | np.ndarray, new_token_ids, *, num_new_tokens=None,
               num_tokens_to_compute=None, num_lookahead_tokens=0, graphs=None) -> StepResult:
        """The running requests at ``rows`` (``StepResult.rows`` / ``row_of``)
        each append their new tokens and get their blocks: the same result as
        ``step(running=[RunningUpdate(id, tokens, chunk, lookahead) ...])`` in
        row order (``running_failed_at`` indexes ``rows``), at a host cost
        that does not grow with the batch. The arguments are
        ``gpukv.RunningBatch``'s (``gpukv.core.running_batch``).

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
        or one chunk per row (0 where none is left); ``num_lookahead_tokens``:
        slots reserved beyond the computed tokens (speculative decoding), one
        int or one per row, never cached.

        The host plans the step with numpy (no Python per request) into one
        int32 buffer, uploads it through pinned memory, and launches a fixed
        sequence of kernels per batch bucket (rows padded to a power of two;
        ``gpukv.device.decode``). The host reads the device only when its
        lower bound of free blocks does not cover the batch (then once, with
        the kernels' error words). ``graphs`` (a ``gpukv.device.graphs.DecodeGraphs``)
        replays the kernels as a CUDA graph instead of launching them.
        """
        run = self._normalize_running(RunningBatch(rows, new_token_ids, num_new_tokens, num_tokens_to_compute,
                                                   num_lookahead_tokens))
        if not len(run.rows):
            return StepResult()
        self._begin_changes()
        with self._counting():
            decode = self._decode
            plan, bufs = decode.launch_running(run, graphs)
            return decode.finish(plan, bufs)

    def _prepare_admissions(self, max_prompt_len: int, num_lookahead_tokens: int) -> int:
        adm, rel = self._admission, self._releases
        todo = [(b, dry) for b, dry in single_prompt_buckets(max_prompt_len, self.block_size, self._max_chunk,
                                                             num_lookahead_tokens)
                if not adm.prepared(b, dry)]
        frees = [ep for ep in single_request_buckets(max_prompt_len + num_lookahead_tokens, self.block_size,
                                                     self.num_groups) if not rel.prepared(ep)]
        with self._counting():
            for bucket, dry in todo:
                adm.prepare(bucket, dry)
            for ep in frees:
                rel.prepare(ep)
        return len(todo) + len(frees)

    # The step ----------------------------------------------------------------
    def _step(self, finished, running, new, *, count_stats: bool = True, hit_caps=None,
              token_budget: int | None = None, graphs=None, outputs: StepOutputs = _NO_OUTPUTS,
              hit_touches=None) -> StepResult:
        """A step on normalised arguments (``_normalize``), its phases in
        order: releases, the running requests (as the decode runs them), the
        admission's rounds; nothing here refuses input. The one read of the
        step (none when nothing is unknown: ``hit_touches``,
        ``Admission.round``), one more per admission round after a
        deferral."""
        if finished:  # phase 1
            self._releases.requests(finished)
        run = self._decode.run_phase(running)  # phase 2
        lead = [run.n_ok] if run is not None and run.n_ok is not None else []  # (rides on the step's read)
        if not self.enable_caching:
            hit_caps = [0] * len(new)  # no lookup: every hit is 0
        result = StepResult()
        tail = (step_gather(self._shared, self._gather, run, outputs, new)
                if outputs.block_ids or outputs.prefix_of is not None else None)
        host, deferred = None, False
        if new:  # phases 3-5
            deferred, host = self._admission.round(new, result, hit_caps, token_budget, count_stats, graphs, lead,
                                                   tail, hit_touches)
        elif lead or tail is not None:
            host = self._reads.step_status(lead + ([] if tail is None else tail.parts()))
            if tail is not None:
                tail.took(host[len(lead):])
        if run is not None:
            self._decode.finish_phase(run, result, int(host[0]) if lead and host is not None else None)
        while new and deferred:  # vLLM looks the rest up after the admitted ones' pops: another round
            deferred, _ = self._admission.round(new, result, hit_caps, token_budget, count_stats, graphs, (), tail)
        if tail is not None:
            take_step_outputs(self._shared, result, run, outputs, tail)
        return result

    # ------------------------------------------------------------- checking
    def _begin_changes(self, *, cache: bool = True) -> None:
        """The running call's point of first change (``gpukv.core.failstop``),
        which also advances the mutation epoch (``DeviceState.epoch``): every
        call that may change the pool, the rows or the cache passes here
        before it does, so a dry lookup remembered at an epoch still current
        is what a lookup of the same request would find now (the admission's
        ``LookupMemo``). ``cache=False``: a call that changes host records
        only (the stats handed out, the events taken) leaves the epoch."""
        self._changing = True
        if cache:
            self._shared.epoch += 1

    def _state(self, request_id: str) -> int:
        """A running request's row (InvalidTypeError: an id not a plain str; UnknownRequestError: one not held)."""
        if type(request_id) is not str:
            raise request_id_type_error(request_id, "request_id")
        try:
            return self._reqs[request_id]
        except KeyError:
            raise unknown_request(request_id) from None

    def _normalize(self, finished, running, new, *, single: bool = False, defer_admissible: bool = False) -> Step:
        """Every argument checked and normalised (``gpukv.core.checks``), before anything changes (and ordered)."""
        return self._ordered(normalize_step(finished, running, new, known=self._reqs, limits=self._limits,
                             num_tokens=lambda rid: int(self._rows.num_tokens[self._reqs[rid]]),
                             num_computed=lambda rid: int(self._rows.num_computed[self._reqs[rid]]),
                             single=single, defer_admissible=defer_admissible))

    _row_of = _state  # (``SharedManagerAPI``'s hook: this manager's state of a request is its row)

