"""A decode's parts run in one locked call.

The device manager's decode is plan -> stage -> launch -> finish over each
bucket's shared host plan and device buffers. Once the parts were public
and took no call lock: another thread's stage landing between a decode's
stage and its launch made the device cache the block ``[5, 9]`` whose KV was
computed for ``[5, 7]``, and a later prompt ``[1, 2, 3, 4, 5, 9, 8]`` got a
6-token hit on the wrong KV (the reference: 4). The parts are private now:
one ``decode`` call runs them under its call lock, the only code that runs
between its stage and its launch is its caller's ``graphs`` hook, and the
manager refuses every call made from there (as another thread's).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from gpukv.core.requests import NewRequest
from gpukv.device.manager import DeviceManager
from gpukv.errors import ConcurrentCallError, GpukvInputError, InvalidInputError
from gpukv.reference.manager import ReferenceManager

KEY = bytes(range(16))
PROMPT = [1, 2, 3, 4, 5]
PROBE = NewRequest("probe", [1, 2, 3, 4, 5, 9, 8])


def _managers():
    ref = ReferenceManager(16, 2, hash_key=KEY, max_model_len=32)
    dev = DeviceManager(16, 2, hash_key=KEY, max_model_len=32, max_num_reqs=4)
    for m in (ref, dev):
        m.step(new=[NewRequest("x", PROMPT)])
    return ref, dev


class Interloper:
    """A ``graphs`` hook that, between the decode's stage and its launch,
    stages a decode of token 9 for the same row (through the parts where a
    manager offers them, else a whole ``decode``), from another thread or
    from this one, and then launches what the decode staged."""

    def __init__(self, m, row: int, other_thread: bool) -> None:
        self.m, self.row, self.other_thread = m, row, other_thread
        self.refused: list[BaseException] = []

    def _interfere(self) -> None:
        m = self.m
        try:
            if hasattr(m, "stage_decode"):  # (the parts, public once)
                m.stage_decode(m.plan_decode(np.array([self.row]), 1), np.array([[9]]))
            else:
                m.decode([self.row], [9])
        except GpukvInputError as e:
            self.refused.append(e)

    def run(self, _key, launch) -> None:
        if self.other_thread:
            t = threading.Thread(target=self._interfere)
            t.start()
            t.join()
        else:
            self._interfere()
        launch()


@pytest.mark.parametrize("other_thread", [True, False], ids=["another-thread", "the-hook-itself"])
def test_a_stage_between_a_decode_stage_and_launch_is_refused(other_thread):
    ref, dev = _managers()
    ref.decode([ref.row_of("x")], [7])
    hook = Interloper(dev, dev.row_of("x"), other_thread)
    assert dev.decode([dev.row_of("x")], [7], graphs=hook).ok
    assert [type(e) for e in hook.refused] == [ConcurrentCallError]
    assert hook.refused[0].argument == "decode"
    assert not dev.failed
    # The block [5, 7] is cached as [5, 7]: the probe hits [1, 2], [3, 4] only.
    hits = [m.get_computed_blocks(PROBE).num_tokens for m in (ref, dev)]
    assert hits == [4, 4]
    assert dev.block_hashes("x") == ref.block_hashes("x")
    dev.check_invariants()


def test_the_decode_parts_are_not_public():
    for name in ("plan_decode", "stage_decode", "launch_decode", "finish_decode"):
        assert not hasattr(DeviceManager, name), name


class _Keeper:
    """A ``graphs`` hook that launches what the decode staged, and keeps the launch."""

    def run(self, _key, launch) -> None:
        self.launch = launch
        launch()


def test_a_launch_outside_a_decode_is_refused():
    _, dev = _managers()
    keeper = _Keeper()
    assert dev.decode([dev.row_of("x")], [7], graphs=keeper).ok
    before = dev._rows.tokens.clone()
    with pytest.raises(InvalidInputError) as info:
        keeper.launch()  # what a graphs object would run, outside its decode
    assert info.value.argument == "bufs"
    assert str(info.value).endswith("; call decode(rows, new_token_ids, graphs=...): it plans, stages, launches "
                                    "and finishes in one call")
    assert dev._rows.tokens.equal(before) and not dev.failed
