"""Stream discipline of the device manager (``gpukv.device.manager``'s docstring,
"Streams"): a manager runs on a stream of its
own; a call made on another stream runs on the manager's without waiting for
the caller's work (only for device tensors it takes from the caller), and
makes the caller's stream wait for it.

The CPU has no streams: these tests give a CPU manager a stand-in stream and
stand-ins for ``torch.cuda.current_stream``/``torch.cuda.stream``, and check
the decision (same stream: nothing; another: run on the manager's, the
caller waits for it, the manager waits for the caller only for its device
tokens). ``tests/device/test_manager_gpu.py`` makes a real two-stream call."""

import pytest
import torch

import gpukv._runtime  # noqa: F401
import gpukv.device.calls
from gpukv.core.requests import NewRequest, RunningUpdate
from gpukv.device.manager import DeviceManager
from gpukv.errors import UnknownRequestError

KEY = bytes(range(16))


class FakeStream:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def wait_stream(self, other: "FakeStream") -> None:
        self.log.append(f"{self.name} waits for {other.name}")

    def __repr__(self) -> str:
        return self.name


class Streams:
    """A current stream, and the stand-ins that read and switch it."""

    def __init__(self, monkeypatch) -> None:
        self.log: list[str] = []
        self.own = FakeStream("own", self.log)
        self.other = FakeStream("other", self.log)
        self.current = self.own
        streams = self

        class Switch:
            def __init__(self, stream) -> None:
                self.stream = stream

            def __enter__(self) -> None:
                self.saved, streams.current = streams.current, self.stream
                streams.log.append(f"on {self.stream.name}")

            def __exit__(self, *exc) -> None:
                streams.current = self.saved
                streams.log.append(f"back on {self.saved.name}")

        monkeypatch.setattr(torch.cuda, "current_stream", lambda _device=None: streams.current)
        monkeypatch.setattr(torch.cuda, "stream", Switch)


@pytest.fixture
def manager():
    m = DeviceManager(32, 4, hash_key=KEY, max_model_len=64, max_num_reqs=8, device="cpu")
    m.step(new=[NewRequest("a", list(range(9)))])
    return m


def bound(m: DeviceManager, monkeypatch) -> Streams:
    """Bind the CPU manager ``m`` to a stand-in stream; record the stream each step runs on."""
    s = Streams(monkeypatch)
    m._stream = s.own
    step = m._step

    def on_which(*args, **kwargs):
        s.log.append(f"step runs on {s.current.name}")
        return step(*args, **kwargs)

    m._step = on_which  # type: ignore[method-assign]
    return s


def test_without_cuda_a_manager_has_no_stream_and_asks_for_none(manager, monkeypatch):
    def no_streams(*_args, **_kwargs):
        raise AssertionError("asked for a CUDA stream on the CPU")

    monkeypatch.setattr(torch.cuda, "current_stream", no_streams)
    monkeypatch.setattr(torch.cuda, "stream", no_streams)
    assert manager._stream is None
    manager.step(new=[NewRequest("b", list(range(5)))])
    assert manager.block_table_for(["a", "b"]).shape[1] == 2
    assert manager.read_num_free_blocks() > 0


def test_a_call_on_the_managers_stream_is_not_reordered(manager, monkeypatch):
    s = bound(manager, monkeypatch)
    manager.step(new=[NewRequest("b", list(range(5)))])
    manager.block_table_for(["a", "b"])
    manager.read_num_free_blocks()
    assert s.log == ["step runs on own"]


def test_a_call_on_another_stream_runs_on_its_own_without_waiting_for_it_and_is_waited_for(manager, monkeypatch):
    s = bound(manager, monkeypatch)
    s.current = s.other
    manager.step(new=[NewRequest("b", list(range(5)))])
    assert s.log == ["on own", "step runs on own", "back on other", "other waits for own"]
    assert s.current is s.other
    s.log.clear()
    table = manager.block_table_for(["a", "b"])
    assert table.shape[1] == 2
    assert s.log == ["on own", "back on other", "other waits for own"]


class FakeDeviceTokens:
    """Tokens left on the caller's device: records the streams it is marked used on."""

    def __init__(self, log: list) -> None:
        self.log = log

    def record_stream(self, stream: FakeStream) -> None:
        self.log.append(f"tokens used on {stream.name}")


@pytest.mark.parametrize("call", ["decode", "step", "allocate_slots"])
def test_tokens_on_the_callers_device_make_the_manager_wait_for_the_caller_first(manager, monkeypatch, call):
    row = manager.row_of("a")
    s = bound(manager, monkeypatch)
    s.current = s.other
    # (CPU tokens stand for device ones: every token container the call takes is one the caller wrote)
    monkeypatch.setattr(gpukv.device.calls, "on_device",
                        lambda values: [FakeDeviceTokens(s.log) for v in values if v is not None and len(v)])
    if call == "decode":
        manager.decode([row], [7])
    elif call == "step":
        manager.step(running=[RunningUpdate("a", [7])])
    else:
        manager.allocate_slots("a", [7])
    assert s.log[:3] == ["on own", "own waits for other", "tokens used on own"]  # (before any launch)
    assert s.log[-2:] == ["back on other", "other waits for own"] and s.log.count("own waits for other") == 1


def test_a_nested_call_is_ordered_once(manager, monkeypatch):
    s = bound(manager, monkeypatch)
    s.current = s.other
    # allocate_slots runs a lookup, a step and get_block_ids (a wrapped call) inside it
    assert manager.allocate_slots(NewRequest("b", list(range(9)))) is not None
    assert "own waits for other" not in s.log
    assert s.log.count("on own") == 1 and s.log.count("other waits for own") == 1
    assert s.log[-2:] == ["back on other", "other waits for own"] and s.current is s.other


def test_reads_outside_wrapped_calls_run_on_the_managers_stream_and_wait_for_no_caller(manager, monkeypatch):
    s = bound(manager, monkeypatch)
    s.current = s.other
    reads = manager.counters.reads
    assert manager._read(manager.pool.free_count) == [32 - 1 - 3]
    assert s.log == ["on own", "back on other", "other waits for own"]
    assert manager.counters.reads == reads + 1
    s.log.clear()
    manager.check_invariants()
    assert s.log == ["on own", "back on other", "other waits for own"]


def test_the_free_count_after_a_step_comes_from_the_host_mirror_without_a_read(manager):
    reads = manager.counters.reads
    assert manager.read_num_free_blocks() == 32 - 1 - 3
    manager.step(new=[NewRequest("b", list(range(100, 105)))])  # 2 blocks more (no hit)
    assert manager.read_num_free_blocks() == 32 - 1 - 5
    assert manager.counters.reads == reads + 1  # (the admission's own read: none for the counts)
    assert manager._mirror.reads == 2


def test_the_free_count_is_read_when_the_pool_changed_outside_a_step(manager):
    manager.free("a")
    assert manager.reset_prefix_cache()
    reads = manager.counters.reads
    assert not manager._mirror.fresh
    assert manager.read_num_free_blocks() == 32 - 1
    assert manager.counters.reads == reads + 1


def test_a_refused_call_on_another_stream_goes_back_to_the_callers_stream(manager, monkeypatch):
    s = bound(manager, monkeypatch)
    s.current = s.other
    with pytest.raises(UnknownRequestError):
        manager.step(finished=["nope"])
    assert s.current is s.other and not manager.failed
    assert s.log == ["on own", "back on other", "other waits for own"]
