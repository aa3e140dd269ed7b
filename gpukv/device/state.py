"""What the device manager holds for its parts, typed: ``DeviceState`` (the
pool, the request rows and their index, the staging, the events, the host
figures the parts keep up to date) and ``DeviceCalls`` (the manager's calls
the parts run, under public names: its one read, its step, its argument
checks and its call markers).

The manager builds one of each at construction and hands them to each
part's constructor (collaborators passed in, none reached through the
manager): a part sees what it uses by type, reads no private attribute of
another object, and mypy checks every use.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from gpukv.core.blocks import ManagerLimits
from gpukv.core.metrics import PrefixCacheStats
from gpukv.core.windows import is_hybrid

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
    #: The mutation epoch: advanced at every call's point of first change (``DeviceManager._begin_changes``),
    #: which every call that may change the pool, the rows or the cache passes first; unchanged, nothing changed.
    epoch: int = 0
    #: Counted on the host from the hits each step reads anyway.
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)

    @property
    def num_groups(self) -> int:
        return len(self.sliding_windows)

    def __post_init__(self) -> None:
        #: Whether the model has both full-attention and sliding-window groups: its lookups report the
        #: full-attention groups' own hit (read once: an admission asks several times).
        self.hybrid = is_hybrid(self.sliding_windows)


class StepCall(Protocol):
    """``DeviceCalls.step``'s signature: a step on normalised arguments."""

    def __call__(self, finished: Any, running: Any, new: Any, *, count_stats: bool = ..., hit_caps: Any = ...,
                 token_budget: int | None = ..., graphs: Any = ..., outputs: StepOutputs = ...,
                 hit_touches: Any = ...) -> StepResult:
        ...


class NormalizeCall(Protocol):
    """``DeviceCalls.normalize``'s signature: every argument checked and normalised."""

    def __call__(self, finished: Any, running: Any, new: Any, *, single: bool = ...,
                 defer_admissible: bool = ...) -> Step:
        ...


class DeviceCalls:
    """The device manager's calls its parts run, under public names: the
    manager's own bound methods, handed over once at construction, so a
    part never reaches into the manager. A method held in a slot costs a
    call what the attribute lookup on the manager did (the decode's host
    budget). ``read`` is the one slot a manager lets a caller replace (its
    ``_read`` setter: a test's or a benchmark's wrapper then reaches every
    part's read); the parts look it up per read for that reason."""

    __slots__ = ("read", "step", "normalize", "begin_changes", "counting", "hook", "get_block_ids")

    def __init__(self, *, read: Callable[[torch.Tensor], list], step: StepCall, normalize: NormalizeCall,
                 begin_changes: Callable[[], None], counting: Callable[[], AbstractContextManager[None]],
                 hook: Callable[[], AbstractContextManager[Any]],
                 get_block_ids: Callable[[str], list[list[int]]]) -> None:
        #: The one device-to-host read, counted, on the manager's stream.
        self.read = read
        #: A step on normalised arguments (its phases in order).
        self.step = step
        #: Every argument checked and normalised, before anything changes.
        self.normalize = normalize
        #: The running call's point of first change (``gpukv.core.failstop``).
        self.begin_changes = begin_changes
        #: One step's accounting (``gpukv.device.calls.StepAccounting``).
        self.counting = counting
        #: A context for a caller's code run inside a call (its graphs): the manager's own calls refused there.
        self.hook = hook
        #: The request's block ids per group; reads the device.
        self.get_block_ids = get_block_ids
