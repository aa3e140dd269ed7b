"""The device manager's decode path: plan -> stage -> launch -> finish.

FlashInfer's plan/run split: the host plans a running batch with numpy (no
Python per request) into one int32 array of the batch's bucket, stages it
(one pinned, non-blocking upload into the bucket's fixed device buffers),
launches a fixed sequence of kernels on those buffers (kept after a bucket's
first step and replayed, or captured as a CUDA graph by ``gpukv.device.graphs``),
and finishes by bringing the host's mirror of the rows up to date, reading
the device only when the host could not prove the batch fits.

``DeviceManager.decode`` runs the four parts in one call, under its call
lock (they share each bucket's host plan and buffers: run apart, one plan's
kernels would run on another's tokens); a step's phase 2 (running requests)
runs the same ones (``run_phase``), its fit riding on the step's read. The
kernels and the plan's layout: ``gpukv/kernels/decode.py``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from gpukv.core.requests import RunningUpdate, StepResult
from gpukv.core.running_batch import RunningRows, largest_element
from gpukv.errors import InvalidInputError
from gpukv.kernels import capture
from gpukv.kernels import decode as decode_ops
from gpukv.kernels.toolkit import pow2_at_least

if TYPE_CHECKING:
    from gpukv.device.launches import SharedLaunches
    from gpukv.device.reads import DeviceReads
    from gpukv.device.state import DeviceCalls, DeviceState


#: The arrays of a decode plan the host uploads (the rest ``decode_fit`` writes).
UPLOADED = frozenset({"rows", "ntok", "nnew", "comp0", "comp1", "held", "need", "cum",
                      "r_grp", "r_row", "r_pos", "r_call", "r_valid"})

#: A decode step's phases, in launch order (``DecodePath.launch``): window
#: releases, the fit and token write (always), new blocks, digests of blocks
#: the appended tokens fill, caching of blocks the computed tokens fill.
DECODE_PHASES = ("release", "fit", "allocate", "hash", "cache")
_DECODE_PART = {p: f"decode.{p}" for p in DECODE_PHASES}  # their launches' keys in ``DecodeBuffers.prepared``
ALL_DECODE_PHASES = frozenset(DECODE_PHASES)


@functools.cache
def decode_phases(release: bool, allocate: bool, hash_: bool, cache: bool) -> frozenset[str]:
    """The decode phases with work (``DecodePlan.phases``): one set per combination."""
    flags = {"release": release, "fit": True, "allocate": allocate, "hash": hash_, "cache": cache}
    return frozenset(p for p in DECODE_PHASES if flags[p])


def block_counter(block_size: int):
    """``tokens -> tokens // block_size`` for int64 arrays: a shift where the
    block size is a power of two (numpy's integer division is the slower)."""
    if block_size & (block_size - 1):
        return lambda a: a // block_size
    shift = np.array(block_size.bit_length() - 1, dtype=np.int64)  # (0-d: numpy takes it faster than an int)
    return lambda a: a >> shift


def block_offset(block_size: int):
    """``tokens -> tokens % block_size`` for int64 arrays: a mask where the
    block size is a power of two (``block_counter``'s reason)."""
    if block_size & (block_size - 1):
        return lambda a: a % block_size
    mask = np.array(block_size - 1, dtype=np.int64)
    return lambda a: a & mask


@functools.lru_cache(maxsize=256)
def as_0d(value: int) -> np.ndarray:
    """``value`` as a 0-d int64 array: an array and a 0-d one add in about
    half the time an array and a Python int do (numpy converts the int at
    every operation), which counts on the tens of rows of a decode. Shared
    by every caller, so read-only; a bounded cache, since a lookahead's
    values reach it too."""
    value_0d = np.array(value, dtype=np.int64)
    value_0d.flags.writeable = False
    return value_0d


@dataclass
class DecodePlan:
    """A batched decode step as the host plans it (``DecodePath.plan``):
    the rows, what they need and hold after it; its packed int32 plan is in
    this step's host array of the bucket (``DecodePath.host_plan``), uploaded
    once into the bucket's fixed device buffer (layout: ``gpukv/kernels/decode.py``)."""

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
    # The named views of this step's host plan array it was written into
    # (``DecodePath.host_plan``; None: looked up again by ``stage``).
    host: dict | None = None

    def blocks_popped(self, num_fit: int) -> int:
        """The blocks the first ``num_fit`` rows took (the only ones popped)."""
        return int(self.cum[num_fit - 1]) if num_fit else 0


@dataclass
class DecodeBuffers:
    """Fixed device buffers of one decode bucket: the uploaded plan, its
    views, the new tokens and every kernel's scratch (nothing is allocated
    inside a decode step, so a CUDA graph can capture it)."""

    plan: torch.Tensor
    uploaded: torch.Tensor  # the part of ``plan`` the host sends (``UPLOADED``)
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
class RunningPhase:
    """A step's phase 2 once launched: the rows, the block positions each
    holds per group before and after (if it fits), the blocks they take, how
    many fit (an int64[1] device tensor to read, None when the host knows all
    do), and its plan, from which ``DecodePath.finish_running(plan, n_ok)``
    brings the host's mirror up to date."""

    rows: np.ndarray
    held_before: np.ndarray
    held_after: np.ndarray
    total: int
    n_ok: torch.Tensor | None
    plan: DecodePlan

    @property
    def size(self) -> int:
        return len(self.rows)


def decode_layout(bucket: tuple, num_groups: int, num_window_groups: int) -> list[tuple[str, int]]:
    """(name, length) of each int32 array of a bucket's device plan, in
    order: first the ones the host uploads (``UPLOADED``), then the ones
    ``decode_fit`` writes (``kernels/decode.py``)."""
    BP, k, L, A, C = bucket
    G, W = num_groups, num_window_groups
    names = [(x, BP) for x in ("rows", "ntok", "nnew", "comp0", "comp1", "held", "need", "cum")]
    names += [(f"r_{x}", BP * W * L) for x in ("grp", "row", "pos", "call", "valid")] if L else []
    return names + [("h_start", BP), ("h_count", BP), ("alloc", 5 * BP * G * A), ("record", 4 * BP * G * C)]


def uploaded_size(bucket: tuple, layout: list[tuple[str, int]]) -> tuple[int, int]:
    """(int32 elements of the uploaded plan arrays, of the new tokens that
    follow them): the host sends both in one copy. The plan's part is even
    (its arrays are multiples of the padded batch, a power of two of at
    least 8), so the int64 tokens after it are aligned."""
    BP, k = bucket[:2]
    return sum(size for name, size in layout if name in UPLOADED), 2 * BP * k


def decode_buffers(bucket: tuple, layout: list[tuple[str, int]], device: torch.device) -> DecodeBuffers:
    """A bucket's fixed device buffers: the plan's views laid out as
    ``layout``, the uploaded arrays first, then the new tokens (int64[BP, k],
    sent in the same copy), then what ``decode_fit`` writes."""
    BP, k = bucket[:2]
    sizes = dict(layout)
    EA, E, ER = sizes["alloc"] // 5, sizes["record"] // 4, max(sizes.get("r_grp", 0), 1)
    uploaded, tokens = uploaded_size(bucket, layout)
    plan = torch.zeros(sum(sizes.values()) + tokens, dtype=torch.int32, device=device)
    views, off = {}, 0
    for name, size in sizes.items():
        views[name] = plan[off: off + size]
        off += size + (tokens if off + size == uploaded else 0)
    views["alloc"], views["record"] = views["alloc"].view(5, EA), views["record"].view(4, E)

    def zeros(shape, dtype=torch.int64) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=device)

    return DecodeBuffers(
        plan=plan, uploaded=plan[:uploaded + tokens], views=views,
        new_tokens=plan[uploaded:uploaded + tokens].view(torch.int64).view(BP, k), count=zeros(1),
        status=zeros(decode_ops.NUM_STATUS), popped=zeros(EA, torch.int32),
        release_scratch=zeros((2, ER), torch.int32), release_workspace=zeros(ER), record_scratch=zeros((4, E)),
        record_seq=zeros(E))


