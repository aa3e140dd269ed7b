"""Program-order fuzzing: run each launch's grid programs out of order under
Triton's interpreter.

Triton's interpreter runs a launch's programs one after another, in order
(program 0, 1, 2, ...; the last grid axis fastest). A GPU runs them in any
order, and at the same time. ``program_order("reverse")`` and
``program_order("shuffle", seed=...)`` make the interpreter run every launch's
programs last-first, or in a seeded random order (never the identity when a
launch has two programs or more), so that a kernel, or a test, that silently
depends on the interpreter's order fails on a CPU machine.

Two patches, both undone on exit:

* ``triton.runtime.interpreter.GridExecutor.__call__`` is rebuilt from its own
  source with its ``for x ... for y ... for z`` loop over the grid replaced by
  one loop over a reordered list of ``(x, y, z)``; the rest of the method is
  Triton's, unchanged. If the source does not hold that loop exactly once (a
  Triton whose interpreter differs from the one this was written for, 3.9),
  entering the context raises ``RuntimeError`` rather than silently running
  programs in order.
* tiles shrink (``tile=8`` by default), so a small test workload still makes
  several programs per launch: every ``*TILE`` int global of the modules of
  ``gpukv.kernels`` (``blocks._TILE``, ``prefill._ROW_TILE``,
  ``free_queue.DEFAULT_TILE``, ...) and every int default of a parameter
  named ``tile`` of their functions and classes' methods (``hash_table.insert``,
  ``lookup.verify``, ``FreeQueue.create``, ...). Tiles are read when a pool
  structure is created or a launcher is called, so create managers, queues and
  tables inside the context. ``tile=None`` leaves tiles alone.

The context yields a ``Programs`` whose ``launches`` lists ``(kernel, number
of programs)`` per launch, to check that a workload does launch several
programs. ``GPUKV_PROGRAM_ORDER=reverse`` (or ``shuffle``, or
``shuffle:SEED``) runs every test of a pytest run under the mode
(``tests/conftest.py``). What it can and cannot catch: ``docs/fuzzing.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import pkgutil
import random
import re
import textwrap
import types
from collections.abc import Iterator
from typing import Any

from gpukv import _runtime

ORDERS = ("reverse", "shuffle")

#: Launchers whose grid a tile sets: the sweep must find (and shrink) each, or
#: the kernels' tiles moved and this module needs updating.
_MUST_SHRINK = {
    ("gpukv.kernels.blocks", "_TILE"),
    ("gpukv.kernels.hash_table", "_TILE"),
    ("gpukv.kernels.hash_table", "insert(tile)"),
    ("gpukv.kernels.hash_table", "find_oldest(tile)"),
    ("gpukv.kernels.hash_table", "erase(tile)"),
    ("gpukv.kernels.prefill", "_TILE"),
    ("gpukv.kernels.prefill", "_ROW_TILE"),
    ("gpukv.kernels.free_queue", "DEFAULT_TILE"),
    ("gpukv.kernels.free_queue", "FreeQueue.create(tile)"),
    ("gpukv.kernels.lookup", "verify(tile)"),
    ("gpukv.kernels.block_hash", "DEFAULT_TILE"),
    ("gpukv.kernels.gather", "_TILE"),
}

_TILE_NAME = re.compile(r"^_?([A-Z0-9]+_)*TILE$")


@dataclasses.dataclass
class Programs:
    """What a ``program_order`` context ran: ``(kernel, programs)`` per launch."""

    order: str
    seed: int
    tile: int | None
    launches: list[tuple[str, int]] = dataclasses.field(default_factory=list)


# ------------------------------------------------------------------ the grid loop

def _reordering_call(order_of: Any) -> Any:
    """``GridExecutor.__call__`` with its grid loop running programs in the
    order ``order_of(executor, grid)`` gives (a list of ``(x, y, z)``)."""
    from triton.runtime import interpreter

    original = interpreter.GridExecutor.__call__
    original = getattr(original, "_gpukv_original", original)  # nested: rebuild Triton's own
    try:
        source = textwrap.dedent(inspect.getsource(original))
    except (OSError, TypeError) as e:
        raise RuntimeError(f"program_order: cannot read GridExecutor.__call__'s source ({e})") from e
    loop = re.compile(
        r"^(?P<ind>[ ]*)for x in range\(grid\[0\]\):\n"
        r"(?P=ind)    for y in range\(grid\[1\]\):\n"
        r"(?P=ind)        for z in range\(grid\[2\]\):\n"
        r"(?P<body>(?:(?P=ind)            .*\n)+)",  # the body: every line indented past the for z
        re.M)
    found = list(loop.finditer(source))
    if len(found) != 1 or "self.fn(**args)" not in found[0]["body"] or "set_grid_idx(x, y, z)" not in found[0]["body"]:
        raise RuntimeError(
            "program_order: Triton's interpreter is not what tests/helpers/program_order.py was written for "
            "(Triton 3.9): GridExecutor.__call__ should loop 'for x in range(grid[0]): for y ...: for z ...:' once, "
            f"calling set_grid_idx(x, y, z) and self.fn(**args); found {len(found)} such loops. Update the patch.")
    m = found[0]
    ind = m["ind"]
    body = "".join(ind + line[len(ind) + 8:] + "\n" for line in m["body"].splitlines())  # 2 loops fewer
    new = source[: m.start()] + f"{ind}for x, y, z in _gpukv_order_of(self, grid):\n" + body + source[m.end():]
    if not new.startswith("def __call__(self"):
        raise RuntimeError("program_order: GridExecutor.__call__'s source does not start with its def")
    maker = "def _gpukv_make(_gpukv_order_of):\n" + textwrap.indent(new, "    ") + "    return __call__\n"
    namespace: dict[str, Any] = {}
    # The method's globals stay the interpreter module's, as in the original.
    exec(compile(maker, f"<program_order: {inspect.getsourcefile(original)}>", "exec"), interpreter.__dict__, namespace)
    call = namespace["_gpukv_make"](order_of)
    call.__qualname__ = original.__qualname__
    call._gpukv_original = original
    return call


def _permutation(order: str, n: int, rng: random.Random) -> list[int]:
    if order == "reverse":
        return list(range(n - 1, -1, -1))
    perm = list(range(n))
    if n < 2:
        return perm
    while perm == sorted(perm):  # never the interpreter's own order
        rng.shuffle(perm)
    return perm


# ------------------------------------------------------------------ tiles

def _kernel_modules() -> list[types.ModuleType]:
    import gpukv.kernels as pkg

    return [importlib.import_module(f"gpukv.kernels.{info.name}") for info in pkgutil.iter_modules(pkg.__path__)]


def _shrink_defaults(fn: Any, tile: int, undo: list) -> bool:
    """Set ``fn``'s int default of its ``tile`` parameter (positional or
    keyword-only) to ``tile``; whether it had one."""
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    if code is None:
        return False
    done = False
    kw = fn.__kwdefaults__
    if kw and isinstance(kw.get("tile"), int):
        undo.append((fn, "__kwdefaults__", dict(kw)))
        fn.__kwdefaults__ = {**kw, "tile": tile}
        done = True
    defaults = fn.__defaults__
    if defaults:
        names = code.co_varnames[: code.co_argcount][-len(defaults):]
        if "tile" in names and isinstance(defaults[names.index("tile")], int):
            undo.append((fn, "__defaults__", defaults))
            i = names.index("tile")
            fn.__defaults__ = defaults[:i] + (tile,) + defaults[i + 1:]
            done = True
    return done


def _shrink_tiles(tile: int, undo: list) -> set[tuple[str, str]]:
    """Shrink every tile of ``gpukv.kernels`` to ``tile``; what was shrunk."""
    done: set[tuple[str, str]] = set()
    for mod in _kernel_modules():
        for name, value in list(vars(mod).items()):
            if _TILE_NAME.match(name) and isinstance(value, int) and not isinstance(value, bool):
                undo.append((mod, name, value))
                setattr(mod, name, tile)
                done.add((mod.__name__, name))
            elif inspect.isfunction(value) and value.__module__ == mod.__name__:
                if _shrink_defaults(value, tile, undo):
                    done.add((mod.__name__, f"{name}(tile)"))
            elif inspect.isclass(value) and value.__module__ == mod.__name__:
                for attr, member in list(vars(value).items()):
                    if attr == "tile" and isinstance(member, int):  # a dataclass field's default
                        undo.append((value, attr, member))
                        setattr(value, attr, tile)
                    elif _shrink_defaults(member, tile, undo):
                        done.add((mod.__name__, f"{name}.{attr}(tile)"))
    return done


# ------------------------------------------------------------------ the mode

@contextlib.contextmanager
def program_order(order: str, seed: int = 0, *, tile: int | None = 8) -> Iterator[Programs]:
    """Run every interpreted launch's programs in ``order`` ("reverse" or
    "shuffle", the latter seeded by ``seed``) while active, with the kernels'
    tiles shrunk to ``tile`` (a power of two; None: unchanged)."""
    if order not in ORDERS:
        raise ValueError(f"program_order: order must be one of {ORDERS}, got {order!r}")
    if tile is not None and (tile < 1 or tile & (tile - 1)):
        raise ValueError(f"program_order: tile must be a power of two, got {tile}")
    if not _runtime.INTERPRETED:
        raise RuntimeError("program_order: needs Triton's interpreter (TRITON_INTERPRET=1); compiled kernels run "
                           "in the GPU's own order")
    from triton.runtime import interpreter

    programs = Programs(order, seed, tile)
    rng = random.Random(seed)

    def order_of(executor: Any, grid: tuple) -> list[tuple[int, int, int]]:
        ids = [(x, y, z) for x in range(grid[0]) for y in range(grid[1]) for z in range(grid[2])]
        programs.launches.append((getattr(executor.fn, "__name__", "?"), len(ids)))
        return [ids[i] for i in _permutation(order, len(ids), rng)]

    call = _reordering_call(order_of)
    undo: list = []
    previous = interpreter.GridExecutor.__dict__["__call__"]
    try:
        if tile is not None:
            missing = _MUST_SHRINK - _shrink_tiles(tile, undo)
            if missing:
                raise RuntimeError(f"program_order: these tiles were not found to shrink: {sorted(missing)}; the "
                                   "kernels' tiles moved: update tests/helpers/program_order.py")
        interpreter.GridExecutor.__call__ = call
        yield programs
    finally:
        interpreter.GridExecutor.__call__ = previous
        for owner, name, value in reversed(undo):
            setattr(owner, name, value)


def from_env(value: str) -> tuple[str, int]:
    """``GPUKV_PROGRAM_ORDER``'s value (``reverse``, ``shuffle`` or
    ``shuffle:SEED``) as ``(order, seed)``; ValueError otherwise."""
    order, _, seed = value.partition(":")
    if order not in ORDERS or (seed and not seed.isdigit()):
        raise ValueError(f"GPUKV_PROGRAM_ORDER must be reverse, shuffle or shuffle:SEED, got {value!r}")
    return order, int(seed or 0)
