"""``gpukv.device.events``: the device manager's events part on its own."""

import torch

from gpukv.device.event_buffer import DeviceEventLog
from gpukv.device.events import DeviceEvents
from gpukv.events.schema import AllBlocksCleared


def test_without_a_log_there_is_nothing_to_hook_drain_or_expect():
    ev = DeviceEvents(None, table=None)
    assert ev.popped_hook() is None and ev.drain_parts() == [] and not ev.pending
    ev.expect(5)
    assert not ev.pending and ev.take() == []


def test_with_a_log_launches_raise_the_bound_and_a_reset_is_one_batch():
    ev = DeviceEvents(DeviceEventLog(4, 2, torch.device("cpu")), table=None)
    assert ev.popped_hook() is not None and not ev.pending
    ev.expect(3)
    assert ev.log is not None and ev.log.bound == 3 and ev.pending
    ev.cleared()
    (batch,) = ev.take()
    assert [type(e) for e in batch.events] == [AllBlocksCleared] and batch.dropped == 0
    assert ev.take() == []
