"""Fail-stop: a fault inside a call stops the manager; input errors do not.

Every Triton kernel the device manager launches is, in turn, replaced by one
that raises when launched; the call that launches it must raise that fault,
and from then on every call must raise ``ManagerFailedError`` naming it
(instead of running on a half-applied step). The reference stops the same
way when its pool fails under it.
"""

from __future__ import annotations

import importlib
import warnings

import pytest

from gpukv import NewRequest, RunningBatch, RunningUpdate
from gpukv.device import launches as launches_module
from gpukv.device.decode import DecodePath
from gpukv.device.manager import DeviceManager
from gpukv.device.releases import Releases
from gpukv.errors import InvalidInputError, InvalidTypeError, ManagerFailedError, UnknownRequestError
from gpukv.kernels import block_hash
from gpukv.reference.manager import ReferenceManager
from gpukv.reference.releases import ReferenceReleases
from gpukv.reference.running import ReferenceRunning
from tests.kernels import aot

PREFIX = list(range(100, 108))


class _InjectedFault(RuntimeError):
    """The fault a test injects (never raised by gpukv itself)."""


class _FailingKernel:
    """Stands in for a jit kernel: ``kernel[grid](...)`` raises."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.launched = False

    def __getitem__(self, grid):
        def launch(*_args, **_kwargs):
            self.launched = True
            raise _InjectedFault(f"injected fault in {self.name}")

        return launch


def _workload(m) -> None:
    """Steps that reach every phase: admission with shared prefixes and
    pending hits, decode that allocates, finishing, eviction, lookup."""
    m.step(new=[NewRequest("a", PREFIX + [1, 2, 3]), NewRequest("b", PREFIX + [4])])
    m.step(running=RunningBatch([m.row_of("a"), m.row_of("b")], [5, 6, 7], num_new_tokens=[2, 1]), block_ids=True,
           prefix_of="a")
    m.decode([m.row_of("a"), m.row_of("b")], [[8, 9], [10, 11]])
    m.step(finished=["a"], new=[NewRequest("c", PREFIX + [1, 2, 3, 5, 9])])
    m.step(finished=["b", "c"])
    m.step(new=[NewRequest(f"e{i}", [1000 * (i + 1) + t for t in range(12)]) for i in range(3)])
    m.get_computed_blocks(NewRequest("probe", PREFIX))
    m.step(finished=["e0", "e1", "e2"])
    assert m.reset_prefix_cache()


@pytest.fixture(autouse=True)
def _hash_on_the_device(monkeypatch):
    """Under the interpreter the manager hashes on the host; launch the kernel."""
    monkeypatch.setattr(launches_module, "_hash_rows", block_hash.hash_rows)


def _device() -> DeviceManager:
    return DeviceManager(12, 4, hash_key=bytes(16), max_model_len=64, max_num_reqs=4)


# Kernels no manager step launches: the slot mapping (the serving loop's),
# byte hashing (test vectors), the batch chain hasher (the manager hashes rows
# in place), compaction (only when the free-queue ring wraps), and the
# table's find and the lookup's verify (public building blocks: the
# admission probes and verifies inside ``prefill._lookup_kernel``).
NOT_LAUNCHED = {"block_hash._blake3_bytes_kernel", "block_hash._hash_block_chains_kernel", "free_queue._compact_kernel",
                "slot_mapping._slot_mapping_kernel", "hash_table._find_kernel", "lookup._verify_kernel",
                "hash_table._erase_kernel",  # (the allocation's erase runs inside blocks._place_kernel)
                "blocks._touch_kernel", "free_queue._remove_kernel"}  # (the admission's launches touch its hits)


def _kernels():
    kernels, _, _ = aot.discover()
    return sorted(kernels.items())


def _launched_kernels():
    return [name for name, _ in _kernels() if name not in NOT_LAUNCHED]


def _every_call_after_a_fault(m) -> list:
    """Every kind of call: mutating ones, reads, the properties that read
    state, the invariants, and the decode's parts (reads too are refused
    after a fault)."""
    calls = [
        lambda: m.step(),
        lambda: m.step(new=[NewRequest("z", [1, 2, 3])]),
        lambda: m.free("a"),
        lambda: m.get_block_ids("a"),
        lambda: m.get_computed_blocks(NewRequest("y", [1])),
        lambda: m.reset_prefix_cache(),
        lambda: m.make_prefix_cache_stats(),
        lambda: m.read_num_free_blocks(),
        lambda: m.read_num_evictions(),
        lambda: m.read_usage(),
        lambda: m.num_free_blocks,
        lambda: m.num_evictions,
        lambda: m.usage,
        lambda: m.free_queue(),
        lambda: m.request_ids(),
        lambda: m.row_token_counts([]),
        lambda: m.check_invariants(),
        lambda: m.take_events(),
    ]
    return calls


def _assert_stopped(m, fault_type: type[BaseException]) -> None:
    assert m.failed and isinstance(m.failure, fault_type)  # (the one diagnostic that answers)
    for call in _every_call_after_a_fault(m):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # (the device's waiting properties warn first)
            with pytest.raises(ManagerFailedError, match="stopped after a fault") as info:
                call()
        assert isinstance(info.value.__cause__, fault_type)
        assert type(info.value.__cause__).__name__ in str(info.value)
    assert m.num_blocks == 12 and m.limits.block_size == 4  # (its configuration still answers)


@pytest.mark.parametrize("name", _launched_kernels())
def test_a_fault_in_any_kernel_stops_the_device_manager(name, monkeypatch):
    kernels = dict(_kernels())
    kernel = kernels[name]
    module = importlib.import_module(kernel.fn.__module__)
    m = _device()
    failing = _FailingKernel(name)
    monkeypatch.setattr(module, kernel.fn.__name__, failing)
    with pytest.raises(_InjectedFault) as info:
        _workload(m)
    assert str(info.value) == f"injected fault in {name}"
    monkeypatch.undo()  # the kernel works again; the manager must stay stopped anyway
    _assert_stopped(m, _InjectedFault)


def test_the_workload_launches_every_kernel_but_the_known_few(monkeypatch):
    """The parametrised test above covers the kernels a manager step launches;
    this pins down which those are, so a new kernel cannot slip past it."""
    launched = set()
    for name, kernel in _kernels():
        module = importlib.import_module(kernel.fn.__module__)
        failing = _FailingKernel(name)
        with monkeypatch.context() as patch:
            patch.setattr(module, kernel.fn.__name__, failing)
            try:
                _workload(_device())
            except _InjectedFault:
                launched.add(name)
    assert launched == set(_launched_kernels())


def test_input_errors_leave_the_manager_running():
    for m in (_device(), ReferenceManager(12, 4, hash_key=bytes(16), max_model_len=64)):
        m.step(new=[NewRequest("a", [1, 2, 3, 4, 5])])
        with pytest.raises(InvalidInputError):
            m.step(finished=["a"], new=[NewRequest("b", [1], lora_id=2**64)])
        with pytest.raises(UnknownRequestError):
            m.free("nobody")
        assert not m.failed
        assert m.get_block_ids("a") == [[1, 2]] or m.get_block_ids("a")[0][0] > 0
        m.step(finished=["a"])
        m.check_invariants()


def test_a_fault_in_the_reference_pool_stops_the_reference(monkeypatch):
    m = ReferenceManager(12, 4, hash_key=bytes(16))
    m.step(new=[NewRequest("a", PREFIX + [1])])

    def broken(_self, _num_blocks):
        raise _InjectedFault("injected fault in BlockPool.allocate")

    monkeypatch.setattr(type(m.pool), "allocate", broken)
    with pytest.raises(_InjectedFault):
        m.step(running=[RunningUpdate("a", [1, 2, 3, 4])])
    monkeypatch.undo()
    _assert_stopped(m, _InjectedFault)


# ------------------------------ refusal or fault: the point of first change

def _reference() -> ReferenceManager:
    return ReferenceManager(12, 4, hash_key=bytes(16), max_model_len=64)


def _both():
    return (_reference(), _device())


def _admitted(m):
    m.step(new=[NewRequest("a", PREFIX + [1]), NewRequest("b", PREFIX + [2])])
    return m


def _raiser(exc: BaseException):
    def raise_it(*_args, **_kwargs):
        raise exc

    return raise_it


@pytest.mark.parametrize("make", [_reference, _device], ids=["ref", "dev"])
@pytest.mark.parametrize("exc", [InvalidInputError("injected", argument="x", fix="y"),
                                 UnknownRequestError("injected", argument="x", fix="y"),
                                 RuntimeWarning("injected"), DeprecationWarning("injected")],
                         ids=lambda e: type(e).__name__)
def test_an_input_error_or_warning_after_the_first_change_is_a_fault(make, exc, monkeypatch):
    """Once a call has started changing state, what it raises stops the
    manager whatever its class: an input error class or a warning may come
    from a half-applied step (so neither passes as a refusal)."""
    m = _admitted(make())
    owner, target = (ReferenceReleases, "request") if isinstance(m, ReferenceManager) else (Releases, "requests")
    monkeypatch.setattr(owner, target, _raiser(exc))
    with pytest.raises(type(exc)):
        m.step(finished=["a"])
    monkeypatch.undo()
    _assert_stopped(m, type(exc))


@pytest.mark.parametrize("make", [_reference, _device], ids=["ref", "dev"])
def test_an_input_error_before_the_first_change_is_a_refusal_and_anything_else_a_fault(make, monkeypatch):
    m = _admitted(make())
    monkeypatch.setattr(type(m), "_normalize", _raiser(InvalidInputError("injected", argument="x", fix="y")))
    with pytest.raises(InvalidInputError):
        m.step(finished=["a"])
    assert not m.failed
    # A TypeError raised inside a call (not by a call that does not fit the
    # signature) is no call mistake: a fault, even before the first change.
    monkeypatch.setattr(type(m), "_normalize", _raiser(TypeError("a bug in the checks")))
    with pytest.raises(TypeError) as info:
        m.step(finished=["a"])
    assert type(info.value) is TypeError
    monkeypatch.undo()
    _assert_stopped(m, TypeError)


@pytest.mark.parametrize("make", [_reference, _device], ids=["ref", "dev"])
def test_call_mistakes_and_a_callers_raising_iterator_are_refusals(make):
    """Each of these is a typed refusal that leaves the manager running, not
    an untyped error that stops it (a typo must not stop a serving process)."""

    class Boom(Exception):
        pass

    def failing_tokens():
        yield 1
        raise Boom("midway")

    m = _admitted(make())
    before = (m.free_queue(), m.get_block_ids("a"), m.get_block_ids("b"))
    mistakes = [
        (lambda: m.step(bogus=1), InvalidTypeError, TypeError),
        (lambda: m.step((), (), (), ()), InvalidTypeError, TypeError),
        (lambda: m.free(), InvalidTypeError, TypeError),
        (lambda: m.decode([m.row_of("a")]), InvalidTypeError, TypeError),
        (lambda: m.take_events(1), InvalidTypeError, TypeError),
        (lambda: m.decode([m.row_of("a"), m.row_of("b")], [[8, 9], [10]]), InvalidInputError, None),
        (lambda: m.decode([m.row_of("a"), m.row_of("b")], [[8], [9]], num_tokens_to_compute=[[1], [2, 3]]),
         InvalidTypeError, None),
        (lambda: m.free(type("Unhashable", (str,), {"__hash__": None})("a")), InvalidTypeError, None),
        (lambda: m.step(new=[NewRequest("c", failing_tokens())]), InvalidInputError, Boom),
        (lambda: m.decode([m.row_of("a")], failing_tokens()), InvalidInputError, Boom),
    ]
    for call, cls, cause in mistakes:
        with pytest.raises(cls) as info:
            call()
        assert cause is None or type(info.value.__cause__) is cause, info.value
        assert not m.failed, info.value
    assert (m.free_queue(), m.get_block_ids("a"), m.get_block_ids("b")) == before
    assert m.decode([m.row_of("a")], [3]).ok
    m.check_invariants()


def _good_calls(m):
    """One call of each mutating method that succeeds."""
    return [
        ("step", lambda: m.step(new=[NewRequest("c", PREFIX + [3])])),
        ("decode", lambda: m.decode([m.row_of("c")], [4])),
        ("get_computed_blocks", lambda: m.get_computed_blocks(NewRequest("d", PREFIX + [5]))),
        ("allocate_slots", lambda: m.allocate_slots(NewRequest("d", PREFIX + [5]))),
        ("allocate_slots", lambda: m.allocate_slots("d", [6])),
        ("read_prefix_hit", lambda: m.read_prefix_hit(NewRequest("e", PREFIX + [7]))),
        ("admit", lambda: m.admit(NewRequest("e", PREFIX + [7]))),
        ("free", lambda: m.free("d")),
        ("free", lambda: m.free("e")),
        ("make_prefix_cache_stats", lambda: m.make_prefix_cache_stats()),
        ("take_events", lambda: m.take_events()),
        ("reset_prefix_cache", lambda: m.reset_prefix_cache()),
        ("prepare_admissions", lambda: m.prepare_admissions(6)),
    ]


@pytest.mark.parametrize("make", [_reference, _device], ids=["ref", "dev"])
def test_every_mutating_call_marks_its_point_of_first_change(make, monkeypatch):
    cls = {_reference: ReferenceManager, _device: DeviceManager}[make]
    marks = []
    real = cls._begin_changes

    def spy(self, **kwargs):
        marks.append(True)
        real(self, **kwargs)

    # Before the manager is built: the device manager hands its parts its bound calls at construction.
    monkeypatch.setattr(cls, "_begin_changes", spy)
    m = _admitted(make())
    called = set()
    for name, call in _good_calls(m):
        marks.clear()
        call()
        assert marks, f"{name} changed state without marking where"
        called.add(name)
    mutating = {name for name in dir(type(m)) if getattr(getattr(type(m), name), "mutates", False)}  # (inherited too)
    assert called == mutating  # every mutating method was called above


@pytest.mark.parametrize("make", [_reference, _device], ids=["ref", "dev"])
def test_a_fault_in_a_nested_call_stops_the_outer_one_too(make, monkeypatch):
    """The reference's decode runs its step: a fault inside the step is one of the decode."""
    m = _admitted(make())
    owner, target = (ReferenceRunning, "run_all") if isinstance(m, ReferenceManager) else (DecodePath, "launch")
    monkeypatch.setattr(owner, target, _raiser(InvalidInputError("injected", argument="x", fix="y")))
    with pytest.raises(InvalidInputError):
        m.decode([m.row_of("a")], [3])
    monkeypatch.undo()
    _assert_stopped(m, InvalidInputError)


