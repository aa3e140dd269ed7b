"""What a serving loop reads after a step, gathered into one buffer: the
block ids at given (group, row, position) entries of the request rows' block
tables, and each one's reference count.

A scheduler needs, after every step, the new block ids of every request it
grew or admitted (vLLM's ``SchedulerOutput`` carries them) and the reference
counts of one request's leading blocks (vLLM's common prefix for cascade
attention: the blocks every running request holds). Both are a gather at
positions the host knows (or bounds) from its own counts; this kernel does it
in one launch into a fixed buffer, so the step reads it in the same
device-to-host copy as its status (``DeviceManager.step(..., block_ids=True,
prefix_of=...)``).

Layouts: ``entries`` int32[3, EP] (group, row, position; ``row < 0`` marks
padding, EP a bucket size); ``block_table`` int32[G, R, M] (strides in
elements); ``ref_cnt`` int32[N]. Output ``out`` int64[2, EP]: the block id at
each entry, then its reference count; padding entries get block 0 and count 0
(the host reads only the entries it laid out).

Grid: ``cdiv(EP, TILE)`` programs, each entry read and written by exactly one
of them, no atomics: deterministic, and any program order gives the same
result.
"""

from __future__ import annotations

from gpukv import _runtime  # noqa: F401  (sets TRITON_INTERPRET before triton loads)

import triton
import triton.language as tl

from gpukv.kernels import capture
from gpukv.kernels.toolkit import DEFAULT_WARPS, INT32, INT64, check_tensor, num_warps

__all__ = ["gather_blocks"]

#: Entries per program.
_TILE = 256


@triton.jit(do_not_specialize=["EP", "S_G", "S_R"])
def _gather_blocks_kernel(
    entries_ptr,      # int32[3, EP] group, row (-1: padding), position
    block_table_ptr,  # int32[G, R, M]
    S_G, S_R,         # block_table's group and row strides, in elements (position stride 1)
    ref_cnt_ptr,      # int32[N] reference count per block
    out_ptr,          # int64[2, EP] out: block id, its reference count
    EP,               # entries (a bucket size)
    TILE: tl.constexpr,
):
    offs = tl.program_id(0) * TILE + tl.arange(0, TILE)
    m = offs < EP
    g = tl.load(entries_ptr + offs, mask=m, other=0).to(tl.int64)
    r = tl.load(entries_ptr + EP + offs, mask=m, other=-1).to(tl.int64)
    p = tl.load(entries_ptr + 2 * EP + offs, mask=m, other=0).to(tl.int64)
    real = m & (r >= 0)
    block = tl.load(block_table_ptr + g * S_G + r * S_R + p, mask=real, other=0)
    count = tl.load(ref_cnt_ptr + block, mask=real, other=0)
    tl.store(out_ptr + offs, block.to(tl.int64), mask=m)
    tl.store(out_ptr + EP + offs, count.to(tl.int64), mask=m)


def gather_blocks(entries, block_table, ref_cnt, out) -> None:
    """Write the block id and reference count at each of ``entries``
    (int32[3, EP]: group, row, position; row -1 for padding) into ``out``
    (int64[2, EP]). One launch, no host sync."""
    EP = entries.shape[1]
    check_tensor(entries, "entries", dtypes=INT32, shape=(3, EP), contiguous=True)
    check_tensor(block_table, "block_table", dtypes=INT32, shape=(None, None, None))
    check_tensor(ref_cnt, "ref_cnt", dtypes=INT32, shape=(None,))
    check_tensor(out, "out", dtypes=INT64, shape=(2, EP), contiguous=True)
    if block_table.stride(2) != 1:
        raise ValueError("block_table: positions must be contiguous (stride 1)")
    grid = (triton.cdiv(EP, _TILE),)
    _gather_blocks_kernel[grid](entries, block_table, block_table.stride(0), block_table.stride(1), ref_cnt, out, EP,
                                TILE=_TILE, num_warps=num_warps(_TILE, max_warps=DEFAULT_WARPS))


capture.count_launches(globals())
