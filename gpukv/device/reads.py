"""The device manager's reads: every call that waits on the device.

Each goes through ``DeviceCalls.read`` (the manager's one counted
device-to-host copy on its stream, the one place a GPU's asynchronous
errors surface),
and takes the events drained so far along when it is a step's read, so a
step reads the device at most once. What a read brings that the host must
act on (the free queue's sticky error word) is raised here
(``check_queue_errors``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from gpukv.core import hashing
from gpukv.core.blocks import common_prefix_length
from gpukv.errors import InvalidInputError
from gpukv.kernels import decode as decode_ops
from gpukv.kernels import free_queue as fq_ops

if TYPE_CHECKING:
    from gpukv.device.state import DeviceCalls, DeviceState


def check_queue_errors(queue_errors: int, tokens_argument: str = "token_ids") -> None:
    """Raise when the free queue's sticky error word (as a read brought it)
    is set: ``ERR_BAD_TOKEN`` (token ids on the device out of range; an input
    error, but found after the step changed state, so a fault) or a kernel's
    broken contract."""
    if queue_errors & decode_ops.ERR_BAD_TOKEN:
        raise InvalidInputError(
            "token ids handed over on the device were outside [0, 2**32) (negative, or past uint32), in this "
            "step or an earlier one that read nothing; a step's read finds them only after the step changed "
            "state, so the manager stops (no call returned a hit on them)", argument=tokens_argument,
            fix="hand over only ids in [0, 2**32) (check the sampler's output, e.g. no -1 placeholders)")
    if queue_errors:
        raise RuntimeError(f"free-queue error flags {queue_errors:#x} set on the device: a kernel broke the "
                           "queue's contract (a bug; the manager stops)")


class FreeCountMirror:
    """The free count and the free queue's sticky error word as the last
    step left them, in (pinned) host memory: each step ends with a
    non-blocking copy of them on the manager's stream, covered by the step's
    staging event (``event``). ``read`` waits on that event only, so it
    waits for the manager's own work and never for a model's on another
    stream, and costs no copy of its own. ``fresh``: no step began since the
    copy (``StepAccounting`` clears it at a step's start, ``reset_prefix_cache``
    when it changes the pool outside a step); a stale mirror is not read."""

    _FIRST = fq_ops.COUNTER_SLOTS["num_free"]
    _LAST = fq_ops.COUNTER_SLOTS["error"]

    def __init__(self, free_queue: Any, device: torch.device) -> None:
        if self._LAST < self._FIRST:
            raise AssertionError("the free queue's error word precedes its free count: the mirror copies a span")
        # (the counters' span as a view, built once: slicing a tensor costs a few microseconds of every step)
        self._span = free_queue.counters[self._FIRST: self._LAST + 1]
        self._host = torch.zeros(self._LAST - self._FIRST + 1, dtype=torch.int64,
                                 pin_memory=device.type == "cuda")
        self._values = self._host.numpy()  # (the same memory: a read as numpy costs a fraction of torch's)
        self.event: Any = None
        self.fresh = False
        self.reads = 0  # reads answered from the mirror, since construction

    def refresh(self) -> None:
        """Copy the counters, without waiting (the caller's step event covers it)."""
        self._host.copy_(self._span, non_blocking=True)
        self.fresh = True

    def read(self) -> int:
        """The free count the last step left (raises on the error word, as a
        step's read does); waits only for that step's copy."""
        if self.event is not None:
            self.event.synchronize()
        self.reads += 1
        values = self._values.tolist()
        check_queue_errors(values[-1])
        return int(values[0])


class DeviceReads:
    """The reads of one device manager (``state``: its pool, rows, events
    and staging; ``calls``: its one read, ``read``), on rows and arguments
    it has checked."""

    def __init__(self, state: DeviceState, calls: DeviceCalls) -> None:
        self._s = state
        self._c = calls  # (its ``read`` looked up per read: a wrapper set on the manager replaces it)

    check_errors = staticmethod(check_queue_errors)

    # ------------------------------------------------------------ the pool
    def num_free_blocks(self) -> int:
        """Free blocks now (also the host's lower bound from here on): from
        the mirror the last step refreshed when no step began since (no
        device read), else one read."""
        mirror = self._s.mirror
        n = mirror.read() if mirror.fresh else int(self._c.read(self._s.pool.free_count)[0])
        self._s.free_lower_bound = n
        return n

    def check_free_lower_bound(self) -> None:
        """The host's lower bound of free blocks is at most the free blocks
        (``check_invariants``: read as the pool's checks read, not counted as
        a step's read)."""
        free = int(self._s.pool.free_count.cpu()[0])
        if self._s.free_lower_bound > free:
            raise AssertionError(f"the host's lower bound of free blocks {self._s.free_lower_bound} is above the "
                                 f"{free} free blocks")
        mirror = self._s.mirror
        if mirror.fresh and mirror.read() != free:
            raise AssertionError(f"the host mirror's free count {mirror.read()} is not the {free} free blocks")

    def num_evictions(self) -> int:
        """Cached blocks evicted so far."""
        return int(self._c.read(self._s.pool.evictions)[0])

    # ------------------------------------------------------------ requests
    def block_ids(self, row: int) -> list[list[int]]:
        """The row's block ids per group, position by position."""
        rows = self._s.rows
        return self._c.read(rows.block_table[:, row, : int(rows.num_held[row])])

    def block_ids_at(self, rows: np.ndarray, starts: np.ndarray, counts: np.ndarray, group: int) -> list[list[int]]:
        """Group ``group``'s block ids of each row at positions ``[start,
        start + count)``, in one read (a gather planned on the host; none
        when every span is empty)."""
        if not counts.sum():
            return [[] for _ in range(len(rows))]
        at = np.repeat(rows, counts)
        pos = np.repeat(starts, counts) + np.arange(len(at)) - np.repeat(np.cumsum(counts) - counts, counts)
        rows_t, pos_t = upload_packed(self._s.staging, at, pos)
        ids = self._c.read(self._s.rows.block_table[group, rows_t.long(), pos_t.long()])
        ends = np.cumsum(counts).tolist()
        return [ids[e - c: e] for e, c in zip(ends, counts.tolist(), strict=True)]

    def num_unheld(self, block_ids: list[int]) -> int:
        """How many of these (distinct, checked) blocks have reference count 0."""
        s = self._s
        ids = s.staging.upload(np.array(block_ids, dtype=np.int64))
        return int(self._c.read((s.pool.ref_cnt[ids] == 0).sum().view(1))[0])

    def common_prefix_blocks(self, row: int, count: int, windows: list) -> list[int]:
        """Per group, the leading blocks of the row whose reference count is
        ``count`` (up to the first that is not); 0 for a window group."""
        s = self._s
        n = int(s.rows.num_held[row])
        refs = self._c.read(s.pool.ref_cnt[s.rows.block_table[:, row, :n].long()])
        return [0 if w is not None else common_prefix_length(r, count) for w, r in zip(windows, refs, strict=True)]

    def block_hashes(self, row: int, block_size: int) -> list[bytes]:
        """The digests of the row's full known blocks."""
        rows = self._s.rows
        n = int(rows.num_tokens[row]) // block_size
        lanes = np.array(self._c.read(rows.digests[row, :n]), dtype=np.int64)
        return hashing.lanes_to_digests(lanes.reshape(-1, 2))

    # -------------------------------------------------------------- steps
    def step_status(self, parts: list) -> list:
        """Read a step's status ``parts`` (int64), the free count and the free
        queue's sticky error word in one read (with the events drained so
        far); raises when the error word is set, and sets the host's lower
        bound of free blocks. Returns the parts' values."""
        s = self._s
        fq = s.pool.free_queue
        parts = parts + [fq.counter("num_free"), fq.counter("error")]
        main = sum(t.numel() for t in parts)
        events = s.events.drain_parts()  # the events ride on the step's one read
        host = self._c.read(torch.cat(parts + events))
        if events:
            s.events.drained(host[main:])
        check_queue_errors(host[main - 1])
        s.free_lower_bound = host[main - 2]
        return host[: main - 2]

    def status_and_events(self, status: torch.Tensor) -> list:
        """A decode's status, read with the events drained so far."""
        s = self._s
        parts = s.events.drain_parts()
        host = self._c.read(torch.cat([status, *parts]) if parts else status)
        if parts:
            s.events.drained(host[status.numel():])
        return host

    def events(self) -> None:
        """The events written since the last drain, in one read of their own."""
        s = self._s
        s.events.drained(self._c.read(torch.cat(s.events.drain_parts())))


def upload_packed(staging, *arrays: np.ndarray) -> list[torch.Tensor]:
    """Int32 host arrays on the device in one upload: their views, each
    starting 32-byte aligned (Triton specialises pointers on it)."""
    sizes = [len(a) for a in arrays]
    starts = np.concatenate([[0], np.cumsum([-(-n // 8) * 8 for n in sizes])])
    packed = np.zeros(int(starts[-1]), dtype=np.int32)
    for a, o, n in zip(arrays, starts.tolist(), sizes, strict=False):  # starts has one more
        packed[o: o + n] = a
    dev = staging.upload(packed)
    return [dev[o: o + n] for o, n in zip(starts.tolist(), sizes, strict=False)]
