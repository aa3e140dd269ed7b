"""No module of the package reads another object's private attributes.

Every ``x._name`` in ``gpukv/`` has ``self``, ``cls`` or ``super()`` as
``x``; a part takes what it uses through its constructor, typed (the device
manager's parts: ``gpukv.device.state.DeviceState`` and ``DeviceCalls``), so
mypy checks each use. The exceptions are objects gpukv does not own, listed
below with the reason: Python's, Triton's and vLLM's, whose private
attributes gpukv must read or mark. Read from the source (nothing imported);
the whole package, so the test sits beside the layers' folders.
"""

from __future__ import annotations

import ast
from pathlib import Path

import gpukv

ROOT = Path(gpukv.__file__).parent

#: (file under gpukv/, the access as written): the private attributes of
#: objects gpukv does not own, each with why it is read.
ALLOWED = {
    # Python's: the caller's frame, for a warning's stack level (there is no public spelling).
    ("core/checks.py", "sys._getframe"),
    # gpukv's own mark on a Triton JITFunction (registered once for launch counting), not Triton's state.
    ("kernels/capture.py", "obj._gpukv_counted"),
    # vLLM's Request: its token lists, read (0.33 / 0.34) and appended to as vLLM's
    # append_output_token_ids does (0.8.5), in one pass over a batch.
    ("vllm/v0_33/views.py", "r._all_token_ids"),
    ("vllm/v0_8/batched_update.py", "request._all_token_ids"),
    ("vllm/v0_8/batched_update.py", "request._output_token_ids"),
    # vLLM's Scheduler: whether it is paused (0.33 / 0.34 offer no public read of it).
    ("vllm/v0_33/admissions.py", "s._pause_state"),
}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _own(node: ast.expr) -> bool:
    """Whether ``node`` is ``self``, ``cls`` or ``super()``: the object's own attributes."""
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"
            and not node.args)


def private_reads(source: str) -> list[tuple[int, str]]:
    """(line, access) of each ``x._name`` in ``source`` whose ``x`` is not the object's own."""
    return sorted((n.lineno, ast.unparse(n)) for n in ast.walk(ast.parse(source))
                  if isinstance(n, ast.Attribute) and _is_private(n.attr) and not _own(n.value))


def package_private_reads() -> dict[tuple[str, str], list[int]]:
    """Every private read of the package: (file, access) -> its lines."""
    found: dict[tuple[str, str], list[int]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for line, access in private_reads(path.read_text(encoding="utf-8")):
            found.setdefault((rel, access), []).append(line)
    return found


def test_no_module_reads_another_objects_private_attributes() -> None:
    found = package_private_reads()
    unlisted = [f"gpukv/{rel}:{lines[0]}: {access}" for (rel, access), lines in found.items()
                if (rel, access) not in ALLOWED]
    assert not unlisted, "private attributes read through another object (take it typed, by a public name):\n" \
        + "\n".join(unlisted)


def test_every_allowed_read_is_still_there() -> None:
    """An exception no code needs any more leaves the list."""
    assert sorted(ALLOWED - set(package_private_reads())) == []


def test_the_scan_finds_a_private_read_and_leaves_the_objects_own_alone() -> None:
    source = """
class Part:
    def __init__(self, manager):
        self._m = manager
        self._s = manager._state

    def go(self):
        super()._go()
        cls._x, self.__class__, self.public
        return self._m._read(1) + self._s.rows.__len__() + other()._z
"""
    assert private_reads(source) == [(5, "manager._state"), (10, "other()._z"), (10, "self._m._read")]
