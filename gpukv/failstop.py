"""Fail-stop for the managers: after a fault inside a call, refuse every later call.

A manager checks every argument before it changes anything, so an input error
(a :class:`gpukv.errors.GpukvInputError`) leaves it as it was and it goes on.
Anything else raised inside a call that changes state (a kernel that fails to
launch, a CUDA error, an out-of-memory, a bug, a ``KeyboardInterrupt``) may
leave a step half applied: some blocks popped, some tables written. Running on
from such a state would hand out wrong blocks, so the manager records the
fault and every later call raises :class:`gpukv.errors.ManagerFailedError`
naming it. The only way on is a new manager (the KV cache it managed is lost
with it, as after a crashed engine).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from gpukv.errors import GpukvInputError, ManagerFailedError

F = TypeVar("F", bound=Callable[..., Any])


class FailStop:
    """Mixin: the fault slot and the check every public call makes first."""

    _fault: BaseException | None = None

    @property
    def failed(self) -> bool:
        """Whether a call failed part-way and the manager refuses all calls since."""
        return self._fault is not None

    def _after_call(self) -> None:
        """Run after every call that may change state, once it succeeded (a
        manager closes its batch of KV-cache events here)."""

    def _raise_if_failed(self) -> None:
        fault = self._fault
        if fault is not None:
            raise ManagerFailedError(
                f"this {type(self).__name__} stopped after a fault inside an earlier call "
                f"({type(fault).__name__}: {fault}); its state may be half updated, so it refuses every call. "
                "Build a new manager (the cached KV is lost with it)."
            ) from fault


def mutating(method: F) -> F:
    """A call that may change state: refused after a fault, and a fault inside
    it (anything but an input error, raised before any change) stops the manager."""

    @functools.wraps(method)
    def call(self: FailStop, *args: Any, **kwargs: Any) -> Any:
        self._raise_if_failed()
        try:
            out = method(self, *args, **kwargs)
            self._after_call()
            return out
        except (GpukvInputError, Warning):
            # Refused before anything changed (a warning turned into an error
            # by ``-W error`` is raised while the arguments are checked, too).
            raise
        except BaseException as exc:
            self._fault = exc
            raise

    return call  # type: ignore[return-value]


def reading(method: F) -> F:
    """A call that only reads: refused after a fault (the state it would read
    may be half updated), harmless otherwise."""

    @functools.wraps(method)
    def call(self: FailStop, *args: Any, **kwargs: Any) -> Any:
        self._raise_if_failed()
        return method(self, *args, **kwargs)

    return call  # type: ignore[return-value]
