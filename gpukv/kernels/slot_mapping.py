"""Slot mapping: where each token scheduled this step writes its K/V in the
paged cache, in the flat form paged-attention kernels take (vLLM's
``slot_mapping``).

A paged KV cache of one layer is ``[num_blocks, block_size, num_kv_heads,
head_size]`` (per K and V); seen flat as ``[num_blocks * block_size, ...]``,
token position ``p`` of a request whose block table is ``bt`` lives at

    slot = bt[p // block_size] * block_size + p % block_size

(int64). Kernels such as vLLM's ``reshape_and_cache`` / FlashInfer's
``append_paged_kv_cache`` write token ``i``'s K/V at ``slot_mapping[i]`` and
skip a slot of ``PAD`` (-1).

Inputs, as a serving loop has them (vLLM v1's layout: tokens of one step are
laid out request after request, "varlen"):

* ``block_table`` int32/int64 ``[B, M]``: request ``b``'s block ids of one
  KV-cache group (any strides: a slice ``block_table[g]`` of the device
  manager's ``int32[G, R, M]`` works without a copy). Row ``b`` belongs to the
  ``b``-th request of the batch.
* ``query_start_loc`` int32/int64 ``[B + 1]``: request ``b``'s scheduled
  tokens are flat tokens ``query_start_loc[b] .. query_start_loc[b + 1] - 1``;
  ``query_start_loc[0] == 0``, non-decreasing (a request may schedule 0 tokens).
* ``start_positions`` int32/int64 ``[B]``: the position of request ``b``'s
  first scheduled token (its tokens already computed or served from the prefix
  cache, vLLM's ``num_computed_tokens``); its ``j``-th scheduled token is at
  position ``start_positions[b] + j``.
* ``num_tokens`` (host int): the length of the output, at least
  ``query_start_loc[B]``; flat tokens past ``query_start_loc[B]`` are padding
  (a batch padded to a CUDA-graph size) and get ``PAD``.

Outputs: ``slot_mapping`` int64[num_tokens] and, on request, ``positions``
int64[num_tokens] (each token's position, 0 for padding: what a rotary
embedding needs). A token whose block index is outside ``[0, M)`` (a position
the manager never allocated, or a negative one) gets ``PAD`` rather than a
write into someone else's block; ``check=True`` makes the launcher read the
inputs back and raise on that and every other inconsistency.

Sentinels: ``PAD = -1`` in the output. The null block (id 0) is a valid
block id to this kernel; a scheduled token never lives there when the block
table comes from a manager (``check=True`` refuses it).

Determinism: every output element is written by exactly one program, with no
atomics: the result is a pure function of the inputs.

Grid: one program per request plus one for the padding; each loops over its
tokens in tiles of ``TILE``. No host synchronisation unless ``num_tokens`` is
left to be read from the device or ``check=True``.
"""

from __future__ import annotations

import functools

from gpukv import _runtime  # noqa: F401  (sets TRITON_INTERPRET before triton loads)

import torch
import triton
import triton.language as tl

from gpukv.kernels.toolkit import INDEX_DTYPES, SLOT_TILE, check_device, check_tensor

__all__ = ["PAD", "slot_mapping"]

#: The slot of a padding token (and of a token the block table does not cover).
PAD = -1
_PAD: tl.constexpr = tl.constexpr(PAD)  # the kernel's copy (kernels read constexpr globals only)

#: Tokens per loop trip of a request's program (``toolkit.SLOT_TILE``: why 128).
_TILE = SLOT_TILE
#: Every message starts with the function's name.
_WHERE = "slot_mapping: "
#: The index arrays' check, with the errors ``slot_mapping`` documents (a
#: wrong dtype is a TypeError here).
_check_index = functools.partial(check_tensor, dtypes=INDEX_DTYPES, dtype_error=TypeError, prefix=_WHERE)


