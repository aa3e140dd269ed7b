"""Triton's per-launch host cost, measured without a GPU: the launch half of
``bench_host.py``'s twin.

On a GPU every kernel launch costs the calling thread Triton's launch path:
``JITFunction.run`` (pre-run hooks, argument binding and the specialisation
key from every argument, the kernel-cache lookup, the global-value check,
the grid), the compiled kernel's launcher (``CudaLauncher.__call__``:
scratch allocations, then the C ``launch`` of Triton's ``cuda_utils``
module, which parses the launch, calls ``data_ptr()`` and
``cuPointerGetAttribute`` for every pointer argument and packs the
parameters) and finally the CUDA driver's ``cuLaunchKernelEx``. Under
Triton's interpreter none of that runs (``InterpretedFunction.run`` is a
different path, which ``bench_host.py`` subtracts), so the twin's figure
leaves it out. This module measures it, per launch a step makes:

1. In the benchmark process (interpreter on), ``capturing()`` records every
   launch of a step as it happens on the real manager: the kernel (module
   and name), its grid, and its arguments with tensors replaced by their
   shape, strides, dtype and pointer alignment (``TensorSpec``). A host
   stand-in for a kernel (the interpreter's host hashing, ``capture.
   host_launch``) is recorded as the launch the GPU makes instead: its
   launcher (the stand-in's name without ``_host``) is called with the same
   arguments and the kernel it launches replaced by a catcher, so the
   arguments are the launcher's own.
2. ``measure()`` replays them in a child process with ``TRITON_INTERPRET=0``,
   so gpukv's ``@triton.jit`` functions are real ``JITFunction`` objects
   (with gpukv's launch-counting pre-run hooks, as on a GPU), and Triton's
   real CUDA driver class (``triton.backends.nvidia.driver.CudaDriver``)
   made active, with its real C utilities (``driver.c`` compiled by Triton
   as on a GPU host) linked against a stub ``libcuda.so.1`` built here from
   Triton's own ``cuda.h``: the stub's entry points return success (device
   queries answer as an H100, sm_90; ``cuModuleLoadData`` and
   ``cuModuleGetFunction`` give dummy handles; ``cuPointerGetAttribute``
   hands the pointer back; ``cuLaunchKernelEx`` does nothing). Each
   recorded launch gets tensors of its shape, strides, dtype and alignment
   (CPU memory: a pointer is a number to the launch path) and is run once
   untimed, which compiles the kernel for sm_90 with Triton's real compiler
   and loads it (the warm cache of a GPU process after warm-up); then the
   step's launches are timed back to back, each as the device manager
   makes it on a GPU: ``path="compiled"`` (the default), a launch the
   manager replays (recorded inside ``capture.run_prepared``:
   ``Launch.replayed``) as ``kernels/capture.py: preparing`` keeps it
   (``capture.compiled_launch``: the pre-run hooks, then the compiled
   kernel's ``kernel[grid]`` launcher), and any other launch (a free's
   release, the table's rebuild, a running update's launches, the first
   step of a bucket) through Triton's whole ``JITFunction.run``, as it
   goes on a GPU; ``path="run"``, every launch through ``JITFunction.run``
   (what the manager replayed before). Both paths are checked to hand the
   launcher the same arguments (``same_launcher_args``).

Included: everything from ``JITFunction.run`` to the driver call, Triton's
C launcher included. Not included: the driver's own work in
``cuLaunchKernelEx`` and ``cuPointerGetAttribute`` (stubs here; not measured
without a GPU); and the device and stream queries go
through Triton's torch-free path (its C utilities) rather than torch's
``torch.cuda.current_device()``/``_cuda_getCurrentRawStream`` a GPU process
with torch uses (a sub-microsecond difference). A CUDA graph replay
(``gpukv.device.graphs.DecodeGraphs``) runs none of this per kernel: one
``cudaGraphLaunch`` for the whole bucket, whose cost cannot be measured
without a GPU.

The stub and the compiled kernels live in their own Triton cache
(``cache_dir()``), never in the default one, so no real GPU process can
pick up a launcher linked against the stub.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

#: What the stub's device answers (an H100 SXM, sm_90), by ``CUdevice_attribute``.
_DEVICE = {"COMPUTE_CAPABILITY_MAJOR": 9, "COMPUTE_CAPABILITY_MINOR": 0,
           "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN": 232448, "MAX_SHARED_MEMORY_PER_MULTIPROCESSOR": 233472,
           "MAX_REGISTERS_PER_BLOCK": 65536, "MULTIPROCESSOR_COUNT": 132, "WARP_SIZE": 32,
           "CLOCK_RATE": 1980000, "MEMORY_CLOCK_RATE": 2619000, "GLOBAL_MEMORY_BUS_WIDTH": 5120,
           "MAX_THREADS_PER_BLOCK": 1024}

_STUB_C = r"""
/* A stand-in for the CUDA driver (libcuda.so.1) for gpukv's launch-cost
   benchmark (benchmarks/launch_cost.py): the entry points Triton's C
   utilities (driver.c) use, with the prototypes of Triton's own cuda.h,
   returning success and doing nothing. No GPU is touched. */
