"""The device manager's KV-cache events: the device buffer the kernels'
neighbours write (``gpukv.device.event_buffer.DeviceEventLog``, None when the manager
was built without ``enable_kv_cache_events``) and the host's queue of
batches (``gpukv.events.schema.EventQueue``) the reads fill.

No read of its own: a drain's rows ride on a read the manager makes anyway
(``drain_parts`` before it, ``drained`` with what it brought), and
``DeviceManager.take_events`` reads only when a step left events unread.
"""

from __future__ import annotations

import warnings

import torch

from gpukv.device.event_buffer import DeviceEventLog
from gpukv.events.schema import AllBlocksCleared, EventQueue, KVEventBatch


class DeviceEvents:
    """The events of one device manager (see the module docstring); ``table``:
    the pool's hash table, where a popped block's digest still is."""

    def __init__(self, log: DeviceEventLog | None, table) -> None:
        self.log = log
        self.queue = EventQueue()
        self._table = table

    @property
    def pending(self) -> bool:
        """Whether launches since the last drain may have written events (a drain reads them)."""
        return self.log is not None and self.log.bound > 0

    def popped_hook(self):
        """What ``DevicePool.allocate`` calls with the popped blocks: their
        removal events (the cached ones'); None without events."""
        return self._on_popped if self.log is not None else None

    def _on_popped(self, popped: torch.Tensor) -> None:
        assert self.log is not None  # (only hooked with events on)
        self.log.removes(popped, self._table)

    def expect(self, num_entries: int) -> None:
        """Launches with this many entries may write events: a drain reads that many rows more."""
        if self.log is not None:
            self.log.bound += num_entries

    def drain_parts(self) -> list[torch.Tensor]:
        """The device tensors a read carries to drain the buffer (none without events)."""
        return self.log.drain_parts() if self.log is not None else []

    def drained(self, values: list) -> None:
        """The events a read brought, as one batch (an overflow is reported)."""
        assert self.log is not None  # (only read with events on)
        events, dropped = self.log.drained(values)
        if dropped:
            warnings.warn(f"gpukv: {dropped} KV-cache events were dropped (more than {self.log.capacity} "
                          "between two reads of the device); the batch says how many", RuntimeWarning,
                          stacklevel=4)
        self.queue.add(events, dropped)

    def cleared(self) -> None:
        """Every cached block forgotten (``reset_prefix_cache``): vLLM's AllBlocksCleared."""
        self.queue.add([AllBlocksCleared()])

    def take(self) -> list[KVEventBatch]:
        """The batches made since the last take, oldest first."""
        return self.queue.take()