# Batch size and token count change every step: not specialised, so one
# compiled variant serves every step. Strides and M are fixed per manager.
@triton.jit(do_not_specialize=["num_reqs", "num_tokens"])
def _slot_mapping_kernel(
    bt_ptr,  # block table of one group, [B, M] with strides (stride_req, stride_blk); int32 or int64
    stride_req,  # elements between two requests' rows of bt_ptr
    stride_blk,  # elements between two block positions of one row (1 when contiguous)
    max_blocks,  # M: block positions per row; block indices >= M give PAD
    qsl_ptr,  # query_start_loc, [B + 1], int32 or int64: request b's tokens are [qsl[b], qsl[b+1])
    start_ptr,  # start_positions, [B], int32 or int64: position of request b's first scheduled token
    slot_ptr,  # out: int64[num_tokens], slot of every flat token (PAD for padding)
    pos_ptr,  # out: int64[num_tokens], position of every flat token (0 for padding); unused unless WRITE_POS
    num_reqs,  # B (program B writes the padding)
    num_tokens,  # length of the outputs; no store reaches past it
    BLOCK_SIZE: tl.constexpr,  # tokens per KV block
    WRITE_POS: tl.constexpr,  # whether pos_ptr is written
    TILE: tl.constexpr,  # tokens per loop iteration (a power of 2)
):
    b = tl.program_id(0)
    offs = tl.arange(0, TILE).to(tl.int64)
    if b < num_reqs:
        q0 = tl.load(qsl_ptr + b).to(tl.int64)
        q1 = tl.load(qsl_ptr + b + 1).to(tl.int64)
        p0 = tl.load(start_ptr + b).to(tl.int64)
        row = b.to(tl.int64) * stride_req
        for t0 in range(q0, q1, TILE):
            i = t0 + offs
            live = (i < q1) & (i < num_tokens)
            pos = p0 + (i - q0)
            blk = pos // BLOCK_SIZE
            covered = live & (pos >= 0) & (blk < max_blocks)
            bid = tl.load(bt_ptr + row + blk * stride_blk, mask=covered, other=0).to(tl.int64)
            slot = tl.where(covered, bid * BLOCK_SIZE + pos % BLOCK_SIZE, _PAD)
            tl.store(slot_ptr + i, slot, mask=live)
            if WRITE_POS:
                tl.store(pos_ptr + i, pos, mask=live)
    else:
        t_end = tl.load(qsl_ptr + num_reqs).to(tl.int64)
        for t0 in range(t_end, num_tokens, TILE):
            i = t0 + offs
            live = i < num_tokens
            tl.store(slot_ptr + i, tl.full([TILE], _PAD, tl.int64), mask=live)
            if WRITE_POS:
                tl.store(pos_ptr + i, tl.zeros([TILE], tl.int64), mask=live)


