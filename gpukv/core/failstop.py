"""Fail-stop for the managers: a refused call changes nothing; after a fault, every later call is refused.

Every call that may change state marks its **point of first change**
(``FailStop._begin_changes()``): before it, the call only reads and checks its
arguments; from it on, it changes the manager. What a call raises is then
one of two things:

* a **refusal**: a :class:`gpukv.errors.GpukvInputError` (or a warning turned
  into an error by ``-W error``) raised *before* the mark. The manager is as
  it was and goes on. A call mistake Python itself reports (a wrong
  signature: an unknown keyword, a missing or extra argument) is made a
  refusal too, as an :class:`gpukv.errors.InvalidTypeError` naming the
  argument (``__cause__`` is Python's ``TypeError``);
* a **fault**: anything raised *after* the mark, whatever its class (an input
  error class or a warning included: the step may be half applied by then),
  and anything but a refusal before it (a bug in the checks, a kernel that
  fails to launch, a CUDA error, an out-of-memory, a ``KeyboardInterrupt``).
  Running on from a half-applied step would hand out wrong blocks, so the
  manager records the fault and every later call raises
  :class:`gpukv.errors.ManagerFailedError` naming it. The only way on is a
  new manager (the KV cache it managed is lost with it, as after a crashed
  engine).

A call that nests another (the reference's ``decode`` runs its ``step``)
has changed state once the inner call has.

One thread at a time: every call first takes the manager's call lock (an
``RLock``, so a call nested in another of the same thread goes on) without
waiting; a call from a second thread while one is under way is refused at
once with :class:`gpukv.errors.ConcurrentCallError`, before it reads or
changes anything, and stops nothing; so is a call made from a caller's hook
that a call runs (a ``graphs`` object's launch: the step is half way there).
Reads and diagnostics are calls too:
after a fault, every call, reads, properties and ``check_invariants``
included, raises ``ManagerFailedError``; only ``failed`` and ``failure``
(what stopped it) still answer, with a manager's configuration
(``num_blocks``, ``block_size``, ``limits``, ``hash_key``).

Every call also runs between ``_enter_stream()`` and ``_leave_stream()``:
nothing for the reference; the device manager orders a call made on another
CUDA stream than its own after the caller's work and runs it on its own
stream (``gpukv.device.manager.DeviceManager``, "Streams").
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from gpukv.errors import ConcurrentCallError, GpukvInputError, InvalidTypeError, ManagerFailedError

F = TypeVar("F", bound=Callable[..., Any])


class FailStop:
    """Mixin: the fault slot, the point-of-first-change mark, and the check
    every public call makes first."""

    _fault: BaseException | None = None
    #: Whether the running call passed its point of first change (``_begin_changes``).
    _changing: bool = False
    #: Whether the running call is inside a caller's hook (``_hook``).
    _in_hook: bool = False

    @property
    def failed(self) -> bool:
        """Whether a call failed part-way and the manager refuses all calls since."""
        return self._fault is not None

    @property
    def failure(self) -> BaseException | None:
        """What stopped the manager (the fault a call raised), or None: the one
        diagnostic that answers after a fault."""
        return self._fault

    def __getstate__(self) -> dict[str, Any]:
        """A copy (``copy.deepcopy``, a pickle) leaves the call lock out: a
        lock cannot be copied, and the copy is another manager that makes its
        own on its first call."""
        state = self.__dict__.copy()
        state.pop("_call_lock", None)
        return state

    def _enter_call(self, name: str) -> threading.RLock:
        """Take the call lock without waiting (a call nested in one of this
        thread goes on); a call under way on another thread: refused."""
        lock = self.__dict__.get("_call_lock")
        if lock is None:  # (setdefault: one lock, whichever thread makes it first)
            lock = self.__dict__.setdefault("_call_lock", threading.RLock())
        if not lock.acquire(blocking=False):
            raise ConcurrentCallError(f"another thread's call of this {type(self).__name__} is under way",
                                      argument=name, fix="call a manager from one thread at a time (hold a lock "
                                                         "around its calls), or give each thread its own manager")
        if self._in_hook:
            lock.release()
            raise ConcurrentCallError(f"a call of this {type(self).__name__} is under way, and this one comes from "
                                      "the hook it runs (its graphs)", argument=name,
                                      fix="call the manager after the call that runs the hook returns")
        return lock

    def _hook(self) -> _InHook:
        """A context for running a caller's code inside a call (a
        ``graphs`` object's ``launch`` or ``run``): the manager's own calls
        made from it are refused, as another thread's are (the state is
        mid-step there: a decode staged and not launched)."""
        return _InHook(self._mark_hook)

    def _mark_hook(self, inside: bool) -> None:
        """Enter (``inside``) or leave a caller's hook (``_InHook``)."""
        self._in_hook = inside

    def _begin_changes(self) -> None:
        """Mark the running call's point of first change: its arguments are
        checked, and anything raised from here on is a fault."""
        self._changing = True

    def _after_call(self) -> None:
        """Run after every call that may change state, once it succeeded (a
        manager closes its batch of KV-cache events here)."""

    def _enter_stream(self) -> Any:
        """Run before every call's body: what ``_leave_stream`` needs to undo,
        or None when there is nothing to undo (the common case, kept cheap)."""
        return None

    def _leave_stream(self, entered: Any, out: Any) -> None:
        """Run after a call's body (raised or not) when ``_enter_stream``
        returned ``entered``; ``out``: what the call returned (None if it raised)."""

    def _raise_if_failed(self) -> None:
        fault = self._fault
        if fault is not None:
            raise ManagerFailedError(
                f"this {type(self).__name__} stopped after a fault inside an earlier call "
                f"({type(fault).__name__}: {fault}); its state may be half updated, so it refuses every call. "
                "Build a new manager (the cached KV is lost with it)."
            ) from fault


