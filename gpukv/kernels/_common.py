"""What every kernel module shares: launch counting, launch recording, and
prepared launches.

Every ``*_kernel`` of ``gpukv/kernels/`` is registered here
(``count_launches(globals())`` at the end of its module), so launches are
counted where they happen, by Triton's own pre-run hook, not by hand in the
callers. ``launches()`` is the running total; ``recording()`` additionally
lists each launch as ``(kernel, argument signature)`` (tensors as shape and
dtype, other arguments as values): the CUDA-graph test holds that list fixed
across decode steps of one batch bucket.

``preparing()`` runs launches as usual and keeps each as a callable that
repeats it with the same arguments (Triton's ``run`` with the bound
arguments, or a host stand-in). A launch sequence whose arguments are fixed
buffers (the device manager's decode step, per bucket) is prepared once and
then replayed without running the launchers' Python (checks, views, sizes)
again: FlashInfer's plan/run split, and on the CPU what a CUDA graph does on
the GPU.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any
from collections.abc import Iterator

import torch

from gpukv import _runtime

_total = [0]
_recorders: list[list] = []
_preparing: list[list] = []
_skipping = [False]
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


class _KernelRunning:
    """Marks a stretch as kernel work (``kernel_running``); a plain class,
    not a generator, because it wraps every interpreted launch and its own
    cost would otherwise show up as host time in the benchmarks."""

    __slots__ = ("start",)

    def __enter__(self) -> None:
        _in_kernel[0] += 1
        self.start = time.perf_counter() if _in_kernel[0] == 1 else None

    def __exit__(self, *exc: Any) -> None:
        _in_kernel[0] -= 1
        if self.start is not None:
            _kernel_seconds[0] += time.perf_counter() - self.start


def kernel_running() -> _KernelRunning:
    """Mark a stretch as kernel work (host stand-ins for kernels use it)."""
    return _KernelRunning()


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
        _in_kernel[0] += 1
        start = time.perf_counter()
        try:
            return run(self, *args, **kwargs)
        finally:
            _in_kernel[0] -= 1
            if _in_kernel[0] == 0:
                _kernel_seconds[0] += time.perf_counter() - start

    marked.__dict__["_gpukv_marked"] = True  # (a mark on the function: installed once)
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


def _install_prepare_hook() -> None:
    """Wrap Triton's ``run`` (compiled and interpreted) once, so that while
    ``preparing()`` is active each launch is kept as a callable."""
    import functools

    from triton.runtime.jit import JITFunction
    classes = [JITFunction]
    try:
        from triton.runtime.interpreter import InterpretedFunction
        classes.append(InterpretedFunction)
    except ImportError:  # pragma: no cover
        pass
    for cls in classes:
        if getattr(cls.run, "_gpukv_prepare", False):
            continue
        run = cls.run

        def keeping(self, *args, _run=run, **kwargs):
            if _preparing:
                for prepared in _preparing:
                    prepared.append(functools.partial(_run, self, *args, **kwargs))
            return _run(self, *args, **kwargs)

        keeping.__dict__["_gpukv_prepare"] = True
        keeping.__dict__["_gpukv_marked"] = getattr(run, "_gpukv_marked", False)
        cls.run = keeping


@contextlib.contextmanager
def preparing() -> Iterator[list]:
    """Yield a list that fills with one replayable callable per launch."""
    _install_prepare_hook()
    prepared: list = []
    _preparing.append(prepared)
    try:
        yield prepared
    finally:
        _preparing.remove(prepared)


def host_launch(name: str, fn, *args: Any, **kwargs: Any) -> None:
    """Run a host stand-in for a kernel (the interpreter's host hashing):
    counted, timed and prepared as the launch it stands for."""
    def launch() -> None:
        note_launch(name)
        if not _skipping[0]:
            with kernel_running():
                fn(*args, **kwargs)

    for prepared in _preparing:
        prepared.append(launch)
    launch()


@contextlib.contextmanager
def kernel_bodies_skipped() -> Iterator[None]:
    """Under Triton's interpreter only, for benchmarks: launches run their
    pre-run hooks (so they are counted and recorded) but not the kernel, and
    host stand-ins do nothing. What is left of a call is its host cost with
    the kernels taken out exactly, for calls whose host path reads no device
    result (the caller checks: ``counters.d2h == 0``)."""
    if not _runtime.INTERPRETED:
        raise RuntimeError("kernel_bodies_skipped() is for Triton's interpreter only")
    from triton.runtime import interpreter

    call = interpreter.GridExecutor.__call__

    def hooks_only(self, *args, **kwargs):
        for hook in self.pre_run_hooks:
            hook(*args, **kwargs)

    interpreter.GridExecutor.__call__ = hooks_only
    _skipping[0] = True
    try:
        yield
    finally:
        interpreter.GridExecutor.__call__ = call
        _skipping[0] = False


def _hook_for(name: str):
    def hook(*args: Any, **kwargs: Any) -> None:
        note_launch(name, args, kwargs)
    return hook


def count_launches(namespace: dict) -> None:
    """Register every ``_*_kernel`` Triton function of a module's globals."""
    if _runtime.INTERPRETED:
        _mark_interpreted_runs()
    for name, obj in namespace.items():
        if (name.endswith("_kernel") and hasattr(obj, "add_pre_run_hook")
                and not getattr(obj, "_gpukv_counted", False)):
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
