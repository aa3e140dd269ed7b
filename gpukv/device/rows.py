"""Request rows: the index by which a serving loop addresses a running request.

Both managers give every admitted request a row, an int in ``[0, capacity)``,
that stays its own until it is freed (``StepResult.rows``, ``row_of``). The
device manager keeps the request's tokens, digests and block tables in that
row of its device tensors; the batched ``decode(rows, new_token_ids)`` entry
addresses requests by row, as a model runner's persistent batch does.

Rows are handed out the same way by both managers, so a serving loop (and a
differential test) sees the same rows whichever it drives: the most recently
freed row first, else the smallest row never used. Only admitted requests keep
a row; a step's refused candidates give theirs back in reverse order, which
leaves the allocator as if they had never taken one.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch


class RowAllocator:
    """LIFO of freed rows over a counter of rows never used.

    ``in_use`` (bool[capacity]) marks the rows requests hold; ``capacity``
    grows (doubling, at least to what a take needs) and ``on_grow(capacity)``
    runs before a row past the old capacity is handed out.
    """

    def __init__(self, capacity: int, on_grow: Callable[[int], None] | None = None) -> None:
        self.capacity = int(capacity)
        self.in_use = np.zeros(self.capacity, dtype=bool)
        self._freed: list[int] = []
        self._next_unused = 0
        # Rows handed out from the counter and held since (so a take undone
        # puts each row back where it came from: ``give_back_unused``).
        self._fresh: set[int] = set()
        self._on_grow = on_grow

    def take(self) -> int:
        if self._freed:
            row = self._freed.pop()
        else:
            row = self._next_unused
            self._next_unused += 1
            self._fresh.add(row)
            if row >= self.capacity:
                self._grow(row + 1)
        self.in_use[row] = True
        return row

    def give_back(self, row: int) -> None:
        """Return a row: it is the next one handed out."""
        self.in_use[row] = False
        self._fresh.discard(row)
        self._freed.append(row)

    def give_back_unused(self, rows: list[int]) -> None:
        """Return rows taken this step and never used, the last taken first:
        each goes back where it came from (the counter, or the freed rows),
        so the allocator is exactly as if they had not been taken (a refused
        call changes nothing; its capacity may have grown, which no later
        hand-out sees)."""
        for row in reversed(rows):
            self.in_use[row] = False
            if row in self._fresh and row == self._next_unused - 1:
                self._fresh.discard(row)
                self._next_unused -= 1
            else:
                self._fresh.discard(row)
                self._freed.append(row)

    def state(self) -> tuple:
        """(freed rows in hand-out order reversed, next unused row): equal
        states hand out equal rows (the capacity only says how far the row
        tensors have grown)."""
        return tuple(self._freed), self._next_unused

    def reserve(self, capacity: int) -> None:
        if capacity > self.capacity:
            self._grow(capacity)

    def _grow(self, need: int) -> None:
        cap = max(need, 2 * self.capacity)
        if self._on_grow is not None:
            self._on_grow(cap)
        grown = np.zeros(cap, dtype=bool)
        grown[: self.capacity] = self.in_use
        self.in_use = grown
        self.capacity = cap


class DeviceRows:
    """The device manager's per-request rows, as vLLM's ``BlockTable`` for
    many requests at once: the rows handed out (a ``RowAllocator``), and in
    each row the request's state.

    On the device (int32 unless said): ``tokens[R, T]`` (T = max_model_len),
    ``digests`` and ``extras`` int64[R, M, 2] (M = T / block size, rounded up;
    one layout: block digests and extra-key digests), ``block_table[G, R, M]``
    (what an attention kernel reads) and ``lora`` int64[R, 2] (has a LoRA id,
    its bits: what stored-block events report). Mirrored on the host (numpy
    int64, indexed by row): ``num_tokens`` (known), ``num_computed``,
    ``num_held`` (block positions per group, lookahead included) and
    ``null_until[R, G]`` (where each window group's null blocks end).

    Rows grow (doubling) between steps' kernels, never inside one;
    ``generation`` counts the reallocations (prepared launches and captured
    graphs hold the old tensors, so they are made anew after one).
    """

    def __init__(self, capacity: int, *, num_groups: int, max_model_len: int, block_size: int,
                 device: torch.device) -> None:
        self.device = device
        self.num_groups = num_groups
        self.max_tokens = max_model_len
        self.max_blocks = -(-max_model_len // block_size)
        self.generation = 0
        self._capacity = 0
        i32: dict = dict(dtype=torch.int32, device=device)
        i64: dict = dict(dtype=torch.int64, device=device)
        self.tokens = torch.zeros((0, self.max_tokens), **i32)
        self.digests = torch.zeros((0, self.max_blocks, 2), **i64)
        self.extras = torch.zeros((0, self.max_blocks, 2), **i64)
        self.block_table = torch.zeros((num_groups, 0, self.max_blocks), **i32)
        self.lora = torch.zeros((0, 2), **i64)
        self.num_tokens = np.zeros(0, dtype=np.int64)
        self.num_computed = np.zeros(0, dtype=np.int64)
        self.num_held = np.zeros(0, dtype=np.int64)
        self.null_until = np.zeros((0, num_groups), dtype=np.int64)
        self._allocator = RowAllocator(capacity, on_grow=self._grow)
        self._grow(capacity)

    # ---------------------------------------------------- handing rows out
    @property
    def in_use(self) -> np.ndarray:
        return self._allocator.in_use

    def take(self) -> int:
        return self._allocator.take()

    def give_back_unused(self, rows: list[int]) -> None:
        self._allocator.give_back_unused(rows)

    def state(self) -> tuple:
        return self._allocator.state()

    def release(self, rows: np.ndarray) -> None:
        """Freed requests' rows: their counts cleared, the rows handed back."""
        self.num_tokens[rows] = self.num_computed[rows] = self.num_held[rows] = 0
        self.null_until[rows] = 0
        for row in rows.tolist():
            self._allocator.give_back(row)

    def check_against(self, pool, held_rows: dict[str, int]) -> None:
        """Each block's reference count (``pool``, a ``DevicePool``; reads the
        device) equals the number of block-table entries of the rows
        ``held_rows`` names (request id -> row) that hold it, and no other row
        is in use."""
        rows = np.fromiter(held_rows.values(), np.int64, len(held_rows))
        tables = self.block_table.cpu().numpy()[:, rows]  # [G, R, M]
        within = np.arange(tables.shape[2]) < self.num_held[rows][:, None]  # each row's first num_held positions
        held = np.bincount(tables[:, within].ravel(), minlength=pool.num_blocks)  # (the null block 0 not compared)
        assert held[1:].tolist() == pool.ref_counts()[1:], "reference counts disagree with the block tables"
        assert sorted(held_rows.values()) == sorted(np.flatnonzero(self.in_use).tolist()), "row leak"

    def _grow(self, capacity: int) -> None:
        if capacity <= self._capacity:
            return
        dev, G, T, M, old = self.device, self.num_groups, self.max_tokens, self.max_blocks, self._capacity

        def grown(t: torch.Tensor, shape: tuple, dtype: torch.dtype, rows_dim: int = 0) -> torch.Tensor:
            out = torch.zeros(shape, dtype=dtype, device=dev)
            out.narrow(rows_dim, 0, old).copy_(t)
            return out

        self.tokens = grown(self.tokens, (capacity, T), torch.int32)
        self.digests = grown(self.digests, (capacity, M, 2), torch.int64)
        self.extras = grown(self.extras, (capacity, M, 2), torch.int64)
        self.block_table = grown(self.block_table, (G, capacity, M), torch.int32, rows_dim=1)
        self.lora = grown(self.lora, (capacity, 2), torch.int64)
        more = np.zeros(capacity - old, dtype=np.int64)
        self.num_tokens, self.num_computed, self.num_held = (
            np.concatenate([a, more]) for a in (self.num_tokens, self.num_computed, self.num_held))
        self.null_until = np.concatenate([self.null_until, np.zeros((capacity - old, G), dtype=np.int64)])
        self._capacity = capacity
        self.generation += 1


def entry_layout(starts, stops, *, reverse: bool = False):
    """The host plan of a step phase: one entry per (request r, group g,
    position p) with ``starts[r, g] <= p < stops[r, g]``, ordered by request,
    then group, then position (descending with ``reverse``: a free call gives
    blocks back tail first). ``starts``/``stops`` are [R, G] (or [R], the same
    for every group of a one-group layout). Returns int64 arrays (request,
    group, position, call) where call = r * G + g: one free call per request
    and group. Vectorised: no Python loop over blocks."""
    starts = np.asarray(starts, dtype=np.int64)
    stops = np.asarray(stops, dtype=np.int64)
    if starts.ndim == 1:
        starts, stops = starts[:, None], stops[:, None]
    R, G = starts.shape
    counts = np.maximum(stops - starts, 0).ravel()
    call = np.repeat(np.arange(R * G, dtype=np.int64), counts)
    offs = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    pos = (stops.ravel()[call] - 1 - offs) if reverse else (starts.ravel()[call] + offs)
    return call // G, call % G, pos, call