class _InHook:
    """``FailStop._hook``'s context (a plain class: it wraps every graph replay)."""

    __slots__ = ("mark",)

    def __init__(self, mark: Callable[[bool], None]) -> None:
        self.mark = mark  # (the manager's ``_mark_hook``)

    def __enter__(self) -> None:
        self.mark(True)

    def __exit__(self, *exc: Any) -> None:
        self.mark(False)


def _is_call_mistake(exc: BaseException) -> bool:
    """Whether ``exc`` is Python's ``TypeError`` for a call that does not fit
    the method's signature: raised while binding the arguments, before the
    method's own frame exists (its traceback ends in the wrapper's frame)."""
    tb = exc.__traceback__
    return type(exc) is TypeError and tb is not None and tb.tb_next is None


_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
_EMPTY = inspect.Parameter.empty


def _public_signature(method: Callable[..., Any]) -> inspect.Signature:
    """The signature a caller is told to use: the one ``gpukv.core.protocol.BlockManager``
    declares when the method is part of it (so both managers say the same;
    the device's extra ``graphs=`` stays out), else the method's own."""
    from gpukv.core.protocol import BlockManager  # (gpukv.core.protocol imports what imports this module)

    declared = BlockManager.__dict__.get(method.__name__)
    return inspect.signature(declared if callable(declared) else method)


def _signature_text(name: str, params: list[inspect.Parameter]) -> str:
    """``name(a, b=(), *, c=None)``: the parameters with their defaults."""
    parts, star = [], False
    for p in params:
        if p.kind is inspect.Parameter.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        parts.append(p.name if p.default is _EMPTY else f"{p.name}={p.default!r}")
    return f"{name}({', '.join(parts)})"


