"""The device manager's step outputs: what a serving loop reads after a step
(each grown request's new block ids, each admitted request's blocks, one
request's reference counts for vLLM's common prefix), gathered on the device
into one buffer that rides on the step's status read.

Plan on the host, run on the device: the host knows, from its own counts,
every position to read (a running request's new blocks lie between the
blocks it held before and after the step; an admitted request's blocks are
at most the blocks its whole prompt and lookahead need), so it lays out the
entries with numpy (``entry_layout``), uploads them once into a buffer of a
size bucket, and one kept launch (``kernels/gather.py``) fills the output
buffer. After the read the host keeps what the device decided: the running
requests that fit, the admitted ones, each admitted request's real block
count.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from gpukv.device.rows import entry_layout
from gpukv.kernels import gather as gather_ops
from gpukv.kernels.toolkit import pow2_at_least

if TYPE_CHECKING:
    from gpukv.device.launches import SharedLaunches
    from gpukv.device.state import DeviceState


@dataclass
class GatherBuffers:
    """One size bucket's fixed device buffers: the entries (int32[3, EP]),
    the output (int64[2, EP]) and the kept launch."""

    entries: torch.Tensor
    out: torch.Tensor
    prepared: dict = field(default_factory=dict)


@dataclass
class GatherPlan:
    """A step's laid-out reads: per segment (a request and group) its first
    entry and length; ``running`` B requests, ``candidates`` K, then the
    prefix request (one segment per group) when asked for."""

    num_running: int
    num_candidates: int
    starts: np.ndarray  # int64[S, G] first entry of each segment
    counts: np.ndarray  # int64[S, G] its entries
    prefix: bool
    num_entries: int
    bucket: int = 0


class OutputGather:
    """Lays out, launches and parses a step's output gather for one device
    manager (``state``: its staging, rows and pool; ``launches``: the
    kept-launch replay)."""

    def __init__(self, state: DeviceState, launches: SharedLaunches) -> None:
        self._s = state
        self._launches = launches
        self._bufs: dict[int, GatherBuffers] = {}

    def plan(self, running: tuple[np.ndarray, np.ndarray, np.ndarray] | None,
             candidates: tuple[np.ndarray, np.ndarray] | None,
             prefix: tuple[int, int] | None) -> GatherPlan:
        """The entries to read: ``running`` (rows, blocks held before, after;
        int64[B] each), ``candidates`` (rows, most blocks they can hold after
        admission; int64[K] each), ``prefix`` (row, blocks it holds at most),
        every group of each; a window group's prefix reads nothing."""
        s = self._s
        G = s.num_groups
        full = np.array([w is None for w in s.sliding_windows])
        parts = []  # (rows, starts, stops): segments of requests, every group
        if running is not None:
            r, h0, h1 = running
            parts.append((r, h0, h1))
        if candidates is not None:
            r, upper = candidates
            parts.append((r, np.zeros(len(r), dtype=np.int64), upper))
        if prefix is not None:
            row, n = prefix
            parts.append((np.array([row], dtype=np.int64), np.zeros(1, dtype=np.int64), np.array([n])))
        B = len(parts[0][0]) if running is not None else 0
        K = len(candidates[0]) if candidates is not None else 0
        rows = np.concatenate([p[0] for p in parts]) if parts else np.zeros(0, dtype=np.int64)
        st = np.concatenate([p[1] for p in parts]) if parts else np.zeros(0, dtype=np.int64)
        sp = np.concatenate([p[2] for p in parts]) if parts else np.zeros(0, dtype=np.int64)
        if G > 1:  # every group of each segment
            st, sp = np.repeat(st[:, None], G, 1), np.repeat(sp[:, None], G, 1)
            if prefix is not None:
                sp[-1] = np.where(full, sp[-1], 0)  # a window group's prefix reads nothing
        else:
            st, sp = st[:, None], sp[:, None]
            if prefix is not None and not full[0]:
                sp[-1] = 0
        counts = sp - st
        flat = counts.ravel()
        first = (np.cumsum(flat) - flat).reshape(counts.shape)
        req, grp, pos, _ = entry_layout(st, sp)
        E = len(req)
        EP = pow2_at_least(max(E, 16))
        host = s.staging.host_array(("gather", EP), 3 * EP).reshape(3, EP)
        host[0, :E], host[1, :E], host[2, :E] = grp, rows[req], pos
        host[1, E:] = -1
        return GatherPlan(B, K, first, counts, prefix is not None, E, EP)

    def launch(self, plan: GatherPlan) -> torch.Tensor:
        """Upload the plan and gather: the output's used part, int64[2, E]
        (block ids, then their reference counts), to read with the step."""
        s = self._s
        EP = plan.bucket
        bufs = self._buffers(EP)
        s.staging.upload_host(("gather", EP), bufs.entries)
        self._launches.replayed(bufs.prepared, "gather", lambda: gather_ops.gather_blocks(
            bufs.entries.view(3, EP), s.rows.block_table, s.pool.ref_cnt, bufs.out))
        return bufs.out[:, : plan.num_entries]

    def _buffers(self, EP: int) -> GatherBuffers:
        bufs = self._bufs.get(EP)
        if bufs is None:
            dev = self._s.device
            bufs = self._bufs[EP] = GatherBuffers(entries=torch.zeros(3 * EP, dtype=torch.int32, device=dev),
                                                  out=torch.zeros((2, EP), dtype=torch.int64, device=dev))
        return bufs