def _check_values(block_table, query_start_loc, start_positions, num_tokens: int, block_size: int) -> None:
    """The host-side consistency check of ``check=True`` (reads the device)."""
    qsl = query_start_loc.cpu().tolist()
    starts = start_positions.cpu().tolist()
    if qsl[0] != 0:
        raise ValueError(f"slot_mapping: query_start_loc[0] must be 0, got {qsl[0]}")
    lens = [b - a for a, b in zip(qsl, qsl[1:], strict=False)]
    if any(n < 0 for n in lens):
        b = next(i for i, n in enumerate(lens) if n < 0)
        raise ValueError(f"slot_mapping: query_start_loc must be non-decreasing; "
                         f"query_start_loc[{b + 1}] = {qsl[b + 1]} < query_start_loc[{b}] = {qsl[b]}")
    if qsl[-1] > num_tokens:
        raise ValueError(f"slot_mapping: query_start_loc[-1] = {qsl[-1]} scheduled tokens do not fit "
                         f"num_tokens = {num_tokens}")
    bt = block_table.cpu()
    M = bt.shape[1]
    for b, (s, n) in enumerate(zip(starts, lens, strict=True)):
        if n == 0:
            continue
        if s < 0:
            raise ValueError(f"slot_mapping: start_positions[{b}] = {s} is negative")
        last_blk = (s + n - 1) // block_size
        if last_blk >= M:
            raise ValueError(f"slot_mapping: request {b} schedules positions {s}..{s + n - 1}, past its block "
                             f"table of {M} blocks of {block_size} tokens")
        ids = bt[b, s // block_size: last_blk + 1]
        if bool((ids <= 0).any()):
            p = s // block_size + int((ids <= 0).nonzero()[0, 0])
            raise ValueError(f"slot_mapping: request {b} schedules a token in block position {p}, which holds "
                             f"block id {int(bt[b, p])} (the null block or none): no token is written there")


def slot_mapping(
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    start_positions: torch.Tensor,
    *,
    block_size: int,
    num_tokens: int | None = None,
    group: int | None = None,
    with_positions: bool = False,
    check: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The flat slot mapping of one step (see the module docstring).

    Args:
        block_table: int32/int64 ``[B, M]`` (row ``b``: the ``b``-th request of
            the batch), or ``[G, B, M]`` with ``group`` naming the KV-cache
            group (``DeviceManager.block_table_for(ids)``); any strides.
        query_start_loc: int32/int64 ``[B + 1]``, cumulative scheduled-token
            offsets (``[0, n_0, n_0 + n_1, ...]``).
        start_positions: int32/int64 ``[B]``, position of each request's first
            scheduled token (tokens it has computed or hit before this step).
        block_size: tokens per block (a compile-time constant of the kernel).
        num_tokens: output length (host int, >= ``query_start_loc[B]``; the
            rest is padding). None: read ``query_start_loc[B]`` from the
            device (one synchronisation).
        group: with a 3-D ``block_table``, the group to map.
        with_positions: also return each token's position (int64, 0 for padding).
        check: read the inputs back and raise ``ValueError`` on an inconsistent
            ``query_start_loc``, a negative start, or a token outside the block
            table or in the null block (debugging; synchronises).

    Returns:
        ``slot_mapping`` int64[num_tokens] (``PAD`` = -1 for padding), or
        ``(slot_mapping, positions)`` with ``with_positions``. On the device of
        the inputs; nothing is read back unless noted above.

    Raises:
        TypeError: an input that is not an int32/int64 tensor; a non-int size.
        ValueError: shapes that disagree, a bad ``block_size``/``num_tokens``/
            ``group``, inputs on different devices or on a device the kernel
            cannot run on (CPU tensors need Triton's interpreter).
    """
    block_table = _table_of_group(block_table, group, block_size)
    B, device = _check_batch(block_table, query_start_loc, start_positions)
    num_tokens = _num_tokens(num_tokens, query_start_loc, B)
    query_start_loc = query_start_loc.contiguous()
    start_positions = start_positions.contiguous()
    if check:
        _check_values(block_table, query_start_loc, start_positions, num_tokens, block_size)
    slots, positions = _launch(block_table, query_start_loc, start_positions, num_tokens, block_size, with_positions)
    return (slots, positions) if with_positions else slots


def _table_of_group(block_table: torch.Tensor, group: int | None, block_size: int) -> torch.Tensor:
    """``block_size`` checked, and the ``[B, M]`` block table to map: the
    given one, or ``group``'s of a ``[G, B, M]`` one."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"slot_mapping: block_size must be a positive int, got {block_size!r}")
    _check_index(block_table, "block_table")
    if block_table.dim() == 3:
        if isinstance(group, bool) or not isinstance(group, int):
            raise ValueError(f"slot_mapping: a [G, B, M] block_table needs group= (an int in "
                             f"[0, {block_table.shape[0]})), got {group!r}")
        if not 0 <= group < block_table.shape[0]:
            raise ValueError(f"slot_mapping: group {group} is outside [0, {block_table.shape[0]})")
        block_table = block_table[group]
    elif group is not None:
        raise ValueError(f"slot_mapping: group= goes with a [G, B, M] block_table; got a "
                         f"{block_table.dim()}-D one of shape {tuple(block_table.shape)}")
    return block_table


def _check_batch(block_table: torch.Tensor, query_start_loc: torch.Tensor, start_positions: torch.Tensor) -> tuple:
    """The batch's shapes and devices checked; returns ``(B, device)``."""
    _check_index(block_table, "block_table", ndim=2)
    _check_index(query_start_loc, "query_start_loc", ndim=1)
    _check_index(start_positions, "start_positions", ndim=1)
    B = block_table.shape[0]
    if query_start_loc.shape[0] != B + 1:
        raise ValueError(f"slot_mapping: query_start_loc must have B + 1 = {B + 1} entries (block_table has "
                         f"B = {B} rows), got {query_start_loc.shape[0]}")
    if start_positions.shape[0] != B:
        raise ValueError(f"slot_mapping: start_positions must have B = {B} entries, got {start_positions.shape[0]}")
    device = block_table.device
    for name, t in (("query_start_loc", query_start_loc), ("start_positions", start_positions)):
        _check_index(t, name, device=device)
    check_device(device, _WHERE)
    return B, device


def _num_tokens(num_tokens: int | None, query_start_loc: torch.Tensor, B: int) -> int:
    """The output length: ``num_tokens`` checked, or (None) the scheduled
    tokens read from the device."""
    if num_tokens is None:
        num_tokens = int(query_start_loc[B].item())
    elif isinstance(num_tokens, bool) or not isinstance(num_tokens, int):
        raise TypeError(f"slot_mapping: num_tokens must be an int, got {num_tokens!r}")
    if num_tokens < 0:
        raise ValueError(f"slot_mapping: num_tokens must be >= 0, got {num_tokens}")
    return num_tokens


def _launch(block_table, query_start_loc, start_positions, num_tokens: int, block_size: int,
            with_positions: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The outputs, and the kernel's launch (none for zero tokens)."""
    B, M = block_table.shape
    device = block_table.device
    slots = torch.empty(num_tokens, dtype=torch.int64, device=device)
    positions = torch.empty(num_tokens if with_positions else 1, dtype=torch.int64, device=device)
    if num_tokens:
        _slot_mapping_kernel[(B + 1,)](
            block_table, block_table.stride(0), block_table.stride(1), M,
            query_start_loc, start_positions, slots, positions, B, num_tokens,
            BLOCK_SIZE=block_size, WRITE_POS=bool(with_positions), TILE=_TILE,
        )
    return slots, positions


from gpukv.kernels import capture  # noqa: E402

capture.count_launches(globals())
