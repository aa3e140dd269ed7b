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
from gpukv.reference.manager import ReferenceManager

KEY = bytes(range(16))


def _span(host) -> tuple[int, int]:
    """The host bytes ``[start, end)`` of a tensor or a numpy array."""
    if isinstance(host, torch.Tensor):
        return host.data_ptr(), host.data_ptr() + host.numel() * host.element_size()
    start = host.__array_interface__["data"][0]
    return start, start + host.nbytes


class LaggingGpu:
    """Copies issued in order; a copy is done once the host waited on an event
    recorded after it (the GPU never gets ahead of what the host waited for).
    Host memory is told apart by address: each copy keeps its source alive,
    so no later allocation can take its bytes while the model watches them."""

    def __init__(self) -> None:
        self.issued = 0  # copies issued so far (copy n is the n-th, from 1)
        self.done = 0  # copies 1..done are known complete
        self.copies: list[tuple[object, int, int, int]] = []  # (source's name, start, end, n)
        self._sources: list = []
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

    def write(self, host, name: object) -> None:
        """The host is about to write the whole of ``host`` (``name``: what it is)."""
        start, end = _span(host)
        for source, cs, ce, n in self.copies:
            if cs < end and start < ce and n > self.done:
                self.hazards.append(f"host wrote {name!r} while copy {n} from {source!r} may still be pending "
                                    "(no waited-on event after it)")

    def copy(self, host, name: object) -> None:
        """A non-blocking copy from ``host`` is issued."""
        self.issued += 1
        self._sources.append(host)
        self.copies.append((name, *_span(host), self.issued))


