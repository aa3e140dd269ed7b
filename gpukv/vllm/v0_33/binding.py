"""Where the scheduler's gpukv manager hands its device block tables to the
model runner, inside one process (``gpukv.vllm.Worker``, tensor and pipeline
parallel size 1).

vLLM's engine core builds the executor (the worker, its model runner and the
runner's ``BlockTables``) before the scheduler, and with one GPU its
``UniProcExecutor`` runs the worker in the engine core's own process. So:

1. the runner, when it lays out its KV cache, says what it needs
   (``expect``: vLLM's ``max_num_reqs`` rows, the table width W of every
   group, the block size);
2. the scheduler's adapter, building its gpukv manager (``make_backend``),
   sizes it from that (``sized``: at least ``max_num_reqs`` rows and
   ``max_model_len = W * block_size``, so gpukv's table is
   int32[G, rows, W], each group's rows as wide as vLLM's) and publishes it
   (``publish``);
3. the runner reads the tables from then on (``tables``), and refuses
   (``TablesMovedError``) if gpukv ever reallocated them.

``BINDING`` is the process's one binding. ``reads_block_ids_on_device``
tells the scheduler side that a runner reads gpukv's tables itself, so the
block ids in ``SchedulerOutput`` are read by nothing on the forward path.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from gpukv.errors import GpukvError
from gpukv.vllm.v0_33.groups import UnsupportedConfigError

if TYPE_CHECKING:
    from gpukv.device.manager import DeviceManager

__all__ = ["BINDING", "Expected", "TableBinding", "TablesMovedError"]


class TablesMovedError(GpukvError, RuntimeError):
    """gpukv's block tables were reallocated while a model runner points at
    them (more rows were needed than the runner sized them for)."""


@dataclass(frozen=True)
class Expected:
    """What the model runner's tables need: rows (vLLM's ``max_num_reqs``),
    the width of every group's table, and the block size."""

    rows: int
    width: int
    block_size: int
    num_groups: int


def _refuse(what: str, fix: str) -> UnsupportedConfigError:
    return UnsupportedConfigError(f"gpukv's worker does not support {what}", argument="vllm_config", fix=fix)


class TableBinding:
    """The process-local meeting point of a gpukv manager and a model runner."""

    def __init__(self) -> None:
        self.expected: Expected | None = None
        self.manager: DeviceManager | None = None
        self._rows_of: Mapping[str, int] = {}  # the manager's live view of its requests' rows
        self._generation = -1
        self._table_ptr = 0

    @property
    def reads_block_ids_on_device(self) -> bool:
        """A runner reads gpukv's tables: no block id needs to reach the host for the forward pass."""
        return self.expected is not None

    def expect(self, *, max_num_reqs: int, widths: list[int], block_sizes: list[int]) -> Expected:
        """The runner's layout; one width and one block size for every group
        (gpukv has one table width and one block size)."""
        if len(set(widths)) != 1 or len(set(block_sizes)) != 1:
            raise _refuse(f"groups of different block-table widths {widths} or block sizes {block_sizes}",
                          "use a model whose KV-cache groups share one block size, or vLLM's own worker")
        self.expected = Expected(int(max_num_reqs), int(widths[0]), int(block_sizes[0]), len(widths))
        self.manager = None
        return self.expected

    def sized(self, backend: str, block_size: int, num_groups: int, max_num_reqs: int,
              max_model_len: int) -> tuple[int, int]:
        """(rows, max_model_len) for the gpukv manager the scheduler builds:
        as given when no runner waits, else sized to the runner's tables."""
        want = self.expected
        if want is None:
            return max_num_reqs, max_model_len
        if backend != "device":
            raise _refuse(f"the {backend} backend (the runner reads the device manager's tables)",
                          "use gpukv.vllm.AsyncScheduler or DeviceAsyncScheduler with gpukv.vllm.Worker")
        if (block_size, num_groups) != (want.block_size, want.num_groups):
            raise _refuse(f"a scheduler of block size {block_size} and {num_groups} groups under a runner of "
                          f"{want.block_size} and {want.num_groups}", "build both from one vLLM config")
        if want.width * block_size < max_model_len:
            raise _refuse(f"a table width of {want.width} blocks under max_model_len {max_model_len}",
                          "build both from one vLLM config")
        return max(max_num_reqs, want.rows), want.width * block_size

    def publish(self, manager: DeviceManager) -> DeviceManager:
        """The scheduler's gpukv manager, now the runner's tables; returns it."""
        if self.expected is not None:
            self.manager = manager
            self._rows_of = manager.request_rows
            self._generation = manager.rows_generation
            self._table_ptr = manager.block_table.data_ptr()
        return manager

    def _bound(self) -> DeviceManager:
        """The published manager (refused when no gpukv scheduler published one)."""
        if self.manager is None:
            raise _refuse("a model runner with no gpukv scheduler in its process",
                          "run with --scheduler-cls gpukv.vllm.AsyncScheduler and one GPU (tensor and pipeline "
                          "parallel size 1)")
        return self.manager

    def tables(self) -> torch.Tensor:
        """int32[G, rows, W]: gpukv's block tables, checked unmoved."""
        manager = self._bound()
        table = manager.block_table
        if manager.rows_generation != self._generation or table.data_ptr() != self._table_ptr:
            raise TablesMovedError("gpukv's block tables were reallocated while the model runner reads them",
                                   argument="max_num_seqs",
                                   fix="size gpukv to vLLM's max_num_reqs rows (the binding does; report this)")
        return table

    def row_of(self, request_id: str) -> int:
        """The gpukv row of a request the scheduler admitted."""
        return int(self._rows_of[request_id])

    def blocks_held(self) -> np.ndarray:
        """int64[rows]: each row's block positions (every group), from gpukv's host counts."""
        return self._bound().blocks_held_per_row

    @property
    def stream(self) -> Any:
        """The CUDA stream gpukv's kernels run on (None without CUDA)."""
        return None if self.manager is None else self.manager.stream

    def reset(self) -> None:
        """Unbound, as at start-up (tests; a new engine in the same process)."""
        self.__init__()  # type: ignore[misc]


#: The process's binding (module docstring).
BINDING = TableBinding()
