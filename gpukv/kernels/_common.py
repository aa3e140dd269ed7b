"""What every kernel module shares: launch counting and launch recording.

Every ``*_kernel`` of ``gpukv/kernels/`` is registered here
(``count_launches(globals())`` at the end of its module), so launches are
counted where they happen, by Triton's own pre-run hook, not by hand in the
callers. ``launches()`` is the running total; ``recording()`` additionally
lists each launch as ``(kernel, argument signature)`` (tensors as shape and
dtype, other arguments as values): the CUDA-graph test holds that list fixed
across decode steps of one batch bucket.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator

import torch

from gpukv import _runtime

_total = [0]
_recorders: list[list] = []
_in_kernel = [0]
_kernel_seconds = [0.0]


def kernel_seconds() -> float:
    """Host seconds spent inside kernels run on the host (the interpreter's
    launches and host stand-ins), so benchmarks can take them out of a
    step's host time. Always 0 with compiled kernels on a GPU."""
    return _kernel_seconds[0]


def in_kernel() -> bool:
    """Whether a kernel (or its host stand-in) is running now."""
    return _in_kernel[0] > 0


@contextlib.contextmanager
def kernel_running() -> Iterator[None]:
    """Mark a stretch as kernel work (host stand-ins for kernels use it)."""
    _in_kernel[0] += 1
    start = time.perf_counter() if _in_kernel[0] == 1 else None
    try:
        yield
    finally:
        _in_kernel[0] -= 1
        if start is not None:
            _kernel_seconds[0] += time.perf_counter() - start


def _mark_interpreted_runs() -> None:
    """Under Triton's interpreter a launch runs the kernel on the host through
    torch and numpy; mark it, so counters and timers can leave it out."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover (no interpreter in this Triton)
        return
    if getattr(InterpretedFunction.run, "_gpukv_marked", False):
        return
    run = InterpretedFunction.run

    def marked(self, *args, **kwargs):
        with kernel_running():
            return run(self, *args, **kwargs)

    marked._gpukv_marked = True
    InterpretedFunction.run = marked


def launches() -> int:
    """Triton kernel launches since the process started."""
    return _total[0]


def _signature(args: tuple, kwargs: dict) -> tuple:
    def one(a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            return ("tensor", tuple(a.shape), str(a.dtype))
        return a
    return tuple(one(a) for a in args) + tuple((k, one(v)) for k, v in sorted(kwargs.items()))


def note_launch(name: str, args: tuple = (), kwargs: dict | None = None) -> None:
    """Count (and record) one launch; also called by host stand-ins for a
    kernel (the interpreter's host hashing) so a recording stays the same."""
    _total[0] += 1
    if _recorders:
        sig = _signature(args, kwargs or {})
        for rec in _recorders:
            rec.append((name, sig))


def _hook_for(name: str):
    def hook(*args: Any, **kwargs: Any) -> None:
        note_launch(name, args, kwargs)
    return hook


def count_launches(namespace: dict) -> None:
    """Register every ``_*_kernel`` Triton function of a module's globals."""
    if _runtime.INTERPRETED:
        _mark_interpreted_runs()
    for name, obj in namespace.items():
        if name.endswith("_kernel") and hasattr(obj, "add_pre_run_hook"):
            if not getattr(obj, "_gpukv_counted", False):
                obj.add_pre_run_hook(_hook_for(f"{namespace['__name__'].rsplit('.', 1)[-1]}.{name}"))
                obj._gpukv_counted = True


@contextlib.contextmanager
def recording() -> Iterator[list]:
    """Yield a list that fills with ``(kernel, signature)`` per launch."""
    rec: list = []
    _recorders.append(rec)
    try:
        yield rec
    finally:
        _recorders.remove(rec)