def _segments(ids: list, starts: np.ndarray, counts: np.ndarray) -> list[list[list[int]]]:
    """Per group, the entries of each segment (``starts``/``counts`` [S, G])."""
    return [[ids[a: a + c] for a, c in zip(starts[:, g].tolist(), counts[:, g].tolist(), strict=True)]
            for g in range(starts.shape[1])]


class StepGather:
    """One step's output gather: laid out and launched before each read of
    the step (``parts``), its values kept after it (``took``), and what the
    step returns made from the last of them (``finish``).

    The prefix request is either held before the step (``prefix``: its row
    and the most blocks it holds after) or one of the step's new requests
    (``prefix_new``: its index): then its reference counts come from its own
    entries in the round that admits it, and later rounds read it as a held
    request (their admissions can add references to its blocks)."""

    def __init__(self, gather: OutputGather, running: tuple | None, prefix: tuple[int, int] | None,
                 block_ids: bool, num_groups: int, prefix_new: int | None = None) -> None:
        self._gather = gather
        self._running = running if block_ids else None
        self._prefix = prefix
        self._prefix_new = prefix_new
        self._block_ids = block_ids
        self._plan: GatherPlan | None = None
        self._values: list = []
        self._candidates_from = 0  # the first new request of the last round's candidates
        self._prefix_refs_at = (0, 0)  # a new prefix request's segment in its round, and its blocks
        self.admitted: list[list[list[int]]] = [[] for _ in range(num_groups)]

    def parts(self, candidates: tuple[np.ndarray, np.ndarray] | None = None, first: int = 0) -> list[torch.Tensor]:
        """Lay out and launch this read's gather (``candidates``: the
        admission round's rows and their most blocks, new requests from index
        ``first`` on); the tensors to read."""
        want = self._block_ids or (self._prefix_new is not None and self._prefix is None)
        plan = self._plan = self._gather.plan(self._running, candidates if want else None, self._prefix)
        self._candidates_from = first
        out = self._gather.launch(plan)
        return [out[0], out[1]]

    def took(self, values: list, admitted_rows: np.ndarray | None = None,
             admitted_blocks: np.ndarray | None = None) -> None:
        """This read's values of ``parts``; ``admitted_rows`` and
        ``admitted_blocks``: the rows of the candidates the round admitted (a
        prefix of them) and how many blocks each holds."""
        self._values = values
        plan = self._plan
        assert plan is not None
        if admitted_blocks is None or not len(admitted_blocks):
            return
        B = plan.num_running
        firsts = plan.starts[B: B + len(admitted_blocks)]
        counts = np.repeat(np.asarray(admitted_blocks, dtype=np.int64)[:, None], firsts.shape[1], 1)
        if self._block_ids:
            for g, ids in enumerate(_segments(values[: plan.num_entries], firsts, counts)):
                self.admitted[g] += ids
        j = None if self._prefix_new is None else self._prefix_new - self._candidates_from
        if self._prefix is None and j is not None and 0 <= j < len(admitted_blocks):
            assert admitted_rows is not None
            self._prefix = (int(admitted_rows[j]), int(admitted_blocks[j]))  # (later rounds read it as held)
            self._prefix_refs_at = (B + j, int(admitted_blocks[j]))

    def finish(self, num_fit: int, prefix_blocks: int, windows: list) -> tuple[list | None, list | None, list | None]:
        """Per group the first ``num_fit`` running requests' new blocks and
        the admitted requests' blocks (None without ``block_ids``), and the
        prefix request's reference counts of its ``prefix_blocks`` blocks
        (None for a window group; None without a prefix, or when the prefix
        request was a new one not admitted)."""
        plan = self._plan
        assert plan is not None
        E, values = plan.num_entries, self._values
        running = admitted = prefix = None
        if self._block_ids:
            B = plan.num_running
            running = _segments(values[:E], plan.starts[:B][:num_fit], plan.counts[:B][:num_fit])
            admitted = self.admitted
        segment = None
        if plan.prefix:
            segment = plan.starts[-1].tolist()
        elif self._prefix is not None:  # admitted in the last round: its own entries
            segment = plan.starts[self._prefix_refs_at[0]].tolist()
        if segment is not None:
            refs = values[E: 2 * E]
            prefix = [None if w is not None else refs[a: a + prefix_blocks]
                      for a, w in zip(segment, windows, strict=True)]
        return running, admitted, prefix


