"""The block-manager API both managers offer, as a ``typing.Protocol``.

``gpukv.ReferenceManager`` (the executable spec, on the host) and
``gpukv.DeviceManager`` (state and kernels on the device) take the
same constructor arguments and answer the same calls with the same results
(the differential tests hold them to it);
``tests/core/test_api.py`` checks that both satisfy this protocol, member by member
and signature by signature. ``docs/api.md`` maps each member to vLLM 0.8.5's
``KVCacheManager``.

Naming rule: a query that waits for the device is a ``read_*()`` method, but
for four that keep vLLM's or the reference's names and say "reads the device"
in their docstrings: ``free_queue()``, ``get_block_ids()``,
``get_num_common_prefix_blocks()`` and ``block_hashes()`` (and the debugging
check ``check_invariants()``). On the device manager the vLLM-style calls
wait too: ``get_computed_blocks()`` for the hit it returns,
``allocate_slots()`` for the step's status and the new block ids,
``reset_prefix_cache()`` for the free count, ``take_events()`` for the events
of steps that read nothing; a step (``step``, ``decode``, ``free``) reads at
most once, its status, and not at all when the host proves it fits. The
properties ``num_free_blocks``, ``num_evictions`` and ``usage`` are kept for
callers of the older API and vLLM's spelling; on the device manager they wait
too, so there they are deprecated (a ``DeprecationWarning`` names the
``read_*()`` method to call).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np
import torch

from gpukv.core.blocks import ManagerLimits
from gpukv.core.metrics import PrefixCacheStats, StepCounters
from gpukv.core.requests import ComputedBlocks, NewRequest, PrefixHit, RunningUpdate, StepResult
from gpukv.events.schema import KVEventBatch

if TYPE_CHECKING:  # (gpukv.core.running_batch imports gpukv.core.checks, as this module does: no cycle, only typing)
    from gpukv.core.running_batch import RunningBatch


def manager_args_from_config(config: Any) -> tuple[int, int, list[int | None]]:
    """``(num_blocks, block_size, sliding_windows)`` for a ``KVCacheConfig``:
    one manager group per config group; all groups share one block size."""
    from gpukv.sizing.spec import SlidingWindowSpec

    specs = [g.kv_cache_spec for g in config.kv_cache_groups]
    block_sizes = {s.block_size for s in specs}
    if len(block_sizes) != 1:
        raise ValueError(f"all KV-cache groups must share one block size, got {sorted(block_sizes)}")
    windows = [s.sliding_window if isinstance(s, SlidingWindowSpec) else None for s in specs]
    return config.num_blocks, block_sizes.pop(), windows


@runtime_checkable
class BlockManager(Protocol):
    """What a serving loop may call on either manager."""

    block_size: int
    num_groups: int
    sliding_windows: list[int | None]
    max_model_len: int | None
    device: torch.device
    counters: StepCounters  # what the last step cost (always zero on the reference)

    @classmethod
    def from_config(cls, config: Any, **kwargs: Any) -> BlockManager: ...

    # sizes and state
    @property
    def hash_key(self) -> bytes: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def limits(self) -> ManagerLimits: ...
    # (the ``num_free_blocks``, ``num_evictions`` and ``usage`` properties are
    # not part of it: deprecated on the device manager, where they wait)
    def read_num_free_blocks(self) -> int: ...
    def free_blocks_lower_bound(self) -> int: ...
    def read_num_evictions(self) -> int: ...
    def read_num_unheld(self, block_ids: Sequence[int]) -> int: ...
    def read_usage(self) -> float: ...
    def free_queue(self) -> list[int]: ...
    def request_ids(self) -> list[str]: ...
    def check_invariants(self) -> None: ...

    # one request
    def row_of(self, request_id: str) -> int: ...
    def get_block_ids(self, request_id: str) -> list[list[int]]: ...
    def block_table_for(self, request_ids: Sequence[str]) -> torch.Tensor: ...
    def num_blocks_held(self, request_id: str) -> int: ...
    def read_block_ids(self, spans: Sequence[tuple[str, int, int]], group: int = 0) -> list[list[int]]: ...
    def num_computed_tokens(self, request_id: str) -> int: ...
    def row_token_counts(self, rows: Any) -> tuple[np.ndarray, np.ndarray]: ...
    def request_counts(self, request_id: str) -> tuple[int, int, int, int]: ...
    def num_null_blocks(self, request_id: str) -> tuple[int, ...]: ...
    def block_hashes(self, request_id: str) -> list[bytes]: ...
    def get_num_common_prefix_blocks(self, request_id: str, num_running_requests: int) -> list[int]: ...

    # prefix cache
    def make_prefix_cache_stats(self) -> PrefixCacheStats: ...
    def reset_prefix_cache(self) -> bool: ...
    def take_events(self) -> list[KVEventBatch]: ...

    # vLLM's request-level calls
    def get_computed_blocks(self, request: NewRequest) -> ComputedBlocks: ...
    def read_prefix_hit(self, request: NewRequest) -> PrefixHit: ...
    def admit(self, request: NewRequest, hit: PrefixHit | None = None, *, num_tokens: int | None = None,
              num_lookahead_tokens: int | None = None) -> bool: ...
    def allocate_slots(self, request: NewRequest | str, new_token_ids: Sequence[int] = (),
                       computed: ComputedBlocks | None = None, num_tokens: int | None = None,
                       num_lookahead_tokens: int | None = None, *,
                       num_processed_tokens: int | None = None) -> list[list[int]] | None: ...
    def free(self, request_id: str) -> None: ...

    # before serving
    def prepare_admissions(self, max_prompt_len: int | None = None, *, num_lookahead_tokens: int = 0) -> int: ...

    # batched calls
    def step(self, finished: Sequence[str] = (), running: Sequence[RunningUpdate] | RunningBatch = (),
             new: Sequence[NewRequest] = (), *, token_budget: int | None = None, block_ids: bool = False,
             prefix_of: str | None = None) -> StepResult: ...
    def decode(self, rows: Any, new_token_ids: Any, *, num_new_tokens: Any = None, num_tokens_to_compute: Any = None,
               num_lookahead_tokens: Any = 0) -> StepResult: ...