class DecodePath:
    """A device manager's decode: ``plan`` -> ``stage`` -> ``launch`` ->
    ``finish`` (the module docstring), with the per-bucket host plans and
    device buffers it reuses step after step. ``state``: its rows, pool,
    staging and events; ``calls``: the manager's hook for a caller's code;
    ``reads``; ``launches``: the verbs shared with the admission (hashing,
    caching, kept-launch replay)."""

    def __init__(self, state: DeviceState, calls: DeviceCalls, reads: DeviceReads,
                 launches: SharedLaunches) -> None:
        self._s = state
        self._calls = calls
        self._reads = reads
        self._launches = launches
        self._rows = state.rows
        self._pool = state.pool
        self._events = state.events
        self._blocked = state.blocked
        #: ``_blocked`` is 0 on the device: zeroed (or made), or written 0 by the last running phase (only
        #: ``decode_fit`` writes it: 1 when a real row did not fit), so a step with no running phase zeroes
        #: it only after a phase in which a row did not fit.
        self._blocked_clear = True
        self._reqs = state.reqs
        self.device = state.device
        self.block_size = state.block_size
        self.num_groups = state.num_groups
        self._blocks_of = block_counter(state.block_size)  # full blocks in a number of tokens
        self._offset_of = block_offset(state.block_size)  # tokens past the last full block
        self._policies = state.policies
        self._window_groups = [g for g, w in enumerate(state.sliding_windows) if w is not None]
        self._events_off = state.events.log is None
        self.buffers: dict[tuple, DecodeBuffers] = {}
        self.staged: DecodeBuffers | None = None  # the buffers the running decode staged, until it launched
        self.host_plans: dict[tuple, dict] = {}  # (bucket, staging parity) -> views

    # ------------------------------------------------------------------ plan
    def plan(self, rows: np.ndarray, k: int, num_tokens: np.ndarray | None = None, *,
             chunks: np.ndarray | None = None, lookahead: int | np.ndarray = 0,
             num_new: np.ndarray | None = None, processed: np.ndarray | None = None) -> DecodePlan:
        """The host plan of a decode of ``k``
        tokens for each of ``rows`` (``num_new``: fewer for some, at most
        ``k`` each; checked by ``decode``), written into this step's host
        array: per row its token counts (known, computed before and after),
        the blocks it holds and needs and the running total of those (the
        device derives every entry from these, ``kernels/decode.py``), and the
        window releases; a few vectorised numpy operations, no Python per
        request. ``num_tokens``: the rows' known token counts, when the caller
        has them already; ``chunks``: tokens each row computes (None: all it
        knows after the append); ``lookahead``: slots per row (or for every
        row) beyond them; ``processed``: the tokens window groups release
        behind (None: the computed ones before the step)."""
        bs, G = self.block_size, self.num_groups
        B = len(rows)
        rs = self._rows
        n = rs.num_tokens[rows] if num_tokens is None else num_tokens
        comp0, held0 = rs.num_computed[rows], rs.num_held[rows]
        # (ints as 0-d arrays here and below: as_0d)
        nnew, added = (k, as_0d(k)) if num_new is None else (num_new, num_new)
        ntok1 = n + added
        comp1 = ntok1 if chunks is None else comp0 + chunks
        blocks_of = self._blocks_of  # (a shift where the block size is a power of two)
        la_max = lookahead if isinstance(lookahead, int) else largest_element(lookahead)
        # (lookahead blocks held are kept)
        ahead = as_0d(lookahead + bs - 1) if isinstance(lookahead, int) else lookahead + as_0d(bs - 1)
        held1 = np.maximum(held0, blocks_of(comp1 + ahead))
        need_pg = held1 - held0
        cum = np.add.accumulate(need_pg * G if G > 1 else need_pg)  # new blocks, all groups
        filled = blocks_of(comp1) - blocks_of(comp0)
        # Entries per row and group: what a plain decode of k tokens can need
        # (so a steady decode keeps one bucket), more when a row needs more.
        need_max, filled_max = largest_element(need_pg), largest_element(filled)
        A = max(-(-(k + la_max) // bs), pow2_at_least(need_max))
        C = max(-(-k // bs), pow2_at_least(filled_max))
        stops = released = None
        L = most_released = 0
        if self._window_groups:
            starts = rs.null_until[rows]
            stops = self._window_stops(comp0 if processed is None else processed, starts, held0)
            released = (stops - starts)[:, self._window_groups]
            most_released = int(released.max())
            L = pow2_at_least(max(1, most_released))
        bucket = (pow2_at_least(max(B, 8)), k, L, A, C)
        if not self._events_off:  # (each phase's event entries are drained whether it ran or not)
            phases = ALL_DECODE_PHASES
        else:  # the phases with work: a block to release, to pop, to hash (a known one filled), to cache
            # (a known block fills whether or not a computed one does: a row appending beyond its chunk)
            offsets = self._offset_of(n)
            fills_known = k > 0 and (largest_element(offsets) + k if num_new is None
                                     else largest_element(offsets + num_new)) >= bs
            phases = decode_phases(most_released > 0, need_max > 0, fills_known, filled_max > 0)
        host = self._write_plan(bucket, rows, (n, nnew, comp0, comp1, held0, need_pg, cum), stops, released)
        total = int(cum[-1])
        return DecodePlan(rows, bucket, total, cum, held0, ntok1, comp1, held1, stops,
                          total <= self._s.free_lower_bound, phases, host)

    def _window_stops(self, num_tokens: np.ndarray, starts: np.ndarray, held: np.ndarray) -> np.ndarray:
        """Per (request, group): where the null blocks end once the window
        groups release what ``num_tokens`` processed tokens no longer see, in
        the ``held`` blocks (``gpukv.core.windows``: ``released_until``)."""
        stops = starts.copy()
        for g in self._window_groups:
            stops[:, g] = np.maximum(self._policies[g].released_until(num_tokens, held), starts[:, g])
        return stops

    def _write_plan(self, bucket: tuple, rows: np.ndarray, counts: tuple, stops, released) -> dict:
        """The plan's uploaded arrays, into this step's host array of the
        bucket: per row its counts, and the window releases. Returns the
        array's named views (``host_plan``)."""
        B = len(rows)
        v = self.host_plan(bucket)
        v["rows"][:B] = rows
        v["ntok"][:B], v["nnew"][:B], v["comp0"][:B], v["comp1"][:B], v["held"][:B], v["need"][:B], v["cum"][:B] = (
            counts)
        if v["padded_from"] != B:  # (the rows past the batch: no row, beyond every total)
            v["rows"][B:] = -1
            v["cum"][B:] = decode_ops.BIG
            v["padded_from"] = B
        L = bucket[2]
        if stops is not None and L:
            wg = self._window_groups
            ell = np.arange(L)
            v["r_row"][:B] = rows[:, None, None]
            v["r_pos"][:B] = np.maximum(stops[:, wg][:, :, None] - 1 - ell, 0)
            v["r_valid"][:B] = ell < released[:, :, None]
            v["r_valid"][B:] = 0
        return v

    def _expect_events(self, bufs) -> None:
        """With a KV-event log, the entries this step's launches may record
        (its buffers' allocation and caching widths); without one, nothing
        (two tensor shapes a step saved)."""
        if not self._events_off:
            self._events.expect(bufs.views["alloc"].shape[1] + bufs.views["record"].shape[1])

    def host_plan(self, bucket: tuple) -> dict:
        """Named views of this step's host plan array of the bucket (the
        uploaded part of its layout: ``Staging.host_array``, written in place
        and sent as it is), with the parts that never change filled in."""
        staging = self._s.staging
        cached = self.host_plans.get((bucket, staging.parity))
        if cached is not None:
            return cached
        BP, k, L = bucket[:3]
        layout = self.layout(bucket)
        size, tokens = uploaded_size(bucket, layout)
        packed = staging.host_array(("decode", bucket), size + tokens)
        views: dict[str, Any] = {"tokens": packed[size:].view(np.int64).reshape(BP, k)}
        off = 0
        for name, n in layout:
            if name in UPLOADED:
                views[name] = packed[off: off + n]
                off += n
        if L:
            W, G = len(self._window_groups), self.num_groups
            for name in ("r_grp", "r_row", "r_pos", "r_call", "r_valid"):
                views[name] = views[name].reshape(BP, W, L)
            views["r_grp"][:] = np.array(self._window_groups)[None, :, None]
            views["r_call"][:] = np.arange(BP)[:, None, None] * G + views["r_grp"]
        views["padded_from"] = -1  # the batch size whose padding the views hold (none yet)
        self.host_plans[(bucket, staging.parity)] = views
        return views

    def layout(self, bucket: tuple) -> list[tuple[str, int]]:
        """The bucket's device plan layout (``decode_layout``)."""
        return decode_layout(bucket, self.num_groups, len(self._window_groups))

    # ----------------------------------------------------------------- stage
    def stage(self, plan: DecodePlan, tokens) -> DecodeBuffers:
        """The plan and the new tokens into the bucket's fixed buffers, in
        one copy (pinned, non-blocking): host tokens (int64, checked) are
        written into the plan's host array behind its arrays; tokens already
        on the device are copied over that part after it."""
        bufs = self.buffers.get(plan.bucket)
        if bufs is None:
            bufs = self.buffers[plan.bucket] = decode_buffers(plan.bucket, self.layout(plan.bucket), self.device)
        on_device = isinstance(tokens, torch.Tensor)
        if not on_device:
            (self.host_plan(plan.bucket) if plan.host is None else plan.host)["tokens"][: len(tokens)] = tokens
        self._s.staging.upload_host(("decode", plan.bucket), bufs.uploaded)
        if on_device:  # (as int64, int32 sign-extended: decode_fit checks the range)
            bufs.new_tokens[: len(plan.rows)].copy_(tokens)
        return bufs

    # ---------------------------------------------------------------- launch
    def launch(self, bucket: tuple, bufs: DecodeBuffers, phases: frozenset[str] | None = None) -> None:
        """For a bucket, a fixed sequence
        reading only its fixed buffers and the pool (what a CUDA graph
        captures: ``phases`` None, every phase). An eager step passes its
        plan's ``phases`` and launches nothing for a phase with no work (a
        launch costs host time whatever it does). The first step of a bucket
        to run a phase runs its launchers and keeps the launches; later steps
        replay them, skipping the launchers' Python."""
        key = ALL_DECODE_PHASES if phases is None else phases
        kept = bufs.runs.get(key)
        generation = self._rows.generation
        if kept is not None and kept[0] == generation and self._events_off:
            capture.run_prepared(kept[1])  # (the phases' kept launches, in order: no lookup per phase)
            return
        run = [p for p in DECODE_PHASES if p in key and (p != "release" or bucket[2])]  # (no window group: none)
        for phase in run:
            self._launches.replayed(bufs.prepared, _DECODE_PART[phase], lambda p=phase: self._launch_phase(p, bufs))
        if self._events_off:
            bufs.runs[key] = (generation, [one for p in run for one in bufs.prepared[_DECODE_PART[p]][1]])

    def _launch_phase(self, phase: str, bufs: DecodeBuffers) -> None:
        v, pool, rows = bufs.views, self._pool, self._rows
        if phase == "release":  # window groups release what their window left behind
            pool.release(rows.block_table, v["r_grp"], v["r_row"], v["r_pos"], v["r_call"], valid=v["r_valid"],
                         scratch=bufs.release_scratch, workspace=bufs.release_workspace)
        elif phase == "fit":
            decode_ops.decode_fit(v["rows"], v["ntok"], v["nnew"], v["comp0"], v["comp1"], v["held"], v["need"],
                                  v["cum"], v["h_start"], v["h_count"], v["alloc"], v["record"], bufs.new_tokens,
                                  tokens=rows.tokens, extras=rows.extras, fq_counters=pool.free_queue.counters,
                                  count=bufs.count, status=bufs.status, blocked=self._blocked,
                                  num_groups=self.num_groups, block_size=self.block_size)
        elif phase == "allocate":
            grp, row, pos, want, rank = v["alloc"]
            pool.allocate(bufs.count, want, grp, row, pos, block_table=rows.block_table, rank=rank,
                          popped=bufs.popped, on_popped=self._events.popped_hook())
        elif phase == "hash":
            self._launches.hash_rows(v["rows"], v["h_start"], v["h_count"])
        else:
            self._launches.cache_blocks(*v["record"], scratch=bufs.record_scratch, seq=bufs.record_seq)

    # ---------------------------------------------------------------- finish
    def finish(self, plan: DecodePlan, bufs: DecodeBuffers) -> StepResult:
        """The host's mirror up to date;
        reads the device only when the host could not tell the batch fits.
        (Also the table's rebuild when due: decided on the host, never part
        of a graph.)"""
        s = self._s
        B = len(plan.rows)
        self._expect_events(bufs)
        if plan.fits_known:
            n_fit = B
            s.free_lower_bound -= plan.num_new_blocks
        else:
            status = self._reads.status_and_events(bufs.status)
            self._reads.check_errors(status[decode_ops.ST_QUEUE_ERRORS], "new_token_ids")
            n_fit = int(status[decode_ops.ST_FIT])
            s.free_lower_bound = int(status[decode_ops.ST_FREE_AFTER])
        self.finish_running(plan, n_fit)
        return StepResult(running_failed_at=None if n_fit == B else n_fit)

    def finish_running(self, plan: DecodePlan, n_fit: int) -> None:
        """The host's mirror after a running batch of which the first
        ``n_fit`` rows got their blocks (every row released behind its
        window), and the table's rebuild when what they popped makes it due
        (after the fit is known: rows that did not fit popped nothing)."""
        self._launches.rebuild_if_due(plan.blocks_popped(n_fit))
        done, known, computed, held = plan.rows, plan.num_tokens, plan.computed, plan.held
        if n_fit == len(done):  # (``decode_fit`` wrote 0: every real row fit)
            self._blocked_clear = True
        else:  # (only the first rows got theirs; all of them, the common case, take no slices)
            done, known, computed, held = done[:n_fit], known[:n_fit], computed[:n_fit], held[:n_fit]
        rows = self._rows
        rows.num_tokens[done], rows.num_computed[done], rows.num_held[done] = known, computed, held
        if plan.window_stops is not None:
            rows.null_until[plan.rows] = plan.window_stops

    # ------------------------------------------------- the four, for a batch
    def launch_running(self, run: RunningRows, graphs=None) -> tuple[DecodePlan, DecodeBuffers]:
        """Plan, stage and launch a running batch (``decode``'s kernels; the
        launch here, or ``graphs.run(bucket, launch)`` runs ``launch_staged``
        as its ``launch``, the protocol the admission's graphs follow too);
        the host's mirror is brought up to date by ``finish``."""
        plan = self.plan(run.rows, run.tokens.shape[1], run.num_tokens, chunks=run.chunks, lookahead=run.lookahead,
                         num_new=run.counts, processed=run.processed)
        bufs = self.stage(plan, run.tokens)
        self._blocked_clear = False  # (``decode_fit`` writes it, whatever happens past here)
        if graphs is None:
            self.launch(plan.bucket, bufs, plan.phases)
            return plan, bufs
        self.staged = bufs  # (the one launch ``launch_staged`` takes: these buffers, from this call)
        try:
            with self._calls.hook():  # (the caller's code: the manager's own calls refused there)
                graphs.run(plan.bucket, lambda: self.launch_staged(plan.bucket, bufs))
        finally:
            self.staged = None
        return plan, bufs

    def launch_staged(self, bucket: tuple, bufs: DecodeBuffers, phases: frozenset[str] | None = None) -> None:
        """``launch`` of the buffers the running decode just staged, every
        phase with ``phases`` None (what a caller's ``graphs`` runs, and a
        CUDA graph captures); any other buffers, or a launch outside a
        decode, are refused. A decode's parts (plan, stage, launch, finish)
        run inside one ``decode`` call, under its call lock: they share each
        bucket's host plan and device buffers, so parts run apart (another
        thread's, or this one's, stage between a stage and its launch) would
        launch one plan's kernels on another's tokens and leave the host's
        mirror behind the device."""
        if bufs is not self.staged or bucket not in self.buffers or self.buffers[bucket] is not bufs:
            raise InvalidInputError("only the decode running now may launch its kernels, on the buffers it "
                                    "staged", argument="bufs",
                                    fix="call decode(rows, new_token_ids, graphs=...): it plans, stages, launches "
                                        "and finishes in one call")
        self.launch(bucket, bufs, phases)

    def run_phase(self, running) -> RunningPhase | None:
        """A step's phase 2 launched, as the batched decode runs it: a
        normalised ``RunningBatch``, or ``RunningUpdate``s laid out as one
        (``running_rows``); None when nothing runs. Whether all fit rides on
        the step's read unless the host's bound covers them (tokens on the
        device: always, so that an id out of range raises in this step). The
        admission's kernels read ``_blocked``, which ``decode_fit`` writes."""
        if not isinstance(running, RunningRows):
            running = self.running_rows(running) if running else None
        if running is None or not len(running.rows):
            if not self._blocked_clear:
                self._blocked.zero_()
                self._blocked_clear = True
            return None
        plan, bufs = self.launch_running(running)
        self._expect_events(bufs)
        read = not plan.fits_known or isinstance(running.tokens, torch.Tensor)
        n_ok = bufs.status[decode_ops.ST_FIT: decode_ops.ST_FIT + 1] if read else None
        return RunningPhase(plan.rows, plan.held_before, plan.held, plan.num_new_blocks, n_ok, plan)

    def finish_phase(self, run: RunningPhase, result: StepResult, n_ok: int | None) -> None:
        """Phase 2's mirror, once the step's read said how many fit (None:
        no read, every update fit, and the bound drops by what they took)."""
        if n_ok is None:
            n_ok = run.size
            self._s.free_lower_bound -= run.total
        self.finish_running(run.plan, n_ok)
        result.running_failed_at = None if n_ok == run.size else n_ok

    def running_rows(self, running: Sequence[RunningUpdate]) -> RunningRows:
        """Normalised ``RunningUpdate``s as the batch they are: rows, their
        tokens padded into ``[B, K]`` rows (a device tensor when any update's
        are on the device), chunks, lookahead and processed tokens per row."""
        reqs = self._reqs
        rows = np.fromiter((reqs[u.request_id] for u in running), np.int64, len(running))
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
        processed = None
        if any(u.num_processed_tokens is not None for u in running):  # (None: the computed tokens)
            computed = self._rows.num_computed[rows].tolist()
            processed = np.fromiter((c if u.num_processed_tokens is None else u.num_processed_tokens
                                     for u, c in zip(running, computed, strict=True)), np.int64, len(running))
        return RunningRows(rows, tokens, None if int(counts.min()) == width else counts, num_tokens, chunks,
                           lookahead, processed)
