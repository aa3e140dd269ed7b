"""vLLM Model Runner V2's ``BlockTables`` reading gpukv's device tables.

The runner's ``BlockTables`` object is kept (everything that holds it keeps
working: attention groups, CUDA-graph capture, the persistent
``input_block_tables`` and ``slot_mappings``) and turned into a
``GpukvBlockTables`` (``adopt``) whose source tables are gpukv's:

* no block id is staged or written: ``append_block_ids`` does nothing, the
  ids are gpukv's already, in its table int32[G, rows, W];
* ``apply_staged_writes`` uploads what vLLM's own uploads there, each row's
  block count (from gpukv's host counts) and, new here, the map from vLLM's
  request index to gpukv's row (set per new or resumed request,
  ``set_row``; uploaded only in a step that set one);
* ``gather_block_tables`` and ``compute_slot_mappings`` run vLLM's own
  kernels with ``idx_mapping`` translated to gpukv rows, pointed at gpukv's
  tables; every caller (the runner, a speculator) gets the translation;
* each read is ordered against gpukv's stream (``gpukv.vllm.v0_33.ordering``).
"""

from __future__ import annotations

import torch
from vllm.v1.worker.gpu.block_table import BlockTables
from vllm.v1.worker.gpu.buffer_utils import UvaBackedTensor

from gpukv.vllm.v0_33.binding import BINDING, TableBinding
from gpukv.vllm.v0_33.ordering import TableOrdering

__all__ = ["GpukvBlockTables", "adopt", "expect_tables"]


def expect_tables(block_tables: BlockTables, binding: TableBinding = BINDING) -> None:
    """Tell the binding what the runner's tables are (before the scheduler exists)."""
    binding.expect(max_num_reqs=block_tables.max_num_reqs,
                   widths=[t.gpu.shape[1] for t in block_tables.block_tables],
                   block_sizes=list(block_tables.block_sizes))


def adopt(block_tables: BlockTables, binding: TableBinding = BINDING) -> GpukvBlockTables:
    """The runner's ``BlockTables``, in place, as a ``GpukvBlockTables``
    (the same object, so every holder of it reads gpukv's tables)."""
    expect_tables(block_tables, binding)
    block_tables.__class__ = GpukvBlockTables
    out: GpukvBlockTables = block_tables  # type: ignore[assignment]
    out.binding = binding
    out.row_map = UvaBackedTensor(out.max_num_reqs + 1, dtype=torch.int64)
    out.row_map.np[:] = -1  # (the extra last entry stays -1: padding's index -1 reads it)
    out.rows_changed = True
    out.ordering = None
    return out


class GpukvBlockTables(BlockTables):
    """vLLM's ``BlockTables`` on gpukv's tables (module docstring); built by ``adopt``."""

    binding: TableBinding
    row_map: UvaBackedTensor  # int64[max_num_reqs + 1]: vLLM's request index -> gpukv row (-1: none)
    rows_changed: bool  # a request (re)added since the row map's last upload
    ordering: TableOrdering | None  # None until bound to a published gpukv manager

    def set_row(self, req_index: int, request_id: str) -> None:
        """A request vLLM (re)added at ``req_index``: its gpukv row."""
        self.row_map.np[req_index] = self.binding.row_of(request_id)
        self.rows_changed = True

    def append_block_ids(self, req_index: int, new_block_ids: tuple[list[int], ...], overwrite: bool) -> None:
        """Nothing to write: gpukv wrote the ids into its own table."""

    def apply_staged_writes(self) -> None:
        """Each gpukv row's block count uploaded, and the index -> row map
        when a request was (re)added: a decode step adds none, and the map
        stays in the buffer it was last uploaded to (a buffer is rewritten
        only by an upload)."""
        tables = self._bind()
        rows = tables.shape[1]
        self.num_blocks.np[:] = self.binding.blocks_held()[None, :rows]
        self.num_blocks.copy_to_uva()
        if self.rows_changed:
            self.row_map.copy_to_uva()
            self.rows_changed = False

    def _bind(self) -> torch.Tensor:
        """gpukv's tables (checked unmoved); on the first call, the kernels'
        pointers, strides and block counts pointed at them."""
        tables = self.binding.tables()
        if self.ordering is None:
            width = self.input_block_tables[0].shape[1]
            assert tables.shape == (self.num_kv_cache_groups, tables.shape[1], width), (tables.shape, width)
            self.block_table_ptrs = self._make_ptr_tensor(list(tables))
            self.block_table_strides = torch.tensor([tables.stride(1)] * self.num_kv_cache_groups,
                                                    dtype=torch.int64, device=self.device)
            self.num_blocks = UvaBackedTensor((self.num_kv_cache_groups, tables.shape[1]), dtype=torch.int32)
            self._computed = torch.zeros(tables.shape[1], dtype=torch.int32, device=self.device)
            self.ordering = TableOrdering(self.binding.stream)
        return tables

    def rows_of(self, idx_mapping: torch.Tensor) -> torch.Tensor:
        """``idx_mapping`` (vLLM's request indices, -1 for padding) as gpukv
        rows, in one indexing op (-1 reads the map's last entry, -1)."""
        return self.row_map.gpu[idx_mapping]

    def gather_block_tables(self, idx_mapping: torch.Tensor, num_reqs_padded: int,
                            out: tuple[torch.Tensor, ...] | None = None, out_ptrs: torch.Tensor | None = None,
                            num_computed_tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """vLLM's gather, on gpukv's rows (window masking by each row's computed tokens)."""
        assert self.ordering is not None, "apply_staged_writes binds the tables first"
        rows = self.rows_of(idx_mapping)
        if num_computed_tokens is not None and self.has_sliding_window_groups:
            self._computed.index_copy_(0, rows, num_computed_tokens[idx_mapping].to(self._computed.dtype))
            num_computed_tokens = self._computed
        self.ordering.before_read()
        gathered = super().gather_block_tables(rows, num_reqs_padded, out, out_ptrs, num_computed_tokens)
        self.ordering.after_read()
        return gathered

    def compute_slot_mappings(self, idx_mapping: torch.Tensor, query_start_loc: torch.Tensor,
                              positions: torch.Tensor, num_tokens_padded: int,
                              out: torch.Tensor | None = None) -> torch.Tensor:
        """vLLM's slot mapping, on gpukv's rows."""
        assert self.ordering is not None, "apply_staged_writes binds the tables first"
        rows = self.rows_of(idx_mapping)
        self.ordering.before_read()
        mappings = super().compute_slot_mappings(rows, query_start_loc, positions, num_tokens_padded, out)
        self.ordering.after_read()
        return mappings

