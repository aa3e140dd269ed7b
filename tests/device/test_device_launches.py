"""``gpukv.device.launches``: what more than one device part launches, on its own."""

from types import SimpleNamespace

import pytest

from gpukv.core.requests import NewRequest
from gpukv.device.launches import SharedLaunches
from gpukv.device.manager import DeviceManager


def _state(events: bool = False, generation: int = 0) -> SimpleNamespace:
    """A stand-in ``DeviceState``: the events and rows ``replayed`` reads."""
    return SimpleNamespace(events=SimpleNamespace(log=object() if events else None),
                           rows=SimpleNamespace(generation=generation))


def test_a_part_is_launched_once_then_replayed_until_the_rows_are_reallocated():
    m = _state()
    shared, prepared, runs = SharedLaunches(m), {}, []
    for _ in range(3):
        shared.replayed(prepared, "part", lambda: runs.append(1))
    assert len(runs) == 1 and prepared["part"] == (0, [])  # kept on the first run (no Triton launch in it)
    m.rows.generation = 1  # captured tensors are stale: launched anew, kept again
    shared.replayed(prepared, "part", lambda: runs.append(1))
    shared.replayed(prepared, "part", lambda: runs.append(1))
    assert len(runs) == 2 and prepared["part"][0] == 1


def test_with_kv_events_every_run_launches_and_nothing_is_kept():
    shared, prepared, runs = SharedLaunches(_state(events=True)), {}, []
    for _ in range(3):
        shared.replayed(prepared, "part", lambda: runs.append(1))
    assert len(runs) == 3 and prepared == {}


@pytest.mark.parametrize("caching", [True, False])
def test_caching_and_rebuilds_follow_enable_caching(caching):
    m = DeviceManager(16, 2, hash_key=bytes(16), max_model_len=32, max_num_reqs=2, device="cpu",
                      enable_caching=caching)
    m.step(new=[NewRequest("a", [1, 2, 3, 4, 5])])  # 2 full blocks cached when caching is on
    assert sum(len(blocks) for blocks in m.pool.table_entries().values()) == (2 if caching else 0)
