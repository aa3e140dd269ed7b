"""What the device manager holds for its parts, typed: ``DeviceState`` (the
pool, the request rows and their index, the staging, the events, the host
figures the parts keep up to date) and ``DeviceCalls`` (the manager's calls
the parts run: its one read, its step, its argument checks and its call
markers).

The manager builds one ``DeviceState`` at construction and hands it, with
itself as the ``DeviceCalls``, to each part's constructor (collaborators
passed in, none reached through the manager): a part sees what it uses by
type, and mypy checks every use.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from gpukv.core.blocks import ManagerLimits
from gpukv.core.metrics import PrefixCacheStats

if TYPE_CHECKING:
    from gpukv.core.requests import Step, StepOutputs, StepResult
    from gpukv.core.windows import Policy
    from gpukv.device.events import DeviceEvents
    from gpukv.device.pool import DevicePool
    from gpukv.device.reads import FreeCountMirror
    from gpukv.device.rows import DeviceRows
    from gpukv.device.staging import Staging, StepCounters


@dataclass(eq=False)
class DeviceState:
    """One device manager's state its parts share. The objects are the
    manager's own (it keeps them under its names too); the host figures
    (``free_lower_bound``, ``counting_depth``, ``stats``) live here only,
    as the parts change them."""

    device: torch.device
    block_size: int
    sliding_windows: list[int | None]
    enable_caching: bool
    pool: DevicePool
    key: bytes
    #: The key as the hashing kernel's lanes, on the device.
    key_dev: torch.Tensor
    #: The root digest (block 0's parent) as two signed int64 lanes.
    root_lanes: tuple[int, int]
    limits: ManagerLimits
    policies: list[Policy]
    #: Blocks a window group must still see at a hit boundary, per group (-1: full attention); on the host.
    window_blocks: list[int]
    #: ``window_blocks`` on the device (int32[G]).
    win_dev: torch.Tensor
    rows: DeviceRows
    reqs: dict[str, int]  # request id -> row
    row_ids: dict[int, str]  # row -> request id
    events: DeviceEvents
    counters: StepCounters
    staging: Staging
    mirror: FreeCountMirror
    #: int32[1] on the device: a running update did not fit.
    blocked: torch.Tensor
    #: The host's lower bound of free blocks (a read sets it, a step's allocations lower it).
    free_lower_bound: int
    #: Nested step accountings under way (``gpukv.device.calls.StepAccounting``).
    counting_depth: int = 0
    #: Counted on the host from the hits each step reads anyway.
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)

    @property
    def num_groups(self) -> int:
        return len(self.sliding_windows)


class DeviceCalls(Protocol):
    """The device manager's calls its parts run (``DeviceManager`` is one)."""

    def _read(self, t: torch.Tensor) -> list:
        """The one device-to-host read, counted, on the manager's stream."""
        ...

    def _step(self, finished: Any, running: Any, new: Any, *, count_stats: bool = ..., hit_caps: Any = ...,
              token_budget: int | None = ..., graphs: Any = ..., outputs: StepOutputs = ...) -> StepResult:
        """A step on normalised arguments."""
        ...

    def _normalize(self, finished: Any, running: Any, new: Any, *, single: bool = ...,
                   defer_admissible: bool = ...) -> Step:
        """Every argument checked and normalised, before anything changes."""
        ...

    def _begin_changes(self) -> None:
        """The running call's point of first change."""
        ...

    def _counting(self) -> AbstractContextManager[None]:
        """One step's accounting."""
        ...

    def _hook(self) -> AbstractContextManager[Any]:
        """A context for a caller's code run inside a call."""
        ...

    def get_block_ids(self, request_id: str) -> list[list[int]]:
        """The request's block ids per group; reads the device."""
        ...