# ------------------------------------------------------------------ threads
# Two threads on one manager, one sending good steps and one bad input, must
# neither stop it (a refusal on one thread taken for a fault: the
# point-of-first-change mark is per manager) nor crash the device manager's
# step accounting. A manager is used from one thread at a time: a call that
# comes while another thread's is under way is refused at once.


@pytest.mark.parametrize("make", [_device, _reference], ids=["device", "reference"])
def test_two_threads_on_one_manager_are_refused_never_stopped(make):
    import threading

    from gpukv.errors import ConcurrentCallError

    m = make()
    stop = threading.Event()
    outcomes: dict[str, list] = {"good": [], "bad": []}

    import time

    start = time.monotonic()

    def good():
        k = 0
        try:
            # (both threads get their turns: the reference is fast enough to end before the other starts)
            while k < 3 or (time.monotonic() - start < 3 and len(outcomes["bad"]) < 20):
                try:
                    # (a free refused leaves g{k} held, freed at the end; so a later one may not fit)
                    if m.step(new=[NewRequest(f"g{k}", PREFIX + [k])]).num_admitted:
                        m.step(finished=[f"g{k}"])
                    outcomes["good"].append("ok")
                except ConcurrentCallError:
                    outcomes["good"].append("busy")
                k += 1
        except Exception as e:  # (any other error is a fault: named by the check below)
            outcomes["good"].append(repr(e))
        finally:
            stop.set()  # (whatever happened here, the other thread stops)

    def bad():
        while not stop.is_set():
            try:
                m.step(new=[NewRequest("x", [-1])])
            except ConcurrentCallError:
                outcomes["bad"].append("busy")
            except InvalidInputError:
                outcomes["bad"].append("refused")

    threads = [threading.Thread(target=good), threading.Thread(target=bad)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert not m.failed, m.failure
    assert "ok" in outcomes["good"] and outcomes["bad"]
    assert set(outcomes["good"]) <= {"ok", "busy"}, outcomes["good"]
    assert set(outcomes["bad"]) <= {"busy", "refused"}  # (never a fault: refused at once, or refused its input)
    while True:  # (the last good step may have been refused before its free)
        try:
            held = m.request_ids()
            m.step(finished=held)
            break
        except ConcurrentCallError:  # pragma: no cover (both threads have ended)
            continue
    m.check_invariants()
    assert m.read_num_free_blocks() == m.num_blocks - 1


@pytest.mark.parametrize("make", [_device, _reference], ids=["device", "reference"])
def test_a_call_while_another_threads_call_is_under_way_is_refused_at_once(make):
    import threading

    from gpukv.errors import ConcurrentCallError

    m = make()
    m.step(new=[NewRequest("a", PREFIX)])
    inside, release = threading.Event(), threading.Event()
    real = type(m)._normalize

    def slow_normalize(self, *args, **kwargs):  # holds the first call inside the manager
        inside.set()
        release.wait(30)
        return real(self, *args, **kwargs)

    errors = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(type(m), "_normalize", slow_normalize)
        first = threading.Thread(target=lambda: m.step(finished=["a"]))
        first.start()
        assert inside.wait(30)
        for call in (lambda: m.step(), lambda: m.read_num_free_blocks(), lambda: m.get_block_ids("a"),
                     lambda: m.check_invariants()):
            with pytest.raises(ConcurrentCallError) as info:
                call()
            errors.append(info.value)
        release.set()
        first.join(30)
    assert all(isinstance(e, RuntimeError) and "one thread at a time" in str(e) for e in errors)
    assert not m.failed and m.request_ids() == []  # the first call went through, the others changed nothing
    m.check_invariants()