#include "cuda.h"
#include <stdint.h>
#include <stddef.h>

#define OK return CUDA_SUCCESS
#define U(x) (void)(x)

static int stub_context, stub_module, stub_function;
/* Launches that reached the driver call (the benchmark checks the count). */
unsigned long long gpukv_stub_launches = 0;

CUresult CUDAAPI cuInit(unsigned int flags) { U(flags); return CUDA_ERROR_NO_DEVICE; } /* for torch: no GPU */
CUresult CUDAAPI cuGetErrorString(CUresult e, const char **s) { U(e); *s = "stub driver"; OK; }
CUresult CUDAAPI cuDriverGetVersion(int *v) { *v = 12080; OK; }
CUresult CUDAAPI cuDeviceGet(CUdevice *d, int ordinal) { *d = ordinal; OK; }
CUresult CUDAAPI cuDeviceGetAttribute(int *pi, CUdevice_attribute a, CUdevice dev) {
  U(dev);
  switch (a) {
%(device)s
    default: *pi = 1; break;
  }
  OK;
}
CUresult CUDAAPI cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d) { U(d); *c = (CUcontext)&stub_context; OK; }
CUresult CUDAAPI cuCtxGetCurrent(CUcontext *c) { *c = (CUcontext)&stub_context; OK; }
CUresult CUDAAPI cuCtxSetCurrent(CUcontext c) { U(c); OK; }
CUresult CUDAAPI cuCtxGetDevice(CUdevice *d) { *d = 0; OK; }
CUresult CUDAAPI cuCtxGetLimit(size_t *v, CUlimit l) { U(l); *v = 0; OK; }
CUresult CUDAAPI cuCtxSetLimit(CUlimit l, size_t v) { U(l); U(v); OK; }
CUresult CUDAAPI cuModuleLoadData(CUmodule *m, const void *image) { U(image); *m = (CUmodule)&stub_module; OK; }
CUresult CUDAAPI cuModuleUnload(CUmodule m) { U(m); OK; }
CUresult CUDAAPI cuModuleGetFunction(CUfunction *f, CUmodule m, const char *name) {
  U(m); U(name); *f = (CUfunction)&stub_function; OK;
}
CUresult CUDAAPI cuFuncGetAttribute(int *pi, CUfunction_attribute a, CUfunction f) {
  U(f);
  switch (a) {
    case CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK: *pi = 1024; break;
    case CU_FUNC_ATTRIBUTE_NUM_REGS: *pi = 32; break;
    default: *pi = 0; break;
  }
  OK;
}
CUresult CUDAAPI cuFuncSetAttribute(CUfunction f, CUfunction_attribute a, int v) { U(f); U(a); U(v); OK; }
CUresult CUDAAPI cuFuncSetCacheConfig(CUfunction f, CUfunc_cache c) { U(f); U(c); OK; }
CUresult CUDAAPI cuPointerGetAttribute(void *data, CUpointer_attribute a, CUdeviceptr ptr) {
  if (a == CU_POINTER_ATTRIBUTE_DEVICE_POINTER) *(CUdeviceptr *)data = ptr;
  OK;
}
CUresult CUDAAPI cuPointerGetAttributes(unsigned int n, CUpointer_attribute *a, void **data, CUdeviceptr ptr) {
  U(n); U(a); U(data); U(ptr); OK;
}
CUresult CUDAAPI cuStreamIsCapturing(CUstream s, CUstreamCaptureStatus *st) {
  U(s); *st = CU_STREAM_CAPTURE_STATUS_NONE; OK;
}
CUresult CUDAAPI cuOccupancyMaxActiveClusters(int *n, CUfunction f, const CUlaunchConfig *c) { U(f); U(c); *n = 1; OK; }
/* The one call the benchmark leaves out: the driver's launch. */
CUresult CUDAAPI cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **params, void **extra) {
  U(config); U(f); U(params); U(extra);
  gpukv_stub_launches++;
  OK;
}
CUresult CUDAAPI cuTensorMapEncodeTiled(CUtensorMap *m, CUtensorMapDataType t, cuuint32_t r, void *g,
    const cuuint64_t *d, const cuuint64_t *s, const cuuint32_t *b, const cuuint32_t *e, CUtensorMapInterleave i,
    CUtensorMapSwizzle w, CUtensorMapL2promotion l, CUtensorMapFloatOOBfill o) {
  U(m); U(t); U(r); U(g); U(d); U(s); U(b); U(e); U(i); U(w); U(l); U(o); OK;
}
CUresult CUDAAPI cuTensorMapEncodeIm2col(CUtensorMap *m, CUtensorMapDataType t, cuuint32_t r, void *g,
    const cuuint64_t *d, const cuuint64_t *s, const int *lo, const int *hi, cuuint32_t c, cuuint32_t p,
    const cuuint32_t *e, CUtensorMapInterleave i, CUtensorMapSwizzle w, CUtensorMapL2promotion l,
    CUtensorMapFloatOOBfill o) {
  U(m); U(t); U(r); U(g); U(d); U(s); U(lo); U(hi); U(c); U(p); U(e); U(i); U(w); U(l); U(o); OK;
}
"""


class Unavailable(RuntimeError):
    """The measurement cannot run here (no C compiler, a Triton without the
    internals it uses); the message says what is missing."""


# ================================================================ recording (benchmark process)


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """A tensor argument as the launch path sees it: shape, strides, dtype
    and the pointer's alignment (Triton specialises on ``data_ptr() % 16``)."""

    shape: tuple
    stride: tuple
    dtype: str
    align: int


