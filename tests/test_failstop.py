"""Fail-stop: a fault inside a call stops the manager; input errors do not.

Every Triton kernel the device manager launches is, in turn, replaced by one
that raises when launched; the call that launches it must raise that fault,
and from then on every call must raise ``ManagerFailedError`` naming it
(instead of running on a half-applied step). The reference stops the same
way when its pool fails under it.
"""

from __future__ import annotations

import importlib

import pytest

from gpukv import NewRequest, RunningUpdate
from gpukv import manager as manager_module
from gpukv.errors import InvalidInputError, ManagerFailedError, UnknownRequestError
from gpukv.kernels import _aot, block_hash
from gpukv.manager import KVCacheManager as DeviceManager
from gpukv.reference import KVCacheManager as ReferenceManager

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
    m.step(running=[RunningUpdate("a", [5, 6]), RunningUpdate("b", [7])])
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
    monkeypatch.setattr(manager_module, "_hash_rows", block_hash.hash_rows)


def _device() -> DeviceManager:
    return DeviceManager(12, 4, hash_key=bytes(16), max_model_len=64, max_num_reqs=4)


# Kernels no manager step launches: the slot mapping (the serving loop's),
# byte hashing (test vectors), the batch chain hasher (the manager hashes rows
# in place), compaction (only when the free-queue ring wraps), and the
# table's find and the lookup's verify (public building blocks: the
# admission probes and verifies inside ``prefill._lookup_kernel``).
NOT_LAUNCHED = {"block_hash._blake3_bytes_kernel", "block_hash._hash_block_chains_kernel", "free_queue._compact_kernel",
                "slot_mapping._slot_mapping_kernel", "hash_table._find_kernel", "lookup._verify_kernel"}


def _kernels():
    kernels, _, _ = _aot.discover()
    return sorted(kernels.items())


def _launched_kernels():
    return [name for name, _ in _kernels() if name not in NOT_LAUNCHED]


def _assert_stopped(m, fault_type: type[BaseException]) -> None:
    assert m.failed
    calls = [
        lambda: m.step(),
        lambda: m.step(new=[NewRequest("z", [1, 2, 3])]),
        lambda: m.free("a"),
        lambda: m.get_block_ids("a"),
        lambda: m.get_computed_blocks(NewRequest("y", [1])),
        lambda: m.reset_prefix_cache(),
        lambda: m.make_prefix_cache_stats(),
    ]
    for call in calls:
        with pytest.raises(ManagerFailedError, match="stopped after a fault") as info:
            call()
        assert isinstance(info.value.__cause__, fault_type)
        assert type(info.value.__cause__).__name__ in str(info.value)


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
