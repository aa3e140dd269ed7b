"""The pinned staging buffers' event discipline (``gpukv.device.staging``),
checked on the CPU against a model of a GPU that lags behind the host.

A non-blocking copy from pinned memory reads its source when the GPU gets to
it, not when the host issues it; the host may write those bytes again only
once an event recorded after the copy has completed. ``LaggingGpu`` keeps
every copy issued from a staging buffer (its byte range) and the events
(which copies they follow, whether the host waited on them), and flags each
host write into bytes whose copy no waited-on event covers. Staging runs its
pinned path (buffers in plain memory: the CPU has no pinned allocator).
"""

import numpy as np
import pytest
import torch

import gpukv._runtime  # noqa: F401
from gpukv.core.metrics import StepCounters
from gpukv.core.requests import NewRequest
from gpukv.device.manager import DeviceManager
from gpukv.device.staging import Staging

KEY = bytes(range(16))


class LaggingGpu:
    """Copies issued in order; a copy is done once the host waited on an event
    recorded after it (the GPU never gets ahead of what the host waited for)."""

    def __init__(self) -> None:
        self.issued = 0  # copies issued so far (copy n is the n-th, from 1)
        self.done = 0  # copies 1..done are known complete
        self.copies: list[tuple[int, int, int, int]] = []  # (buffer, start, end, n)
        self.hazards: list[str] = []

    def event(self):
        gpu = self

        class Event:
            def __init__(self, *_args, **_kwargs) -> None:
                self.after = None

            def record(self, _stream=None) -> None:
                self.after = gpu.issued

            def synchronize(self) -> None:
                assert self.after is not None, "waited on an event never recorded"
                gpu.done = max(gpu.done, self.after)

        return Event

    def write_and_copy(self, staging: Staging, host: torch.Tensor) -> None:
        """The host wrote ``host`` (a view of a staging buffer) and issues a copy from it."""
        ptr, nbytes = host.data_ptr(), host.numel() * host.element_size()
        for b, buf in enumerate(staging._bufs):
            base = buf.data_ptr()
            if base <= ptr < base + len(buf):
                start, end = ptr - base, ptr - base + nbytes
                for cb, cs, ce, n in self.copies:
                    if cb == b and cs < end and start < ce and n > self.done:
                        self.hazards.append(f"host wrote bytes [{start}, {end}) of buffer {b} while copy {n} "
                                            f"of [{cs}, {ce}) may still be pending (no waited-on event after it)")
                self.issued += 1
                self.copies.append((b, start, end, self.issued))
                return
        self.issued += 1  # a one-off region: fresh memory

    def write(self, where: tuple) -> None:
        """The host is about to write the whole of ``where`` (a ``host_array``)."""
        for cb, _cs, _ce, n in self.copies:
            if cb == where and n > self.done:
                self.hazards.append(f"host wrote host array {where} while copy {n} from it may still be pending")

    def copy(self, where: tuple) -> None:
        self.issued += 1
        self.copies.append((where, 0, 0, self.issued))


