"""What every kernel module shares: argument checks, launch configuration,
constants, the typed-zero helpers of kernel code, launch counting, launch
recording, and prepared launches.

Checks (host side, in the launchers): ``check_tensor`` (one tensor argument:
type, dtype, shape, device, size, layout; a few attribute reads, no torch op
and no device sync, so a launcher that runs every step may call it),
``check_device``, ``check_tile`` and ``check_num_blocks`` (the one size limit
every pool structure's ``create`` takes). Launch configuration: the named
tile sizes (``SCAN_TILE`` ...; each says why its size) and ``num_warps``.
Kernel code: ``BIG`` and the typed-value helpers ``zero_like``,
``false_like``, ``true_like``, ``full_like`` (why they exist: the comment
above them and their docstrings), ``max_combine``/``min_combine`` (scan
combiners).

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
import operator
import time
from typing import Any
from collections.abc import Iterator

from gpukv import _runtime  # first: it sets TRITON_INTERPRET before triton loads

import torch
import triton
import triton.language as tl

from gpukv.request import MAX_NUM_BLOCKS

# ================================================================ argument checks
# Host side, in the launchers. Attribute reads only (no torch op, no device
# sync): a launcher that runs every step may call them. The device manager
# prepares its launches once per bucket and then replays them without the
# launchers' Python (``preparing``), so there they run once per bucket.

#: Index arrays a kernel loads and widens to int64 (rows, positions, groups).
INDEX_DTYPES = (torch.int32, torch.int64)
#: Per-entry masks a kernel reads as ``!= 0``.
MASK_DTYPES = (torch.bool, torch.int8, torch.uint8, torch.int32)
INT32 = (torch.int32,)
INT64 = (torch.int64,)


def _dtype_text(dtypes: tuple) -> str:
    """``torch.int64`` for one dtype, ``int32 or int64`` for alternatives."""
    if len(dtypes) == 1:
        return str(dtypes[0])
    return " or ".join(str(d).removeprefix("torch.") for d in dtypes)


def check_tensor(t: Any, name: str, *, dtypes: tuple, device: torch.device | None = None,
                 ndim: int | None = None, shape: tuple | None = None, min_numel: int | None = None,
                 contiguous: bool = False, dtype_error: type[Exception] = ValueError,
                 prefix: str = "") -> torch.Tensor:
    """Return ``t`` if it is what argument ``name`` must be; else raise an
    error that names the argument, what was expected and what came.

    * not a ``torch.Tensor``: TypeError;
    * a dtype not in ``dtypes``: ``dtype_error`` (ValueError; ``slot_mapping``
      documents TypeError);
    * ``shape`` (a tuple with None for "any size": ``(None, 2)``; implies the
      number of dimensions) or else ``ndim`` not met, not on ``device`` (when
      given), fewer than ``min_numel`` elements, not contiguous (when
      ``contiguous``): ValueError.

    ``prefix`` starts every message (``"slot_mapping: "``). No copy is made:
    a caller that wants a contiguous tensor either asks for one here or
    calls ``.contiguous()`` itself.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{prefix}{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise dtype_error(f"{prefix}{name} must be {_dtype_text(dtypes)}, got {t.dtype}")
    if shape is not None:
        if t.dim() != len(shape) or any(s is not None and s != d for s, d in zip(shape, t.shape, strict=True)):
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{prefix}{name} must have shape {want}, got {list(t.shape)}")
    elif ndim is not None and t.dim() != ndim:
        raise ValueError(f"{prefix}{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{prefix}{name} is on {t.device}, expected {device}: put every input on one device")
    if min_numel is not None and t.numel() < min_numel:
        raise ValueError(f"{prefix}{name} must hold at least {min_numel} elements, got {list(t.shape)}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{prefix}{name} must be contiguous, got strides {t.stride()}")
    return t


def check_device(device: torch.device, prefix: str = "") -> None:
    """ValueError unless a Triton kernel can run on tensors on ``device``:
    CUDA, or the CPU under Triton's interpreter (``gpukv._runtime`` turns it
    on where there is no CUDA)."""
    if device.type == "cuda":
        return
    if not _runtime.INTERPRETED:
        raise ValueError(
            f"{prefix}Triton kernels need CUDA tensors, got tensors on {device}, and TRITON_INTERPRET is off "
            "(Triton compiles for the GPU): move them to the GPU, or set TRITON_INTERPRET=1 before triton is "
            "imported (import gpukv first) to run on the CPU")
    if device.type != "cpu":
        raise ValueError(f"{prefix}Triton kernels run on CUDA tensors, or on CPU tensors under Triton's "
                         f"interpreter; got tensors on {device}")


def check_tile(tile: int) -> int:
    """``tile`` if it is a power of two (``tl.arange``'s rule), else ValueError."""
    if tile < 1 or tile & (tile - 1):
        raise ValueError(f"tile must be a power of two, got {tile}")
    return tile


def pow2_at_least(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``)."""
    return 1 << max(0, n - 1).bit_length()


def check_num_blocks(num_blocks: Any) -> int:
    """``num_blocks`` of a pool structure (``FreeQueue.create``,
    ``HashTable.create``) as an int, or ValueError.

    One limit for all of them, the managers' (``gpukv.request.MAX_NUM_BLOCKS``
    = 2**29): at least 2, as block 0 is the null block (never queued, never
    cached), and at most 2**29, because the hash table has a power of two
    ``cap >= 2N`` slots and its kernels take ``cap`` as an int32 argument and
    compute slot indices (``(slot + 1) & (cap - 1)``) in int32 lanes: ``cap
    <= 2**30`` (2**31 is not an int32), so ``N <= 2**29``. (The free queue
    alone would take more: its positions are int64, its block ids int32.)
    """
    if isinstance(num_blocks, bool):
        raise ValueError(f"num_blocks must be an int, got {num_blocks!r}")
    try:
        n = operator.index(num_blocks)
    except TypeError:
        raise ValueError(f"num_blocks must be an int, got {num_blocks!r}") from None
    if not 2 <= n <= MAX_NUM_BLOCKS:
        raise ValueError(f"num_blocks must be in [2, {MAX_NUM_BLOCKS}] (block 0 is the null block; the hash "
                         f"table's int32 slot indices hold two slots per block), got {n}")
    return n


# ================================================================ launch configuration
# A tile is the lanes a program handles at once (``tl.arange(0, TILE)``, a
# power of two). A tile size is a constexpr argument, so each is a compiled
# variant of its kernels (``benchmarks/compile_table.py``): change one only
# with a measurement. What decides a size: whether a kernel's loop trips run
# one after another in a single program (a wide tile is fewer trips) or its
# lanes are spread over many programs (a narrow tile is more programs, on
# more SMs, for the small batches of one step); and what a lane holds or
# waits for (lanes that loop on their own, such as a hash probe, keep the
# whole tile busy until the slowest is done).

#: One-program kernels: the free queue's scans, pushes and compactions
#: (``free_queue.DEFAULT_TILE``), the hash table's insert sequence numbers (a
#: prefix sum over the batch), ``decode_fit``. Their trips are sequential, so
#: a step waits ``items / SCAN_TILE`` trips: wide, at a few registers a lane.
SCAN_TILE = 1024
#: Element-wise lanes of the admission (``prefill``): a prompt's tokens per
#: trip of its row copy, and the entry arrays (a few loads and stores per
#: lane, over bucket-padded arrays of thousands of entries): wide, few
#: programs.
ROW_TILE = 1024
#: The pool's per-entry kernels (``blocks``: release, touch, place, record):
#: one lane per entry, with atomics on the blocks' counts; a step has
#: hundreds to a few thousand entries, which 256-lane programs spread over
#: several SMs (``record`` also holds a [TILE, block size] token tile).
ENTRY_TILE = 256
#: Lanes that loop on their own or hold much: hash-table probes (insert,
#: find, erase, rebuild; ``prefill``'s lookup and chains), where a program
#: runs until its slowest lane meets an empty slot, and verifies, which hold
#: a [TILE, block size] token tile in registers: narrow, so a long probe holds
#: up few lanes and a tile's registers fit.
PROBE_TILE = 128
#: ``slot_mapping``: one program per request, this many of its scheduled
#: tokens per trip; most requests schedule few tokens a step (a decode: one),
#: so a narrow tile wastes few masked lanes.
SLOT_TILE = 128
#: ``lookup``'s sequential admission: one program walks the step's requests
#: in order and, for each, its P positions (each for G groups) in tiles; P is
#: a few to a few tens of blocks, so a narrow tile wastes few lanes in a loop
#: that runs once per request.
ADMIT_TILE = 64
#: ``block_hash`` (``DEFAULT_TILE``): requests per program, one lane (one
#: thread) each, walking its chain of blocks in order with a BLAKE3 state of
#: about 50 uint32 words in registers; a step hashes few requests, so small
#: tiles spread them over more SMs (a step waits for one chain, not a tile).
HASH_TILE = 64

#: The warps Triton gives a launch that names none.
DEFAULT_WARPS = 4
#: The most warps ``num_warps`` gives: 256 threads a program.
MAX_WARPS = 8


def num_warps(tile: int, max_warps: int = MAX_WARPS) -> int:
    """Warps for a program of ``tile`` lanes: one per 32 lanes (a warp is 32
    threads, so one lane a thread), at least 1 and at most ``max_warps``.

    More warps than ``tile / 32`` would leave threads without a lane; past
    ``max_warps`` each thread takes several lanes, which suits light lanes
    (the free queue's 1024-lane scans: 8 warps, 4 lanes a thread, one
    program keeping 256 threads' loads in flight). ``decode_fit`` and the
    admission's row copy pass ``max_warps=DEFAULT_WARPS`` (the 4 warps they
    have always run with); launches that pass no ``num_warps`` get Triton's
    default, ``DEFAULT_WARPS``. The tiles in use: 1024 lanes -> 8 warps (free
    queue), 64 -> 2 (hashing), 1024 capped at 4 -> 4 (``decode_fit``,
    ``write_rows``). ``num_warps`` is part of a compiled variant: a change
    here recompiles kernels.
    """
    return max(1, min(max_warps, tile // 32))


# ================================================================ kernel code
#: A number larger than any block count (``MAX_NUM_BLOCKS``), request index,
#: block position or count of blocks a step needs, and still an int32 (it sits
#: in int32 arrays and lanes): "no request", "no position", a padding row's
#: need that never fits. Kernels read it as a constexpr copy (below).
BIG = 1 << 30

# Constants a kernel reads must be ``tl.constexpr`` module globals: the real
# compiler rejects any other global (the interpreter accepts them), so each
# kernel module keeps constexpr copies (``_BIG: tl.constexpr =
# tl.constexpr(BIG)``) of the plain ints the host code uses.

# Typed values. Triton fixes a loop-carried variable's type and shape where
# the loop starts (every trip must leave them as they were), and a Python 0 or
# False is a constexpr, which can be neither carried nor combined as a block.
# These helpers build a value of exactly ``x``'s type and shape from ``x``
# itself, scalar or block, without spelling either (``tl.zeros`` needs both,
# and a helper shared by callers of several shapes knows neither). They also
# turn a scalar into lanes (``zero_like(lanes) + s``): the interpreter refuses
# a mask that combines a scalar with a block, and mistypes a 0-d bool
# broadcast in ``&``, so such masks are built from ints.


@triton.jit
def zero_like(x):
    """0 of ``x``'s (integer) dtype and shape (``x * 0``). Why: a counter or
    flag carried through a loop must start with the type and shape it keeps
    (Triton fixes them at the loop's entry; a Python 0 is a constexpr), and
    ``zero_like(lanes) + s`` turns a scalar into lanes (the interpreter
    refuses a scalar-and-block mask)."""
    return x * 0


@triton.jit
def false_like(x):
    """An all-False mask of ``x``'s shape (``x`` integer or bool). Why: the
    start of a mask OR-ed over a loop's trips, which must have the lanes'
    shape from the first (a Python False is a constexpr, not a block)."""
    return x != x


@triton.jit
def true_like(x):
    """An all-True mask of ``x``'s shape (``x`` integer or bool). Why: a
    true of the same kind as the condition it joins (a scalar true for a
    scalar condition), where a Python True would be a constexpr."""
    return x == x


@triton.jit
def full_like(mask, value):
    """``value`` (a constant) in every lane of ``mask``'s shape, in the type
    Triton gives the constant (int32; int64 past the int32 range). Why: the
    start of a per-lane result a loop improves (``probe_oldest``'s best
    block), in a helper that does not know its callers' tile shape."""
    return tl.where(mask, value, value)


@triton.jit
def max_combine(a, b):
    """``tl.associative_scan`` combiner: a running maximum."""
    return tl.maximum(a, b)


@triton.jit
def min_combine(a, b):
    """``tl.associative_scan`` combiner: a running minimum."""
    return tl.minimum(a, b)


# ================================================================ launches

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
