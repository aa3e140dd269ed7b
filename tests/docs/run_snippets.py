"""Runs the docs' python blocks for ``tests/docs/test_docs.py``, in one interpreter
(torch and Triton load once), and prints what failed as JSON.

Reads ``{file: [block, ...]}`` on stdin, each block ``{"file", "line",
"code", "where"}``. Runs each file's blocks twice: in order in one namespace
(as pasted into one Python session) and each alone in a fresh namespace (as
pasted by itself); every block must work both ways. A block is compiled under
its file's name with its lines where they are in the file, so a traceback
points at the markdown line.

A statement whose line ends in a comment that states a value checks it: an
expression (``m.num_computed_tokens("c")  # its hit + 2048: 2048``), a
``print(x)`` or an assignment (``blocks, n = f()  # [], 0``), followed by a
comment whose text after its last ``": "`` (or whole) is a Python literal,
must equal that literal. Comments that are not literals are prose.

Prints, on its last line, ``{file: {"in order": failure, "alone": {where:
failure}}}``, each failure None or the traceback and what went wrong.
"""

from __future__ import annotations

import ast
import io
import json
import sys
import tokenize
import traceback


def _comments(code: str) -> dict[int, str]:
    """Each line's trailing comment (1-based lines of ``code``), without the ``#``."""
    out = {}
    for tok in tokenize.generate_tokens(io.StringIO(code).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = tok.string[1:].strip()
    return out


def _stated(comment: str):
    """The literal a comment states, or ``_PROSE`` for a comment that states none."""
    for text in (comment.rsplit(": ", 1)[-1], comment):
        try:
            return ast.literal_eval(text.strip())
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
    return _PROSE


_PROSE = object()


def _evaluate(node: ast.expr, file: str, namespace: dict):
    return eval(compile(ast.fix_missing_locations(ast.Expression(node)), file, "eval"), namespace)


def _run_statement(stmt: ast.stmt, file: str, namespace: dict, check: bool):
    """Run one statement once; with ``check``, return the value its comment
    may state: an expression's, a ``print(x)``'s ``x`` (printed too), an
    assignment's targets read back. Else (or for any other statement) None."""
    if check and isinstance(stmt, ast.Expr):
        call = stmt.value
        if (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "print"
                and len(call.args) == 1 and not call.keywords):
            value = _evaluate(call.args[0], file, namespace)
            print(value)
            return value
        return _evaluate(stmt.value, file, namespace)
    exec(compile(ast.Module([stmt], []), file, "exec"), namespace)
    if check and isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
        target = ast.parse(ast.unparse(stmt.targets[0]), mode="eval").body  # a, b: read back as a tuple
        return _evaluate(ast.copy_location(target, stmt), file, namespace)
    return None


def run_block(block: dict, namespace: dict) -> None:
    """Run one block in ``namespace`` statement by statement, checking the
    values its comments state; raise AssertionError where one differs."""
    code, offset, file = block["code"], block["line"], block["file"]
    comments = _comments(code)
    tree = ast.parse(code, file)
    ast.increment_lineno(tree, offset)  # the block's first line is the one after the fence
    for stmt in tree.body:
        comment = comments.get(stmt.end_lineno - offset)
        stated = _stated(comment) if comment is not None else _PROSE
        value = _run_statement(stmt, file, namespace, check=stated is not _PROSE)
        checkable = isinstance(stmt, ast.Expr) or isinstance(stmt, ast.Assign) and len(stmt.targets) == 1
        if stated is not _PROSE and checkable and value != stated:
            source = " ".join(code.splitlines()[stmt.lineno - offset - 1:stmt.end_lineno - offset]).split("  #")[0]
            raise AssertionError(f"{file}:{stmt.end_lineno}: {source.strip()[:80]} gives {value!r}, "
                                 f"but its comment says {stated!r}")


def _attempt(block: dict, namespace: dict) -> str | None:
    try:
        run_block(block, namespace)
    except BaseException:
        out = io.StringIO()
        traceback.print_exc(file=out)
        return f"{out.getvalue()}{block['where']}: this python block fails as pasted (traceback above)"
    return None


def main() -> None:
    results = {}
    for file, todo in json.load(sys.stdin).items():
        in_order, namespace = [], {"__name__": "__main__"}
        for block in todo:
            in_order.append(_attempt(block, namespace))
            if in_order[-1] is not None:
                break
        # The first block ran alone already: first in order, in a fresh namespace.
        alone = {block["where"]: in_order[0] if i == 0 else _attempt(block, {"__name__": "__main__"})
                 for i, block in enumerate(todo)}
        results[file] = {"in order": in_order[-1] if in_order else None, "alone": alone}
    sys.stdout.flush()
    print("\n" + json.dumps(results))


if __name__ == "__main__":
    main()