def step_gather(s: DeviceState, gather: OutputGather, run: Any, outputs: Any, new: list) -> StepGather:
    """A device manager's (``s``: its state; ``gather``: its output gather) step output gather: the running rows' new
    blocks (``run``: the step's ``RunningPhase``, or None), and
    ``outputs.prefix_of``'s blocks up to the most it holds after (a new
    request's: from its admission's own entries)."""
    running = None if run is None else (run.rows, run.held_before, run.held_after)
    prefix = prefix_new = None
    if outputs.prefix_of is not None and outputs.prefix_of not in s.reqs:
        prefix_new = next(i for i, r in enumerate(new) if r.request_id == outputs.prefix_of)
    elif outputs.prefix_of is not None:
        row = s.reqs[outputs.prefix_of]
        n = int(s.rows.num_held[row])
        at = np.flatnonzero(run.rows == row) if run is not None else np.zeros(0, np.int64)
        if run is not None and len(at):
            n = int(run.held_after[at[0]])  # (if it fits; the read says, and take_step_outputs cuts)
        prefix = (row, n)
    return StepGather(gather, running, prefix, outputs.block_ids, s.num_groups, prefix_new)


def take_step_outputs(s: DeviceState, result: Any, run: Any, outputs: Any, tail: StepGather) -> None:
    """What a device manager's (``s``: its state) step hands back (into ``result``, a
    ``StepResult``), from its last read's gather."""
    n_fit = 0 if run is None else run.size if result.running_failed_at is None else result.running_failed_at
    row = None if outputs.prefix_of is None else s.reqs.get(outputs.prefix_of)
    held = 0 if row is None else int(s.rows.num_held[row])
    running, admitted, prefix = tail.finish(n_fit, held, s.sliding_windows)
    if outputs.block_ids:
        result.running_block_ids, result.admitted_block_ids = running, admitted
    if row is not None:
        result.prefix_ref_counts = prefix