class PinnedOnCpu(Staging):
    """``Staging``'s pinned path on the CPU: plain buffers, every write and
    copy reported to ``gpu``."""

    def __init__(self, device, counters, gpu: LaggingGpu, nbytes: int = 1 << 16) -> None:
        self._pinned = True
        self.gpu = gpu
        super().__init__(device, counters, nbytes)
        self._pinned = True

    def _alloc(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def host_array(self, key, size):
        self.gpu.write((key, self._cur))
        return super().host_array(key, size)

    def upload_host(self, key, out, count=None):
        self.gpu.copy((key, self._cur))
        super().upload_host(key, out, count)

    def _host_view(self, array: np.ndarray) -> torch.Tensor:
        host = super()._host_view(array)
        if array.size:
            self.gpu.write_and_copy(self, host)
        return host


@pytest.fixture
def gpu(monkeypatch):
    model = LaggingGpu()
    monkeypatch.setattr(torch.cuda, "Event", model.event())
    return model


def test_an_upload_between_steps_is_a_step_of_its_own(gpu):
    s = PinnedOnCpu(torch.device("cpu"), StepCounters(), gpu, nbytes=1024)
    small, big = np.arange(4, dtype=np.int64), np.arange(100, dtype=np.int64)
    s.begin_step()
    s.upload(small)  # a small step...
    s.end_step()
    out = s.upload(small + 7)  # ... then an upload outside any step (block_table_for's)
    assert out.tolist() == (small + 7).tolist()
    for _ in range(3):  # later, larger steps write over every byte of both buffers
        s.begin_step()
        s.upload(big)
        s.end_step()
    assert gpu.issued == 5 and not gpu.hazards, gpu.hazards


def test_uploads_in_steps_wait_for_the_step_two_back(gpu):
    s = PinnedOnCpu(torch.device("cpu"), StepCounters(), gpu, nbytes=1024)
    for n in (3, 50, 7, 90, 20, 120):
        s.begin_step()
        s.upload(np.arange(n, dtype=np.int32))
        s.upload(np.arange(n, dtype=np.int64))
        s.end_step()
    assert not gpu.hazards, gpu.hazards
    # the model flags a write into a pending copy's bytes (the check is not vacuous)
    s.begin_step()
    s.upload(np.arange(8, dtype=np.int64))
    s._cur ^= 1  # (as if the next step skipped its wait: this buffer's last copies are pending)
    s._off = 0
    s.upload(np.arange(8, dtype=np.int64))
    s.end_step()
    assert gpu.hazards


def test_block_table_for_between_steps_never_overwrites_a_pending_copy(gpu):
    """Steps and ``block_table_for`` calls interleaved, small steps before
    larger ones so that a step's uploads reach the bytes of the block table
    rows uploaded two steps before (where the old code wrote with no event)."""
    m = DeviceManager(64, 4, hash_key=KEY, max_model_len=256, max_num_reqs=16, device="cpu")
    m._staging = PinnedOnCpu(m.device, m.counters, gpu)
    m.step(new=[NewRequest("a", list(range(9)))])
    ids = ["a"]
    for k in range(4):
        assert m.block_table_for(ids)[0, :, 0].tolist() == [m.get_block_ids(r)[0][0] for r in ids]
        m.step(running=[])  # a step that uploads little or nothing
        assert m.block_table_for(ids).shape[1] == len(ids)
        new = [NewRequest(f"r{k}.{j}", [100 * k + j] * (5 + 3 * j)) for j in range(2 + k)]
        m.step(new=new)  # a larger one
        ids += [r.request_id for r in new]
    assert gpu.issued > 10
    assert not gpu.hazards, gpu.hazards


def test_host_arrays_alternate_with_the_steps_and_are_written_only_after_their_copy(gpu):
    """``Staging.host_array``: the decode's plan, written in place and sent
    as it is. Each step gets the other of its two arrays; the one it writes
    was last sent two steps before, whose event the step waited on."""
    s = PinnedOnCpu(torch.device("cpu"), StepCounters(), gpu, nbytes=1024)
    with pytest.raises(RuntimeError, match="inside a step"):
        s.host_array("plan", 4)
    out = torch.zeros(4, dtype=torch.int32)
    arrays = []
    for step in range(4):
        s.begin_step()
        host = s.host_array("plan", 4)
        host[:] = step
        s.upload_host("plan", out)
        s.end_step()
        arrays.append(host)
        assert out.tolist() == [step] * 4
    assert arrays[0] is arrays[2] and arrays[1] is arrays[3] and arrays[0] is not arrays[1]
    assert not gpu.hazards, gpu.hazards
    s.begin_step()
    s._cur ^= 1  # (as if this step skipped its wait: the array it gets was sent last step)
    s.host_array("plan", 4)
    assert gpu.hazards


def test_a_host_array_sent_in_a_step_is_not_handed_out_again_in_that_step(gpu):
    """``unsent_host_array``: a key's array, unless this step sent it already
    (a copy from it may be pending) or no step is open; ``upload_host``
    with a count sends only the array's first elements."""
    s = PinnedOnCpu(torch.device("cpu"), StepCounters(), gpu, nbytes=1024)
    assert s.unsent_host_array("plan", 6) is None  # (outside a step)
    out = torch.full((6,), -1, dtype=torch.int32)
    s.begin_step()
    host = s.unsent_host_array("plan", 6)
    assert host is not None and host.tolist() == [0] * 6
    host[:] = [1, 2, 3, 4, 5, 6]
    s.upload_host("plan", out, 4)
    assert out.tolist() == [1, 2, 3, 4, -1, -1]
    assert s.unsent_host_array("plan", 6) is None  # (sent in this step)
    assert s.unsent_host_array("other", 2) is not None
    s.end_step()
    s.begin_step()
    again = s.unsent_host_array("plan", 6)
    assert again is not None and again is not host  # (the other parity's)
    s.end_step()
    assert not gpu.hazards, gpu.hazards


def test_admission_plans_go_from_host_arrays_and_a_second_one_in_a_step_uploads_anew(gpu):
    """An admission's plan is written in the staging's host array of its
    bucket and sent from there; a second plan of that bucket in the same
    step (a round after a deferral) goes through a new upload instead, so
    the first copy's source is never written while pending."""
    m = DeviceManager(64, 4, hash_key=KEY, max_model_len=256, max_num_reqs=16, device="cpu")
    m._staging = PinnedOnCpu(m.device, m.counters, gpu)
    assert m.step(new=[NewRequest("a", list(range(9))), NewRequest("b", list(range(5)))]).ok
    sent = [c[0][0] for c in gpu.copies if isinstance(c[0], tuple)]
    assert [k[0] for k in sent] == ["admission"]
    admission = m._admission
    request = m._normalize((), (), [NewRequest("c", list(range(7)))], single=True).new[0]
    row = m._rows.take()
    with m._counting():
        before = len(gpu.copies)
        admission.admit([request], [row], admission.unblocked(), dry=True)
        first = gpu.copies[before:]
        admission.admit([request], [row], admission.unblocked(), dry=True)
        second = gpu.copies[before + len(first):]
    m._rows.give_back_unused([row])
    assert [c[0][0][0] for c in first] == ["admission"]
    assert len(second) == 1 and isinstance(second[0][0], int)  # (a staging buffer's region)
    assert not gpu.hazards, gpu.hazards
    m.check_invariants()


def test_decodes_between_other_steps_never_overwrite_a_pending_plan(gpu):
    """Decodes (their plans in host arrays) interleaved with admissions and
    ``block_table_for`` calls between steps, each of which flips the buffers."""
    m = DeviceManager(64, 4, hash_key=KEY, max_model_len=256, max_num_reqs=16, device="cpu")
    m._staging = PinnedOnCpu(m.device, m.counters, gpu)
    m.step(new=[NewRequest("a", list(range(9))), NewRequest("b", list(range(5)))])
    for k in range(6):
        assert m.decode([0, 1], [[k], [k + 1]]).ok
        if k % 2:
            m.block_table_for(["a"])
        if k % 3 == 0:
            assert m.step(new=[NewRequest(f"c{k}", [50 + k] * 3)]).ok
    sent = [c[0][0][0] for c in gpu.copies if isinstance(c[0], tuple)]
    assert sent.count("decode") == 6  # every decode sent its plan, its tokens in the same upload
    assert "decode tokens" not in sent
    assert not gpu.hazards, gpu.hazards
    m.check_invariants()