def _mistake(name: str, params: list[inspect.Parameter], args: tuple, kwargs: dict) -> tuple[str, str]:
    """(argument, problem) of a call that does not fit ``params``, in the
    order Python checks them: too many positional arguments, one given
    twice or unknown, one missing."""
    kinds = {p.kind for p in params}
    positional = [p for p in params if p.kind in _POSITIONAL]
    by_position = {p.name for p in positional[: len(args)]}
    names = {p.name for p in params if p.kind not in _VARIADIC and p.kind is not inspect.Parameter.POSITIONAL_ONLY}
    if len(args) > len(positional) and inspect.Parameter.VAR_POSITIONAL not in kinds:
        most = {0: "no positional argument", 1: "1 positional argument"}.get(len(positional),
                                                                         f"{len(positional)} positional arguments")
        return name, f"{name}() takes {most}, got {len(args)}"
    for key in kwargs:
        if key in by_position:
            return key, f"{name}() got {key!r} twice, by position and by keyword"
        if key not in names and inspect.Parameter.VAR_KEYWORD not in kinds:
            return key, f"{name}() has no argument {key!r}"
    for p in params:
        if p.default is _EMPTY and p.kind not in _VARIADIC and p.name not in by_position | set(kwargs):
            return p.name, f"{name}() needs {p.name!r}, which was not given"
    return name, f"{name}() was called with arguments it does not take"


def _call_mistake(method: Callable[..., Any], args: tuple, kwargs: dict) -> InvalidTypeError:
    """A call that does not fit the method's signature (Python's
    ``TypeError``, kept as ``__cause__``) as an ``InvalidTypeError`` in
    gpukv's own words: the argument at fault (the method's name when no one
    argument is, e.g. too many positional arguments), what is wrong, and the
    signature to call; the same text for both managers."""
    name = method.__name__
    own = list(inspect.signature(method).parameters.values())[1:]  # without self
    argument, problem = _mistake(name, own, args, kwargs)
    public = list(_public_signature(method).parameters.values())[1:]
    return InvalidTypeError(problem, argument=argument,
                            fix=f"call {_signature_text(name, public)} (see its docstring)")


def mutating(method: F) -> F:
    """A call that may change state: refused after a fault; what it raises
    before its point of first change is a refusal if it is an input error
    (a wrong signature made one), anything else a fault that stops the
    manager (the module docstring)."""

    @functools.wraps(method)
    def call(self: FailStop, *args: Any, **kwargs: Any) -> Any:
        lock = self._enter_call(method.__name__)
        try:
            return _mutating_call(self, method, args, kwargs)
        finally:
            lock.release()

    call.mutates = True  # type: ignore[attr-defined]  # (tests find the mutating calls by it)
    return call  # type: ignore[return-value]


def _mutating_call(self: FailStop, method: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """``mutating``'s body, with the call lock held."""
    self._raise_if_failed()
    outer = self._changing
    self._changing = False
    entered = out = None
    try:
        entered = self._enter_stream()
        out = method(self, *args, **kwargs)
        self._changing = True  # closing the call's event batch is a change
        self._after_call()
        return out
    except BaseException as exc:
        out = None
        if self._fault is not None:  # a nested call stopped the manager already
            raise
        if not self._changing:
            if isinstance(exc, (GpukvInputError, Warning)):
                raise  # refused before anything changed
            if _is_call_mistake(exc):
                raise _call_mistake(method, args, kwargs) from exc  # type: ignore[arg-type]
        self._fault = exc
        raise
    finally:
        self._changing = outer or self._changing
        if entered is not None:
            self._leave_stream(entered, out)


def reading(method: F) -> F:
    """A call that only reads: refused after a fault (the state it would read
    may be half updated), harmless otherwise; a wrong signature is an
    ``InvalidTypeError``, as for ``mutating`` calls."""

    @functools.wraps(method)
    def call(self: FailStop, *args: Any, **kwargs: Any) -> Any:
        lock = self._enter_call(method.__name__)
        try:
            self._raise_if_failed()
            entered = self._enter_stream()
            out = None
            try:
                out = method(self, *args, **kwargs)
                return out
            except TypeError as exc:
                out = None
                if _is_call_mistake(exc):
                    raise _call_mistake(method, args, kwargs) from exc
                raise
            finally:
                if entered is not None:
                    self._leave_stream(entered, out)
        finally:
            lock.release()

    call.mutates = False  # type: ignore[attr-defined]
    return call  # type: ignore[return-value]
