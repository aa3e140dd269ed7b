"""The reference's request rows: handed out as the device manager hands
them (``gpukv.device.rows.RowAllocator``), and per row (as the device manager
mirrors them) the request's state, its known and its computed tokens, so a
batch addressed by rows is read with numpy (each count written where the
request's changes)."""

from __future__ import annotations

import numpy as np

from gpukv.device.rows import RowAllocator
from gpukv.reference.digests import RequestState


class ReferenceRows:
    """Rows of up to ``capacity`` requests (more grow them, doubling)."""

    def __init__(self, capacity: int) -> None:
        self._allocator = RowAllocator(capacity, on_grow=self._grow)
        self.state = np.empty(self._allocator.capacity, dtype=object)  # the request at each row, or None
        self.num_tokens = np.zeros(self._allocator.capacity, dtype=np.int64)
        self.num_computed = np.zeros(self._allocator.capacity, dtype=np.int64)
        self.ids: dict[int, str] = {}  # row -> request id

    @property
    def in_use(self) -> np.ndarray:
        return self._allocator.in_use

    def take(self, st: RequestState) -> int:
        """A row for an admitted request, its counts written."""
        st.row = row = self._allocator.take()
        self.ids[row] = st.request_id
        self.state[row] = st
        self.counts(st, len(st.tokens), st.num_computed_tokens)
        return row

    def counts(self, st: RequestState, num_tokens: int, num_computed: int) -> None:
        """The request's known and computed tokens, on its row."""
        self.num_tokens[st.row], self.num_computed[st.row] = num_tokens, num_computed

    def give_back(self, st: RequestState) -> None:
        """A freed request's row."""
        self._allocator.give_back(st.row)
        del self.ids[st.row]
        self.state[st.row] = None

    def check(self, states) -> None:
        """Each row holds its request, with its counts."""
        for st in states:
            assert self.state[st.row] is st, f"row {st.row} does not hold request {st.request_id!r}"
            assert (self.num_tokens[st.row], self.num_computed[st.row]) == (len(st.tokens), st.num_computed_tokens), \
                f"row {st.row}'s counts are not request {st.request_id!r}'s"

    def _grow(self, capacity: int) -> None:
        for name in ("state", "num_tokens", "num_computed"):
            old = getattr(self, name)
            grown = np.empty(capacity, dtype=object) if old.dtype == object else np.zeros(capacity, dtype=np.int64)
            grown[: len(old)] = old
            setattr(self, name, grown)