@dataclasses.dataclass(frozen=True)
class Launch:
    """One kernel launch: ``module.name`` of the ``@triton.jit`` function,
    the grid, and the arguments (tensors as ``TensorSpec``)."""

    module: str
    name: str
    grid: tuple
    args: tuple
    kwargs: tuple  # sorted (key, value) pairs
    # A launch the manager replays (``capture.run_prepared``): on a GPU its
    # compiled launcher; any other launch goes through ``JITFunction.run``.
    replayed: bool = False

    @property
    def kernel(self) -> str:
        return f"{self.module.rsplit('.', 1)[-1]}.{self.name}"


def _spec(x: Any) -> Any:
    import torch
    if isinstance(x, torch.Tensor):
        return TensorSpec(tuple(x.shape), tuple(x.stride()), str(x.dtype).removeprefix("torch."), x.data_ptr() % 64)
    if isinstance(x, tuple):
        return tuple(_spec(v) for v in x)
    if callable(x) or isinstance(x, list):
        raise Unavailable(f"launch argument {x!r} cannot be recorded")
    return x


def _launch(module: str, name: str, grid: Any, args: tuple, kwargs: dict) -> Launch:
    if callable(grid):
        raise Unavailable(f"{module}.{name}: a callable grid cannot be recorded")
    kw = {k: v for k, v in kwargs.items() if k not in ("grid", "warmup")}
    from gpukv.kernels import capture
    return Launch(module, name, tuple(int(g) for g in grid), _spec(tuple(args)),
                  tuple(sorted((k, _spec(v)) for k, v in kw.items())), capture.replaying())


