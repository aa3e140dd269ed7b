"""The kernel toolkit every kernel module shares: argument checks, launch
configuration, constants and the typed-value helpers of kernel code.

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

How launches are counted, recorded and replayed is ``gpukv.kernels.capture``.
"""

from __future__ import annotations

import operator
from typing import Any

from gpukv import _runtime  # first: it sets TRITON_INTERPRET before triton loads

import torch
import triton
import triton.language as tl

from gpukv.core.limits import MAX_NUM_BLOCKS

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

    One limit for all of them, the managers' (``gpukv.core.limits.MAX_NUM_BLOCKS``
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
