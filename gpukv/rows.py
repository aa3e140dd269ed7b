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

from typing import Callable

import numpy as np


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
        self._on_grow = on_grow

    def take(self) -> int:
        if self._freed:
            row = self._freed.pop()
        else:
            row = self._next_unused
            self._next_unused += 1
            if row >= self.capacity:
                self._grow(row + 1)
        self.in_use[row] = True
        return row

    def give_back(self, row: int) -> None:
        """Return a row: it is the next one handed out."""
        self.in_use[row] = False
        self._freed.append(row)

    def give_back_unused(self, rows: list[int]) -> None:
        """Return rows taken this step and never used (in reverse order: the
        allocator is left as if they had not been taken)."""
        for row in reversed(rows):
            self.give_back(row)

    def state(self) -> tuple:
        """(capacity, freed rows in hand-out order reversed, next unused row):
        equal states hand out equal rows."""
        return self.capacity, tuple(self._freed), self._next_unused

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