_recorders: list[list] = []


class _StandIn:
    """Wraps a host stand-in for a kernel so a recording sees the launch the
    GPU makes in its place (module docstring, 1.)."""

    __slots__ = ("name", "fn")

    def __init__(self, name: str, fn):
        self.name, self.fn = name, fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _recorders:
            caught = _launches_of_launcher(self.name, self.fn, args, kwargs)
            for rec in _recorders:
                rec.extend(caught)
        return self.fn(*args, **kwargs)


def _launches_of_launcher(name: str, fn, args: tuple, kwargs: dict) -> list[Launch]:
    """The launches ``name``'s launcher (``fn``'s name without ``_host``)
    makes with these arguments, its kernel caught instead of launched."""
    short, attr = name.split(".", 1)
    module = importlib.import_module(f"gpukv.kernels.{short}")
    launcher = getattr(module, fn.__name__.removesuffix("_host"), None)
    if launcher is None or launcher is fn:
        raise Unavailable(f"no launcher for the host stand-in {fn.__name__} of {name}")
    caught: list[Launch] = []

    class Catcher:
        def __getitem__(self, grid):
            def launch(*a, **kw):
                caught.append(_launch(module.__name__, attr, grid, a, kw))
            return launch

    kernel = getattr(module, attr)
    setattr(module, attr, Catcher())
    try:
        launcher(*args, **kwargs)
    finally:
        setattr(module, attr, kernel)
    return caught


def install() -> None:
    """Make host stand-ins recordable (``capture.host_launch`` wraps its
    function in ``_StandIn``). Call before the managers prepare their
    launches (they keep the function they were given); idempotent."""
    from gpukv.kernels import capture
    if getattr(capture.host_launch, "_launch_cost", False):
        return
    host_launch = capture.host_launch

    def recordable(name: str, fn, *args: Any, **kwargs: Any) -> None:
        host_launch(name, _StandIn(name, fn), *args, **kwargs)

    recordable.__dict__["_launch_cost"] = True
    capture.host_launch = recordable


@contextlib.contextmanager
def capturing() -> Iterator[list[Launch]]:
    """Under Triton's interpreter: yield a list that fills with every kernel
    launch the calls inside make (kernels that run, not ones whose bodies
    ``kernel_bodies_skipped`` skips), in order. ``install()`` first, for
    host stand-ins."""
    try:
        from triton.runtime import interpreter
        call = interpreter.GridExecutor.__call__
    except (ImportError, AttributeError) as e:
        raise Unavailable(f"this Triton has no interpreter GridExecutor to record launches from: {e}") from e
    rec: list[Launch] = []

    def recording(self, *args, **kwargs):
        # self.fn is the interpreter's rewrite of the kernel, made in the kernel's module
        rec.append(_launch(self.fn.__module__, self.fn.__name__, self.grid, args, kwargs))
        return call(self, *args, **kwargs)

    interpreter.GridExecutor.__call__ = recording
    _recorders.append(rec)
    try:
        yield rec
    finally:
        interpreter.GridExecutor.__call__ = call
        _recorders.remove(rec)


# ================================================================ measuring (child process)


