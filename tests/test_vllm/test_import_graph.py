"""The vLLM 0.8.5 adapter's modules import one another without a circle.

Every import statement counts, those under ``if TYPE_CHECKING:`` too: a
circle that only the type checker follows still ties the modules into one
unit that cannot be read, or loaded, apart. Read from the source, so nothing
here imports vLLM.
"""

from __future__ import annotations

import ast
from pathlib import Path

import gpukv

PACKAGE = "gpukv.vllm.v0_8"
FOLDER = Path(gpukv.__file__).parent / "vllm" / "v0_8"


def _module_name(path: Path) -> str:
    return PACKAGE if path.name == "__init__.py" else f"{PACKAGE}.{path.stem}"


def _imported(node: ast.AST, modules: set[str]) -> set[str]:
    """The adapter's top-level modules that one import statement loads."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:  # relative: every module here is in PACKAGE, level 1 names it
            parts = PACKAGE.split(".")[: len(PACKAGE.split(".")) - node.level + 1]
            base = ".".join([*parts, base] if base else parts)
        names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
    else:
        return set()
    return {name for name in names if name in modules}


def import_graph() -> dict[str, set[str]]:
    """Each module of ``gpukv.vllm.v0_8`` (and the package itself) to the
    ones among them it imports, anywhere in its source."""
    paths = sorted(FOLDER.glob("*.py"))
    modules = {_module_name(p) for p in paths}
    graph = {}
    for path in paths:
        own = _module_name(path)
        tree = ast.parse(path.read_text(), str(path))
        graph[own] = set().union(*(_imported(n, modules) for n in ast.walk(tree))) - {own}
    return graph


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of ``graph`` as its modules in order (the first repeated at
    the end), else None."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return path[path.index(node):] + [node]
        if node in done:
            return None
        for nxt in sorted(graph[node]):
            circle = visit(nxt, [*path, node])
            if circle:
                return circle
        done.add(node)
        return None

    for start in sorted(graph):
        circle = visit(start, [])
        if circle:
            return circle
    return None


def test_the_adapters_modules_import_one_another_without_a_circle() -> None:
    graph = import_graph()
    assert graph[f"{PACKAGE}.scheduler"] >= {f"{PACKAGE}.batched_step", f"{PACKAGE}.batched_update"}
    assert find_circle(graph) is None


def test_the_circle_finder_names_a_circle_in_order() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_circle(graph) == ["a", "b", "c", "a"]
    assert find_circle({"a": {"b"}, "b": set()}) is None