class PinnedOnCpu(Staging):
    """``Staging``'s pinned path on the CPU: plain buffers, every write and
    copy reported to ``gpu`` (named "staging" for a staging buffer's
    region, else by the ``host_array`` key)."""

    def __init__(self, device, counters, gpu: LaggingGpu, nbytes: int = 1 << 16) -> None:
        self._pinned = True
        self.gpu = gpu
        super().__init__(device, counters, nbytes)
        self._pinned = True

    def _alloc(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def host_array(self, key, size):
        array = super().host_array(key, size)
        self.gpu.write(array, key)
        return array

    def upload_host(self, key, out, count=None):
        src = self._again.get(key)
        if src is None and key not in self._sent:
            src = self._fixed[key][0][self._cur]
        if src is not None:  # (else refused: nothing is copied)
            self.gpu.copy(src if count is None else src[:count], key)
        super().upload_host(key, out, count)

    def _host_view(self, array: np.ndarray) -> torch.Tensor:
        host = super()._host_view(array)
        if array.size:
            self.gpu.write(host, "staging")
            self.gpu.copy(host, "staging")
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


def test_a_key_sent_in_a_step_gets_a_staging_region_if_asked_again_in_it(gpu):
    """``host_array`` of a key this step sent already: a zeroed region of the
    step's staging buffer, not the kept array (a copy from it may be
    pending); each further ask another region; the next step the kept array
    of its parity again. ``upload_host`` with a count sends only the first
    elements, and refuses a key sent again with no new ask (its caller would
    have written the array the first copy still reads)."""
    s = PinnedOnCpu(torch.device("cpu"), StepCounters(), gpu, nbytes=1024)
    out = torch.full((6,), -1, dtype=torch.int32)
    s.begin_step()
    kept = s.host_array("plan", 6)
    assert kept.tolist() == [0] * 6
    kept[:] = [1, 2, 3, 4, 5, 6]
    s.upload_host("plan", out, 4)
    assert out.tolist() == [1, 2, 3, 4, -1, -1]
    again = s.host_array("plan", 6)
    assert again.tolist() == [0] * 6 and not np.shares_memory(again, kept)
    buf = s._bufs[s._cur]
    assert buf.data_ptr() <= again.__array_interface__["data"][0] < buf.data_ptr() + len(buf)
    again[:] = [7, 8, 9, 10, 11, 12]
    s.upload_host("plan", out)
    assert out.tolist() == [7, 8, 9, 10, 11, 12] and kept.tolist() == [1, 2, 3, 4, 5, 6]
    third = s.host_array("plan", 6)
    assert not np.shares_memory(third, again)
    third[:] = 3
    s.upload_host("plan", out)
    assert out.tolist() == [3] * 6
    h2d = s.counters.h2d
    with pytest.raises(RuntimeError, match="sent in this step already"):
        s.upload_host("plan", out)  # (no new ask since the last send)
    assert s.counters.h2d == h2d and out.tolist() == [3] * 6
    other = s.host_array("other", 2)  # (another key: its own kept array)
    assert not np.shares_memory(other, buf.numpy())
    s.end_step()
    s.begin_step()
    nxt = s.host_array("plan", 6)
    assert not np.shares_memory(nxt, kept) and not np.shares_memory(nxt, buf.numpy())  # (the other parity's)
    s.end_step()
    s.begin_step()
    assert np.shares_memory(s.host_array("plan", 6), kept)
    s.end_step()
    assert not gpu.hazards, gpu.hazards


def test_admission_plans_go_from_host_arrays_and_a_second_one_in_a_step_from_a_region(gpu):
    """An admission's plan is written in the staging's host array of its
    bucket and sent from there; a second plan of that bucket in the same
    step (a round after a deferral) is written in a staging region, so the
    first copy's source is never written while pending."""
    m = DeviceManager(64, 4, hash_key=KEY, max_model_len=256, max_num_reqs=16, device="cpu")
    m._staging = PinnedOnCpu(m.device, m.counters, gpu)
    assert m.step(new=[NewRequest("a", list(range(9))), NewRequest("b", list(range(5)))]).ok
    assert [c[0][0] for c in gpu.copies] == ["admission"]
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
    assert len(first) == len(second) == 1 and first[0][0] == second[0][0] and first[0][0][0] == "admission"
    buf = m._staging._bufs[m._staging._cur]
    assert first[0][1] != second[0][1] and buf.data_ptr() <= second[0][1] < buf.data_ptr() + len(buf)
    assert not gpu.hazards, gpu.hazards
    m.check_invariants()


def test_a_deferred_rounds_gather_never_overwrites_its_first_rounds_pending_plan(gpu):
    """A step that defers (b's hit is evicted by a's pops, ``test_manager``'s
    hand-worked case) with its block ids read: each round lays out and
    sends the output gather of the same bucket; the second is written in a
    staging region, and the step's block ids are the reference's."""
    ref = ReferenceManager(10, 2, hash_key=KEY)
    m = DeviceManager(10, 2, hash_key=KEY, device="cpu")
    m._staging = PinnedOnCpu(m.device, m.counters, gpu)
    new = [NewRequest("a", list(range(300, 312))), NewRequest("b", [7, 8, 9]), NewRequest("c", list(range(300, 305)))]
    results = []
    for mgr in (ref, m):
        mgr.step(new=[NewRequest("p", [7, 8, 9]), NewRequest("r", [50, 51, 52, 53, 54, 55, 56])])
        mgr.step(finished=["p", "r"])
        before = len(gpu.copies)
        results.append(mgr.step(new=new, block_ids=True))
    gathers = [c for c in gpu.copies[before:] if c[0][0] == "gather"]
    assert len(gathers) == 2 and gathers[0][0] == gathers[1][0] and gathers[0][1] != gathers[1][1]
    assert results[1].admitted_block_ids == results[0].admitted_block_ids == [[[6, 2, 7, 8, 9, 1], [5, 4], [6, 2, 3]]]
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
    sent = [c[0][0] for c in gpu.copies if isinstance(c[0], tuple)]
    assert sent.count("decode") == 6  # every decode sent its plan, its tokens in the same upload
    assert "decode tokens" not in sent
    assert not gpu.hazards, gpu.hazards
    m.check_invariants()


def test_the_torch_op_counter_counts_every_kernel_and_no_view():
    """Each operation that runs a kernel counts one, whatever its name holds
    (``cat``, ``sort`` and ``sqrt`` end in ``t``, ``index_select`` holds
    ``select``, both names of views); a view, a slice, a transpose or a
    detach counts none."""
    from gpukv.device.staging import TorchOpCounter

    a = torch.arange(6, dtype=torch.int64)
    f = a.to(torch.float32)
    kernels = {"cat": lambda: torch.cat([a, a]), "sort": lambda: torch.sort(a), "sqrt": lambda: f.sqrt(),
               "index_select": lambda: a.index_select(0, a[:2]), "argsort": lambda: torch.argsort(a),
               "bitwise_not": lambda: torch.bitwise_not(a), "add": lambda: a + 1, "copy_": lambda: a.clone().copy_(a)}
    views = {"view": lambda: a.view(2, 3), "slice": lambda: a[1:4], "select": lambda: a[2],
             "t": lambda: a.view(2, 3).t(), "dtype view": lambda: a.view(torch.int32), "detach": lambda: a.detach(),
             "unbind": lambda: a.view(2, 3).unbind()}

    def count(op) -> int:
        counted = StepCounters()
        with TorchOpCounter(counted):
            op()
        return counted.torch_ops

    assert {name: count(op) for name, op in kernels.items()} == {"cat": 1, "sort": 1, "sqrt": 1, "index_select": 1,
                                                                 "argsort": 1, "bitwise_not": 1, "add": 1,
                                                                 "copy_": 2}  # (the clone, the copy)
    assert {name: count(op) for name, op in views.items()} == dict.fromkeys(views, 0)