def cache_dir() -> str:
    """Where the stub driver and the kernels compiled for it are kept
    (warm between runs; never Triton's default cache)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "gpukv", "launch-cost")


def _include_dir() -> str:
    import triton
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "include")


def build_stub(root: str) -> str:
    """Build the stub ``libcuda.so.1`` under ``root`` (once); its folder."""
    import shutil
    out = os.path.join(root, "stub")
    lib = os.path.join(out, "libcuda.so.1")
    cases = "\n".join(f"    case CU_DEVICE_ATTRIBUTE_{k}: *pi = {v}; break;" for k, v in _DEVICE.items())
    src = _STUB_C.replace("%(device)s", cases)
    src_path = os.path.join(out, "libcuda_stub.c")
    if os.path.exists(lib) and os.path.exists(src_path):
        with open(src_path) as f:
            if f.read() == src:
                return out
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang") or shutil.which("cc")
    if cc is None:
        raise Unavailable("no C compiler (gcc, clang or $CC) to build the stub driver")
    if not os.path.exists(os.path.join(_include_dir(), "cuda.h")):
        raise Unavailable("this Triton ships no nvidia backend cuda.h")
    os.makedirs(out, exist_ok=True)
    tmp = lib + f".{os.getpid()}"
    with open(src_path + ".tmp", "w") as f:
        f.write(src)
    os.replace(src_path + ".tmp", src_path)
    r = subprocess.run([cc, "-O2", "-shared", "-fPIC", f"-I{_include_dir()}", "-Wl,-soname,libcuda.so.1",
                        "-o", tmp, src_path], capture_output=True, text=True)
    if r.returncode != 0:
        raise Unavailable(f"building the stub driver failed: {r.stderr[-2000:]}")
    os.replace(tmp, lib)
    return out


def _child_env(root: str, stub: str) -> dict:
    env = dict(os.environ)
    env["TRITON_INTERPRET"] = "0"  # real JITFunctions (gpukv._runtime keeps a caller's choice)
    env["TRITON_CACHE_DIR"] = os.path.join(root, "triton-cache")
    env["TRITON_LIBCUDA_PATH"] = stub
    env["LD_LIBRARY_PATH"] = stub + (os.pathsep + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    env["CUDA_VISIBLE_DEVICES"] = ""  # torch must not find (or load) a real driver
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    for var in ("TRITON_KERNEL_OVERRIDE", "TRITON_KERNEL_DUMP", "TRITON_ALWAYS_COMPILE", "TRITON_DEBUG"):
        env.pop(var, None)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = repo + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def measure(jobs: dict[str, list[list[Launch]]], *, samples: int = 30, per_kernel_reps: int = 50,
            timeout: float = 900.0, path: str = "compiled") -> dict[str, Any]:
    """Time each job's steps of launches through Triton's real launch path
    (module docstring). ``jobs``: name -> list of steps, each a list of
    ``Launch``; ``path``: "compiled" or "run" (module docstring, 2.).
    Returns ``{"jobs": {name: {"step_us": [[samples] per step],
    "launches": [n per step]}}, "per_kernel_us": {kernel: median per launch},
    "compile_s": ..., "triton": ..., "path": ..., "same_launcher_args":
    ...}``; raises ``Unavailable`` when it cannot run here."""
    root = cache_dir()
    stub = build_stub(root)
    with tempfile.TemporaryDirectory(prefix="gpukv-launch-cost-") as tmp:
        inp, out = os.path.join(tmp, "in.pkl"), os.path.join(tmp, "out.json")
        plain = {name: [[(ln.module, ln.name, ln.grid, _plain(ln.args), _plain(ln.kwargs), ln.replayed) for ln in step]
                         for step in steps] for name, steps in jobs.items()}
        with open(inp, "wb") as f:  # plain Python values only (the child imports this file as __main__)
            pickle.dump({"jobs": plain, "samples": samples, "per_kernel_reps": per_kernel_reps, "stub": stub,
                         "path": path}, f)
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", inp, out],
                           env=_child_env(root, stub), capture_output=True, text=True, timeout=timeout)
        if r.returncode != 0 or not os.path.exists(out):
            tail = (r.stdout + r.stderr)[-4000:]
            if "UNAVAILABLE:" in tail:
                raise Unavailable(tail.split("UNAVAILABLE:", 1)[1].strip())
            raise RuntimeError(f"the launch-cost process failed (exit {r.returncode}):\n{tail}")
        with open(out) as f:
            res = json.load(f)
    if res["reached_driver"] != res["timed_launches"]:
        raise RuntimeError(f"{res['timed_launches']} launches timed but {res['reached_driver']} reached the stub "
                           "driver's cuLaunchKernelEx: the timed path is not Triton's whole launch path")
    return res


_TENSOR = "gpukv.launch_cost.tensor"


def _same_launcher_args(kernel: Any, run_call, direct) -> bool:
    """Whether ``JITFunction.run`` (``run_call``) and ``capture.compiled_launch``
    (``direct``) hand the compiled kernel's launcher the same arguments
    (a tensor compared by its address, all the launcher reads of it: the
    compiled launch hands it the address itself)."""
    import torch
    seen: list[tuple] = []
    launcher = kernel.run

    def plain(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.data_ptr()
        if hasattr(x, "data") and hasattr(x, "extras"):  # the launch metadata, a fresh LazyDict per launch
            return "launch metadata", x.data, len(x.extras)
        return x

    def record(*a):
        seen.append(tuple(plain(x) for x in a))
        return launcher(*a)

    kernel._run = record  # (``CompiledKernel.run`` is a property returning ``_run``, the launcher)
    try:
        run_call()
        direct()
    finally:
        kernel._run = launcher
    return len(seen) == 2 and seen[0] == seen[1]


def _plain(x: Any) -> Any:
    """``TensorSpec``s as tagged tuples, for the child."""
    if isinstance(x, TensorSpec):
        return (_TENSOR, *dataclasses.astuple(x))
    if isinstance(x, tuple):
        return tuple(_plain(v) for v in x)
    return x


def _make_arg(x: Any, keep: list) -> Any:
    import torch
    if isinstance(x, tuple) and x[:1] == (_TENSOR,):
        x = TensorSpec(*x[1:])
        dtype = getattr(torch, x.dtype)
        size = torch.empty((), dtype=dtype).element_size()
        extent = 1 + sum((n - 1) * s for n, s in zip(x.shape, x.stride, strict=True)) if all(x.shape) else 1
        base = torch.empty(extent + 64 // size + 1, dtype=dtype)
        keep.append(base)
        offset = next(k for k in range(64 // size + 1) if (base.data_ptr() + k * size) % 64 == x.align % 64
                      ) if x.align % size == 0 else 0
        return base.as_strided(x.shape, x.stride, offset)
    if isinstance(x, tuple):
        return tuple(_make_arg(v, keep) for v in x)
    return x


def _use_stub_driver():
    """Make Triton's real CUDA driver class active, on its torch-free path
    (device and stream from its C utilities), its C utilities linked
    against the stub."""
    try:
        from triton.backends.nvidia import driver as nv
        from triton.runtime.driver import driver as active
    except ImportError as e:
        raise Unavailable(f"this Triton has no nvidia backend driver: {e}") from e
    drv = nv.CudaDriver.__new__(nv.CudaDriver)
    drv.utils = nv.CudaUtils()  # compiles driver.c, as on a GPU host (linked against the stub)
    drv.launcher_cls = nv.CudaLauncher
    drv.get_device_capability = drv._get_device_capability
    drv.get_current_stream = drv._get_current_stream
    drv.get_current_device = drv._get_current_device
    drv.set_current_device = drv._set_current_device
    active.set_active(drv)
    target = drv.get_current_target()
    if (target.backend, target.arch) != ("cuda", 90):
        raise Unavailable(f"the stub driver reports {target}, expected cuda sm_90")
    return drv


def _child(inp: str, out: str) -> None:
    import ctypes

    with open(inp, "rb") as fin:
        job = pickle.load(fin)
    # Load the stub first, by path: later loads of "libcuda.so.1" (the C
    # utilities' link, their dlopen of cuLaunchKernelEx) find it by soname.
    stub = ctypes.CDLL(os.path.join(job["stub"], "libcuda.so.1"), mode=ctypes.RTLD_GLOBAL)
    reached = ctypes.c_ulonglong.in_dll(stub, "gpukv_stub_launches")
    import torch  # noqa: F401  (before gpukv: the order gpukv's modules use)

    from gpukv import _runtime
    if _runtime.INTERPRETED:
        raise Unavailable("TRITON_INTERPRET is on in the launch-cost process")
    from triton.runtime.jit import JITFunction

    from gpukv.kernels import capture

    _use_stub_driver()
    keep: list = []
    kernels: dict[tuple, Any] = {}

    def prepared(plain: tuple):
        ln = Launch(*plain)
        key = (ln.module, ln.name)
        if key not in kernels:
            fn = getattr(importlib.import_module(ln.module), ln.name)
            if not isinstance(fn, JITFunction):
                raise Unavailable(f"{ln.kernel} is {type(fn).__name__}, not a JITFunction")
            kernels[key] = fn
        args = _make_arg(ln.args, keep)
        kw = {k: _make_arg(v, keep) for k, v in ln.kwargs}
        # the launch as Triton's ``kernel[grid](...)`` makes it (compiles it the first time)
        return functools.partial(JITFunction.run, kernels[key], *args, grid=ln.grid, warmup=False, **kw)

    steps = {name: [[prepared(ln) for ln in step] for step in job_steps] for name, job_steps in job["jobs"].items()}
    # Untimed: compile every variant for sm_90 and load it (a GPU process after warm-up).
    t0 = time.perf_counter()
    names_of: dict[int, str] = {}
    compiled: dict[int, Any] = {}  # id(run call) -> the same launch through capture.compiled_launch
    same_args = True
    for name, job_steps in job["jobs"].items():
        for step, calls in zip(job_steps, steps[name], strict=True):
            for plain, call in zip(step, calls, strict=True):
                kernel = call()
                names_of[id(call)] = Launch(*plain).kernel
                direct = capture.compiled_launch(call.args[0], kernel, call.args[1:], dict(call.keywords))
                if direct is None:
                    raise Unavailable(f"capture.compiled_launch cannot launch {Launch(*plain).kernel} here")
                compiled[id(call)] = direct
                same_args &= _same_launcher_args(kernel, call, direct)
    compile_s = time.perf_counter() - t0
    if job["path"] == "compiled":  # time what the manager's replays call (``capture.preparing``)
        for name, job_steps in job["jobs"].items():
            for step, calls in zip(job_steps, steps[name], strict=True):
                for i, (plain, call) in enumerate(zip(step, calls, strict=True)):
                    if Launch(*plain).replayed:  # (any other launch goes through ``run``, as on a GPU)
                        names_of[id(compiled[id(call)])] = names_of[id(call)]
                        calls[i] = compiled[id(call)]
                    else:
                        names_of[id(call)] += " (not replayed: JITFunction.run)"
    clock = time.perf_counter
    result: dict[str, Any] = {"jobs": {}, "compile_s": compile_s}
    calls_made, reached_before = 0, reached.value
    for name, job_calls in steps.items():
        per_step = []
        for calls in job_calls:
            for call in calls:  # warm
                call()
            calls_made += len(calls) * (1 + job["samples"])  # (every recorded grid is >= 1: ``_launch``)
            times = []
            for _ in range(job["samples"]):
                t = clock()
                for call in calls:
                    call()
                times.append((clock() - t) * 1e6)
            per_step.append(times)
        run_calls = [sum(" (not replayed" in names_of[id(c)] for c in calls) for calls in job_calls]
        result["jobs"][name] = {"step_us": per_step, "launches": [len(c) for c in job_calls],
                                "not_replayed": run_calls}
    # Every timed launch went the whole way to the (stub) driver's cuLaunchKernelEx.
    result["timed_launches"], result["reached_driver"] = calls_made, reached.value - reached_before
    # Each distinct kernel alone (its first recorded launch), for the per-launch figure: the median over
    # rounds of the mean of a round of back-to-back launches.
    per_kernel: dict[str, float] = {}
    for job_calls in steps.values():
        for calls in job_calls:
            for call in calls:
                k = names_of[id(call)]
                if k in per_kernel:
                    continue
                rounds = []
                for _ in range(max(1, job["per_kernel_reps"] // 10)):
                    t = clock()
                    for _ in range(10):
                        call()
                    rounds.append((clock() - t) * 1e5)
                per_kernel[k] = sorted(rounds)[len(rounds) // 2]
    import triton
    result["per_kernel_us"] = dict(sorted(per_kernel.items()))
    result["triton"] = triton.__version__
    result["path"], result["same_launcher_args"] = job["path"], same_args
    with open(out, "w") as fout:
        json.dump(result, fout)


if __name__ == "__main__" and sys.argv[1:2] == ["--child"]:
    try:
        _child(sys.argv[2], sys.argv[3])
    except Unavailable as e:
        print(f"UNAVAILABLE: {e}", file=sys.stderr)
        raise SystemExit(3) from None
