"""The device manager's releases: finished requests' blocks given back
(vLLM's ``free``: tail first, group by group), in one upload and three kept
launches per size bucket.

The host lays the entries out from its own block counts (``entry_layout``)
into fixed buffers of a bucket (entries padded to a power of two from 16,
the padding masked off); the first release of a bucket runs the pool's
``release`` and keeps its launches, later ones replay them: a free launched
anew went through Triton's whole launch path three times, and its
launchers' checks, every step that finished a request. A bucket can be
prepared before serving (``prepare``: a release of no entry), so that no
free pays that first time on the serving path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from gpukv.device.rows import entry_layout
from gpukv.kernels.toolkit import pow2_at_least

if TYPE_CHECKING:
    from gpukv.device.launches import SharedLaunches
    from gpukv.device.state import DeviceState


@dataclass
class ReleaseBuffers:
    """Fixed device buffers of one release bucket: the uploaded entries
    (int32[5, EP]: group, row, position, call, valid), the kernels' scratch,
    and the kept launches."""

    plan: torch.Tensor
    scratch: torch.Tensor
    workspace: torch.Tensor
    prepared: dict = field(default_factory=dict)  # "release" -> (rows generation, replayable launches)

    @classmethod
    def create(cls, EP: int, device: torch.device) -> ReleaseBuffers:
        return cls(plan=torch.zeros(5 * EP, dtype=torch.int32, device=device),
                   scratch=torch.zeros((2, EP), dtype=torch.int32, device=device),
                   workspace=torch.zeros(EP, dtype=torch.int64, device=device))


#: The smallest release bucket (entries padded to a power of two from it).
MIN_BUCKET = 16


def single_request_buckets(max_tokens: int, block_size: int, num_groups: int) -> list[int]:
    """The release buckets (padded entry counts) the free of one request
    holding at most ``max_tokens`` token slots can meet, smallest first:
    powers of two from 16 to the one that takes every position of every
    group."""
    most = pow2_at_least(max(-(-max_tokens // block_size) * num_groups, MIN_BUCKET))
    return [MIN_BUCKET << k for k in range((most // MIN_BUCKET).bit_length())]


class Releases:
    """The releases of one device manager (``state``: its requests, rows,
    pool and staging; ``launches``: the kept-launch replay), with the
    buffers of each bucket (``buffers``, by padded entry count)."""

    def __init__(self, state: DeviceState, launches: SharedLaunches) -> None:
        self._s = state
        self._launches = launches
        self.buffers: dict[int, ReleaseBuffers] = {}

    def requests(self, request_ids: Sequence[str]) -> None:
        """Free whole requests: one free call per request and group, tail first; forget them."""
        s = self._s
        rows = np.array([s.reqs.pop(rid) for rid in request_ids], dtype=np.int64)
        G = s.num_groups
        nb = s.rows.num_held[rows]
        idx, grp, ps, call = entry_layout(np.zeros((len(rows), G), dtype=np.int64), np.repeat(nb[:, None], G, 1),
                                          reverse=True)
        if len(idx):
            self.entries(rows[idx], grp, ps, call)
        for row in rows.tolist():
            del s.row_ids[row]
        s.rows.release(rows)

    def entries(self, rows, grp, pos, call) -> None:
        """Release the blocks at these block-table entries (``call``: the
        free call each belongs to, never decreasing): one upload into the
        bucket's buffers, its launches kept or replayed."""
        E = len(grp)
        EP = pow2_at_least(max(E, MIN_BUCKET))
        host = self._s.staging.host_array(("release", EP), 5 * EP).reshape(5, EP)
        host[:4, :E] = (grp, rows, pos, call)
        host[4, :E] = 1
        if E < EP:  # padding: no entry, and a call of its own after the last (calls never decrease)
            host[3, E:] = int(call[-1]) + 1
            host[4, E:] = 0
        self._run(EP)

    def prepared(self, EP: int) -> bool:
        """Whether bucket ``EP``'s launches are kept."""
        bufs = self.buffers.get(EP)
        return bufs is not None and self._launches.is_kept(bufs.prepared, "release")

    def prepare(self, EP: int) -> None:
        """Bucket ``EP``'s buffers made and its launches kept by a release
        of no entry (every entry masked off, in one call: no count, table
        slot or queue entry changes), so the first free of that size
        replays them. With KV-cache events no launch is kept
        (``SharedLaunches.replayed``): the buffers are made and the kernels
        compiled."""
        self._s.staging.host_array(("release", EP), 5 * EP)[:] = 0
        self._run(EP)

    def _run(self, EP: int) -> None:
        """Bucket ``EP``'s entries, written in its host array, uploaded in
        one copy; its launches kept or replayed."""
        s = self._s
        bufs = self.buffers.get(EP)
        if bufs is None:
            bufs = self.buffers[EP] = ReleaseBuffers.create(EP, s.device)
        s.staging.upload_host(("release", EP), bufs.plan)
        self._launches.replayed(bufs.prepared, "release", lambda: self._launch(bufs))

    def _launch(self, bufs: ReleaseBuffers) -> None:
        grp, row, pos, call, valid = bufs.plan.view(5, -1)
        self._s.pool.release(self._s.rows.block_table, grp, row, pos, call, valid=valid, scratch=bufs.scratch,
                             workspace=bufs.workspace)
