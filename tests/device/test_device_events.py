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


def test_an_admissions_drain_reads_only_the_rows_its_blocks_can_write(monkeypatch):
    """A step's drain reads as many event rows as blocks it can pop or cache
    (here 2 new blocks and 1 to cache), not its bucket's padded entries
    (8 request slots of a bucket sized by the 300-token prompt), and gives
    the reference's events."""
    from gpukv.core.requests import NewRequest
    from gpukv.device.manager import DeviceManager
    from gpukv.reference.manager import ReferenceManager

    seen = []
    drain = DeviceEventLog.drain_parts

    def noted(log):
        seen.append(log.bound)
        return drain(log)

    monkeypatch.setattr(DeviceEventLog, "drain_parts", noted)
    ms = [cls(64, 16, hash_key=bytes(16), max_model_len=512, enable_kv_cache_events=True)
          for cls in (ReferenceManager, DeviceManager)]
    for m in ms:
        m.step(new=[NewRequest("a", list(range(300)), num_tokens_to_compute=20)])
    assert seen == [3]
    ref, dev = (m.take_events() for m in ms)
    assert [b.events for b in ref] == [b.events for b in dev] and [len(b.events) for b in dev] == [1]
