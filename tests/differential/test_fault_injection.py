"""One fault at every fault site of a device-manager call.

A **fault site** is a point where a call can fail under the manager:

* every kernel launch: ``gpukv.kernels.capture.note_launch``, which every
  launch goes through: Triton's pre-run hook of each registered kernel (a
  launch the first time, and a launch replayed from ``preparing()``, since a
  replay calls Triton's ``run`` again, which runs the hooks), and the host
  stand-ins (``host_launch``, replayed too). A fault there is a launch that
  fails: the kernel never runs;
* every torch operation the call runs outside a kernel, allocations included
  (``aten.zeros``, ``aten.empty``, ``aten.copy_``, ``aten.cat``, views,
  ``aten._local_scalar_dense`` ...): a ``TorchDispatchMode`` sees each aten
  op. The operations Triton's interpreter runs while it executes a kernel on
  the host are left out (``capture.in_kernel()``, as ``StepCounters``'
  torch-op count does): on a GPU they are the kernel's own work on the
  device, not calls the host makes, and the launch site in front of them
  stands for a kernel that fails (so do the host stand-ins' own operations,
  as for the interpreter's host hashing). This keeps the sites those of the
  real host path and their count deterministic;
* every read of the device (the manager's ``_read``, which every read of a
  call goes through): where a GPU's asynchronous errors surface (on the CPU
  a read runs no torch op of its own).

For each call kind below (a fixed, tiny scenario each), the call is first run
once to list its sites; then, for every site n, the same scenario runs the call
with ``_Fault("injected at site n: ...")`` (a ``RuntimeError``) raised at site
n, and the call must end in one of:

1. a fault: the call raised the injected error, ``m.failed`` is True and the
   next call raises ``ManagerFailedError`` with the fault as its cause;
2. a refusal: the call raised a ``GpukvInputError``, the manager's whole
   state (``tests/differential/test_catalogue.state_of``: every tensor, every host
   structure) is as before, and a good call still works;
3. for a reading call (``block_table_for``: fail-stop lets reading calls
   raise without stopping, ``gpukv.core.failstop.reading``): the call raised the
   injected error, the manager runs on, and its state is the one a
   successful call leaves (a read changes only the staging buffers' turn
   and the upload count).

Cost: a device call takes up to a second under the interpreter, and there are
hundreds of sites. So each scenario is built once per process (the
*template*) and every injected run starts from a deep copy of it
(``_clone``: the Triton kernels are shared, the closures and numpy views of
prepared launches and host plans are copied as such), not from a rebuild;
``test_a_clone_behaves_as_a_rebuilt_scenario`` checks, per call kind, that
the call on a copy has the same sites, result and state after as on a
scenario built anew. The sites of each kind are spread over ``SHARDS``
tests so that xdist can run them side by side.

In CI every call kind runs; ``GPUKV_FAULTS_ALL=1`` adds the same kinds on
a manager with a sliding-window group beside full attention (the window
releases in steps and decodes: more launches).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gpukv import NewRequest, RunningUpdate
from gpukv.device.manager import DeviceManager
from gpukv.errors import GpukvInputError, ManagerFailedError
from gpukv.kernels import capture

from .test_catalogue import state_of

# Program order: this module's sites are the host's, which no program order
# changes; run its kernels in the interpreter's own order (the fastest).
OWN_PROGRAM_ORDER = True

#: Tests each call kind's sites are spread over (site n goes to shard n % SHARDS).
SHARDS = 3

ALL = os.environ.get("GPUKV_FAULTS_ALL") == "1"


class _Fault(RuntimeError):
    """The injected fault (gpukv never raises it)."""


# ------------------------------------------------------------------ injector

class Injector(TorchDispatchMode):
    """Lists the fault sites of what runs inside it (``sites``: one name a
    site, ``launch <kernel>``, ``torch <aten op>`` or ``read``), and raises ``_Fault``
    at site ``fail_at`` (never when None)."""

    def __init__(self, m: DeviceManager, fail_at: int | None = None) -> None:
        super().__init__()
        self.m = m
        self.fail_at = fail_at
        self.sites: list[str] = []
        self.fault: _Fault | None = None
        self._real_note_launch = capture.note_launch
        self._real_read = m._read

    def _site(self, name: str) -> None:
        n = len(self.sites)
        self.sites.append(name)
        if n == self.fail_at:
            self.fault = _Fault(f"injected at site {n}: {name}")
            raise self.fault

    def _note_launch(self, name: str, args: tuple = (), kwargs: dict | None = None) -> None:
        self._site(f"launch {name}")
        self._real_note_launch(name, args, kwargs)

    def __torch_dispatch__(self, func, tys, args=(), kwargs=None):
        if not capture.in_kernel():
            self._site(f"torch {func}")
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        # Every launch counts through the module's note_launch (the pre-run
        # hooks and host_launch look it up when they run); every read of the
        # device goes through the manager's _read (a read is where a GPU's
        # asynchronous errors surface; on the CPU it runs no torch op).
        real_read = self._real_read

        def read(t: torch.Tensor) -> list:
            self._site("read")
            return real_read(t)

        capture.note_launch = self._note_launch  # type: ignore[assignment]
        self.m._read = read
        try:
            return super().__enter__()
        except BaseException:
            self._restore()
            raise

    def __exit__(self, *exc: Any) -> None:
        self._restore()
        super().__exit__(*exc)

    def _restore(self) -> None:
        capture.note_launch = self._real_note_launch
        self.m._read = self._real_read


# ------------------------------------------------------------------ clones

def _copy_function(f: types.FunctionType, memo: dict) -> types.FunctionType:
    """A function with a closure (a host stand-in's replayable launch, a grid
    lambda) as a new one over copies of what it closes over; others as they are."""
    if not f.__closure__:
        return f
    cells = tuple(types.CellType(copy.deepcopy(c.cell_contents, memo)) for c in f.__closure__)
    g = types.FunctionType(f.__code__, f.__globals__, f.__name__, f.__defaults__, cells)
    g.__kwdefaults__ = f.__kwdefaults__
    g.__dict__.update(f.__dict__)
    return g


def _copy_array(a: np.ndarray, memo: dict) -> np.ndarray:
    """A numpy array, a view as a view of the copy of its base (a decode
    bucket's host plan is one packed array and named views of it, and the
    packed array a view of a staging tensor: ``Staging.host_array``)."""
    base = a.base
    if isinstance(base, torch.Tensor):  # host memory of a tensor: a view of the tensor's copy
        new_tensor = copy.deepcopy(base, memo)
        offset = a.__array_interface__["data"][0] - base.data_ptr()
        return np.ndarray(a.shape, a.dtype, buffer=new_tensor.numpy(), offset=offset, strides=a.strides)
    if not isinstance(base, np.ndarray) or (base.base is not None and not isinstance(base.base, torch.Tensor)):
        return a.copy(order="K")
    new_base = copy.deepcopy(base, memo)
    assert new_base.strides == base.strides
    offset = a.__array_interface__["data"][0] - base.__array_interface__["data"][0]
    return np.ndarray(a.shape, a.dtype, buffer=new_base, offset=offset, strides=a.strides)


def _clone(m: DeviceManager) -> DeviceManager:
    """A deep copy of ``m`` that goes on as ``m`` would: its own tensors (views
    still views of its own storages), host arrays and prepared launches; the
    Triton kernels shared (stateless here), and on a GPU its stream and the
    events of its staging buffers (a copy waits on the same finished work)."""
    dispatch = copy._deepcopy_dispatch  # type: ignore[attr-defined]
    patched = {types.FunctionType: _copy_function, np.ndarray: _copy_array}
    # Shared, not copied: the Triton kernels, and on a GPU the manager's stream and the staging's events.
    shared = [*capture.triton_function_classes(), torch.cuda.Stream, torch.cuda.Event]
    patched.update({cls: copy._deepcopy_atomic for cls in shared})  # type: ignore[attr-defined]
    saved = {cls: dispatch.get(cls) for cls in patched}
    dispatch.update(patched)
    try:
        return copy.deepcopy(m)
    finally:
        for cls, was in saved.items():
            if was is None:
                del dispatch[cls]
            else:
                dispatch[cls] = was


# ------------------------------------------------------------------ scenarios

A = [1, 2, 3, 4, 5]
B = [1, 2, 3, 4, 6, 7]  # shares A's two full blocks (a pending hit in the same step)
C = [1, 2, 3, 4, 8]  # A's length, and its two full blocks: a hit once A's are cached
D = [1, 2, 3, 4, 6, 9]  # B's length, hits B's two full blocks


def _fresh(layout: str) -> DeviceManager:
    windows = [None] if layout == "full" else [None, 4]
    return DeviceManager(10, 2, sliding_windows=windows, hash_key=bytes(16), max_model_len=16, max_num_reqs=4)


def _admit_ab(m: DeviceManager) -> dict:
    assert m.step(new=[NewRequest("a", A), NewRequest("b", B)]).num_admitted == 2
    return {}


def _cached_ab(m: DeviceManager) -> dict:
    _admit_ab(m)
    m.step(finished=["a", "b"])
    return {}


def _admit_ab_bound_short(m: DeviceManager) -> dict:
    """a and b running, with the host's lower bound of free blocks too low
    for a decode to know that it fits, so that the decode reads: with full
    attention, a third request took the pool's last blocks and a step that
    reads nothing gave them back; beside a window group, a and b leave one
    block free, which the bound does not cover already."""
    if m.num_groups > 1:
        return _admit_ab(m)
    new = [NewRequest("a", A), NewRequest("b", B), NewRequest("c", list(range(20, 30)))]
    assert m.step(new=new).num_admitted == 3
    m.step(finished=["c"])
    return {}


def _decoded_once(m: DeviceManager) -> dict:
    _admit_ab(m)
    assert m.decode([m.row_of("a"), m.row_of("b")], [[9], [9]]).ok
    return {}


def _admit_a(m: DeviceManager) -> dict:
    assert m.step(new=[NewRequest("a", A)]).num_admitted == 1
    return {}


def _looked_up(m: DeviceManager) -> dict:
    _admit_a(m)
    computed = m.get_computed_blocks(NewRequest("c", C))
    assert computed.num_tokens == 4
    return {"computed": computed}


def _cached_a(m: DeviceManager) -> dict:
    _admit_a(m)
    m.step(finished=["a"])
    return {}


def _no_setup(_m: DeviceManager) -> dict:
    return {}


@dataclass(frozen=True)
class Kind:
    """A call kind: the scenario it runs on, the call, and what it checks."""

    setup: Callable[[DeviceManager], dict]
    call: Callable[[DeviceManager, dict], Any]
    reading: bool = False  # a reading call (outcome 3 of the module docstring)
    replays: tuple[str, ...] = ()  # buffers whose prepared launches the call must replay, not prepare
    must_read: bool = False  # whether the call must read the device (its scenario is built for it)


KINDS = {
    # The first step of a bucket: buffers created, launches run and prepared.
    "step-admit-first": Kind(_no_setup, lambda m, _: m.step(new=[NewRequest("a", A), NewRequest("b", B)])),
    # A later step of the same bucket: the prepared launches replayed, with hits.
    "step-admit-replay": Kind(_cached_ab, lambda m, _: m.step(new=[NewRequest("c", C), NewRequest("d", D)]),
                              replays=("admission",)),
    # A running update that needs a new block and caches full ones, and a finish.
    "step-running-finish": Kind(_admit_ab,
                                lambda m, _: m.step(finished=["b"], running=[RunningUpdate("a", [9, 9, 9])])),
    # The first decode of a bucket, which also reads (the host cannot tell that it fits).
    "decode-first": Kind(_admit_ab_bound_short, lambda m, _: m.decode([m.row_of("a"), m.row_of("b")], [[9], [9]]),
                         must_read=True),
    # A later decode of the bucket: the prepared launches replayed (no read: the host knows it fits).
    "decode-replay": Kind(_decoded_once, lambda m, _: m.decode([m.row_of("a"), m.row_of("b")], [[8], [8]]),
                          replays=("decode",)),
    # A new request with the hit get_computed_blocks found (the dry lookup, then the step).
    "allocate_slots": Kind(_looked_up, lambda m, ctx: m.allocate_slots(NewRequest("c", C), computed=ctx["computed"])),
    "get_computed_blocks": Kind(_admit_a, lambda m, _: m.get_computed_blocks(NewRequest("c", C))),
    "free": Kind(_admit_ab, lambda m, _: m.free("a")),
    "reset_prefix_cache": Kind(_cached_a, lambda m, _: m.reset_prefix_cache()),
    "block_table_for": Kind(_admit_ab, lambda m, _: m.block_table_for(["a", "b"]), reading=True),
}

LAYOUTS = ["full", "window"] if ALL else ["full"]


def _prepared(m: DeviceManager, what: str) -> dict:
    """id of each prepared launch list (of ``what``'s buffers) by (bucket, part)."""
    bufs = m._decode.buffers if what == "decode" else m._admission.buffers
    return {(b, part): id(kept[1]) for b, buf in bufs.items() for part, kept in buf.prepared.items()}


@dataclass
class Template:
    manager: DeviceManager
    ctx: dict
    sites: list[str]  # the call's fault sites, in order
    launches: int  # the call's kernel launches (``capture.launches()``)
    result: Any  # what the call returned
    after: Any  # state_of the manager after the call


def _run(kind: Kind, m: DeviceManager, ctx: dict) -> tuple[Injector, Any, int]:
    injector = Injector(m)
    base = capture.launches()
    with injector:
        result = kind.call(m, ctx)
    return injector, result, capture.launches() - base


@functools.cache
def _template(name: str, layout: str) -> Template:
    """The scenario of call kind ``name`` (built once per process) and one
    clean run of the call on a copy of it."""
    kind = KINDS[name]
    m = _fresh(layout)
    ctx = kind.setup(m)
    m.check_invariants()
    probe = _clone(m)
    before = {what: _prepared(probe, what) for what in kind.replays}
    injector, result, launches = _run(kind, probe, ctx)
    assert "read" in injector.sites or not kind.must_read, f"{name}: the call did not read the device"
    for what, kept in before.items():
        assert kept, f"{name}: the scenario prepared no {what} launches"
        assert _prepared(probe, what) == kept, f"{name}: the call prepared its {what} launches anew, no replay"
    return Template(m, ctx, injector.sites, launches, result, _state(probe))


def _state(m: DeviceManager) -> Any:
    """``state_of(m)`` but for the bytes of the staging buffers (uninitialised
    memory on the CPU, where uploads do not go through them) and the free
    count mirror's tally of the reads it answered (a count of calls, not
    state: the template's preparation asks the free count once more): a
    clone and a rebuilt scenario differ there."""
    staging, mirror = m._staging, m._mirror
    bufs, reads = staging._bufs, mirror.reads
    staging._bufs = [("buffer", str(b.dtype), tuple(b.shape)) for b in bufs]  # type: ignore[misc]
    mirror.reads = 0
    try:
        return state_of(m)
    finally:
        staging._bufs, mirror.reads = bufs, reads


def _chain(exc: BaseException | None) -> Iterator[BaseException]:
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


# ------------------------------------------------------------------ the tests

@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", list(KINDS))
def test_a_clone_behaves_as_a_rebuilt_scenario(name, layout):
    """The injected runs start from copies of one scenario: a copy must run
    the call as a scenario built anew does (the same sites in the same order,
    result and state after), and leave the scenario it was copied from alone."""
    kind, t = KINDS[name], _template(name, layout)
    template_state = _state(t.manager)
    m = _fresh(layout)
    ctx = kind.setup(m)
    injector, result, launches = _run(kind, m, ctx)
    assert injector.sites == t.sites
    assert launches == t.launches
    assert repr(result) == repr(t.result)
    assert _state(m) == t.after
    assert _state(t.manager) == template_state
    # Every launch of the call is a site (replayed ones too), and so is every torch op outside kernels.
    assert sum(s.startswith("launch ") for s in t.sites) == t.launches
    if name != "block_table_for":
        assert t.launches > 0
    assert any(s.startswith("torch ") for s in t.sites)
    m.check_invariants()


def _good_call(m: DeviceManager) -> None:
    """A call that must still work after a refusal (or a reading call's fault)."""
    assert m.free_queue() is not None
    res = m.step(finished=m.request_ids(), new=[NewRequest("z", [7, 7, 7])])
    assert res.num_admitted == 1
    m.check_invariants()


def _inject(name: str, layout: str, n: int) -> str:
    """Run call kind ``name`` with a fault at site ``n``; its outcome (the
    module docstring's 1, 2 or 3) as "fault", "refusal" or "read", or fail."""
    kind, t = KINDS[name], _template(name, layout)
    m = _clone(t.manager)
    before = _state(m)
    injector = Injector(m, fail_at=n)
    where = f"{name} ({layout}), site {n} of {len(t.sites)}: {t.sites[n]}"
    try:
        with injector:
            kind.call(m, t.ctx)
    except BaseException as exc:  # noqa: BLE001 - every outcome is judged below
        raised: BaseException = exc
    else:
        assert injector.fault is not None, f"{where}: not reached (the sites are not deterministic)"
        pytest.fail(f"{where}: the call swallowed the fault and returned (failed={m.failed})")
    assert injector.fault is not None, f"{where}: the call raised before the site: {raised!r}"
    if m.failed:  # 1. a fault
        assert raised is injector.fault, f"{where}: raised {raised!r} instead of the fault"
        with pytest.raises(ManagerFailedError) as info:
            m.free_queue()
        assert info.value.__cause__ is injector.fault, where
        with pytest.raises(ManagerFailedError):
            m.step()
        return "fault"
    if isinstance(raised, GpukvInputError):  # 2. a refusal
        assert _state(m) == before, f"{where}: refused ({raised!r}) but the state changed"
        _good_call(m)
        return "refusal"
    if kind.reading:  # 3. a reading call's fault
        assert raised is injector.fault, f"{where}: raised {raised!r} instead of the fault"
        assert _state(m) == t.after, f"{where}: a read that failed changed the state"
        _good_call(m)
        return "read"
    chain = " <- ".join(repr(e) for e in _chain(raised))
    pytest.fail(f"{where}: raised {chain}, but the manager neither stopped nor refused")


@pytest.mark.parametrize("shard", range(SHARDS))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", list(KINDS))
def test_a_fault_at_any_site_stops_the_manager_or_is_refused(name, layout, shard):
    t = _template(name, layout)
    for n in range(shard, len(t.sites), SHARDS):
        _inject(name, layout, n)


def test_the_harness_catches_a_swallowed_fault_and_a_refusal_that_changed_state(monkeypatch):
    """The checks above are not vacuous: a ``free`` that swallows the fault,
    or one that turns it into an input error after changing state, fails them."""
    from gpukv.errors import InvalidInputError

    body = DeviceManager.free.__wrapped__  # type: ignore[attr-defined]  # (undecorated: no fail-stop around it)
    n = _template("free", "full").sites.index("launch blocks._release_dec_kernel")

    def swallowing(self, request_id):
        with contextlib.suppress(_Fault):
            body(self, request_id)

    monkeypatch.setattr(DeviceManager, "free", swallowing)
    with pytest.raises(pytest.fail.Exception, match="swallowed the fault"):
        _inject("free", "full", n)

    def refusing(self, request_id):
        try:
            body(self, request_id)
        except _Fault as e:
            raise InvalidInputError("injected", argument="request_id", fix="none") from e

    monkeypatch.setattr(DeviceManager, "free", refusing)
    with pytest.raises(AssertionError, match="refused .* but the state changed"):
        _inject("free", "full", n)
