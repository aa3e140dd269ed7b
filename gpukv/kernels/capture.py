"""Launch capture: every kernel launch counted, optionally recorded, and
kept for replay (the kernels' counterpart of a CUDA graph, on any device).

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

``kernel_seconds()`` and ``in_kernel()`` tell host time from kernel time
under Triton's interpreter, where kernels run on the host;
``kernel_bodies_skipped()`` runs only the launches' hooks (benchmarks).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any
from collections.abc import Iterator

from gpukv import _runtime  # first: it sets TRITON_INTERPRET before triton loads

import torch

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


def triton_function_classes() -> list[Any]:
    """The classes whose ``run`` launches a ``@triton.jit`` function: the
    compiled one's and, where this Triton has it, the interpreter's."""
    from triton.runtime.jit import JITFunction
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover (a Triton without the interpreter)
        return [JITFunction]
    return [JITFunction, InterpretedFunction]


def _install_prepare_hook() -> None:
    """Wrap Triton's ``run`` (compiled and interpreted) once, so that while
    ``preparing()`` is active each launch is kept as a callable."""
    import functools

    for cls in triton_function_classes():
        if getattr(cls.run, "_gpukv_prepare", False):
            continue
        run = cls.run

        def keeping(self, *args, _run=run, **kwargs):
            if not _preparing:
                return _run(self, *args, **kwargs)
            kernel = _run(self, *args, **kwargs)
            launch = compiled_launch(self, kernel, args, kwargs) if kernel is not None else None
            for prepared in _preparing:
                prepared.append(launch or functools.partial(_run, self, *args, **kwargs))
            return kernel

        keeping.__dict__["_gpukv_prepare"] = True
        keeping.__dict__["_gpukv_marked"] = getattr(run, "_gpukv_marked", False)
        cls.run = keeping


def compiled_launch(fn: Any, kernel: Any, args: tuple, kwargs: dict):
    """A launch of ``fn`` (a compiled ``JITFunction``) with these arguments,
    replayable without ``JITFunction.run``: its pre-run hooks (gpukv's launch
    count), then the compiled ``kernel``'s launcher (``kernel[grid]``,
    Triton's own warm path: the current stream, the C launcher). What it
    skips, per launch: binding the arguments, the specialisation key built
    from every argument, the kernel-cache lookup and the global-value check,
    which give the same kernel for the same arguments every time (a prepared
    launch's arguments are fixed buffers and fixed scalars). Bound once here,
    with ``fn``'s own binder, so the launcher gets the arguments ``run``
    gives it (``benchmarks/launch_cost.py`` compares them), each tensor as
    its address: the C launcher would otherwise call ``data_ptr()`` on every
    tensor and ask the driver whether it is a device pointer
    (``cuPointerGetAttribute``), every launch, for buffers whose storage
    never moves (the manager prepares anew when it reallocates one,
    ``rows_generation``) and which the first launch, through ``run``,
    checked. None (keep ``run``) under the interpreter, or where this
    Triton's internals differ from 3.x's."""
    from triton import knobs
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    if not isinstance(fn, JITFunction) or not hasattr(kernel, "packed_metadata"):
        return None
    try:
        kw = dict(kwargs)
        grid = kw.pop("grid")
        kw.pop("warmup", None)
        kw["debug"] = kw.get("debug", fn.debug) or knobs.runtime.debug
        kw["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        kw["fpsan_homomorphic_casts"] = knobs.compilation.fpsan_homomorphic_casts
        binder = fn.device_caches[driver.active.get_current_device()][4]
        bound_args = binder(*args, **kw)[0]
        if callable(grid):
            grid = grid(bound_args)
        grid = (tuple(grid) + (1, 1))[:3]
        runner = kernel[grid]
        values = tuple(bound_args.values())
    except (AttributeError, IndexError, KeyError, TypeError, ValueError):  # another Triton: keep its run
        return None
    hooks = tuple(fn.pre_run_hooks)
    addresses = tuple(v.data_ptr() if isinstance(v, torch.Tensor) else v for v in values)

    def launch(_keep_alive=values) -> None:  # (the tensors live as long as their addresses are launched)
        for hook in hooks:
            hook(*args, **kw)  # (what ``run`` hands them)
        runner(*addresses)

    return launch


_replaying = [0]  # > 0 while ``run_prepared`` runs kept launches


def run_prepared(launches: list) -> None:
    """Run launches ``preparing`` kept, in order; a recorder
    (``benchmarks/launch_cost.py``) sees them as replays (``replaying``),
    which on a GPU skip ``JITFunction.run``, where every other launch pays
    for it."""
    _replaying[0] += 1
    try:
        for one in launches:
            one()
    finally:
        _replaying[0] -= 1


def replaying() -> bool:
    """Whether the launch being made is a kept one replayed (``run_prepared``)."""
    return _replaying[0] > 0


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
    # Now, not at the first ``preparing()``: a wrapper of a kernel's ``run``
    # installed in between (``Recorder`` of ``tests/kernels/aot.py``) would otherwise call past it,
    # and a step would keep no launches to replay.
    _install_prepare_hook()
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
