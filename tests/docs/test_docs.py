"""Every snippet in README.md and docs/*.md works as pasted.

* ```` ```python ```` blocks run, each file's twice (``tests/docs/run_snippets.py``):
  its blocks in order in one namespace, as if pasted into one Python session,
  and each block alone in a fresh namespace, as if pasted by itself; so every
  block defines what it uses. All files in one subprocess, in an empty
  directory (a process per block would load torch each time). A comment that
  states a value (``m.num_computed_tokens("c")  # its hit + 2048: 2048``) is
  checked. A failure names the file and the line of the block, and the
  traceback points at the markdown line. A block that cannot run on a
  CPU-only machine in a few seconds (it needs a GPU, vLLM, the network or a
  long run) says so on the line before its fence, with the reason:
  ``<!-- snippet: skip (needs a GPU) -->``. A block that needs vLLM 0.8.5
  (``gpukv.vllm``) says ``<!-- snippet: needs vllm -->``: it runs wherever
  vLLM is installed (CI installs it) and is skipped, with that reason,
  elsewhere.
* ```` ```json ```` blocks are valid JSON, and a trace example loads as a
  trace (``gpukv.tools.traces.load_trace``).
* Shell blocks (``bash``, ``sh``) are not run (installs, long replays), but
  every ``gpukv`` command in them, and in inline code that starts with
  ``gpukv``, names a subcommand and options the command line has, and every
  script or test file they name exists.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SKIP = re.compile(r"<!--\s*snippet:\s*skip\s*\((?P<reason>[^)]+)\)\s*-->")
NEEDS_VLLM = re.compile(r"<!--\s*snippet:\s*needs\s+vllm\s*-->")
HAVE_VLLM = importlib.util.find_spec("vllm") is not None
FENCE = re.compile(r"^```\s*(?P<lang>[\w+-]*)\s*$")
SHELLS = {"bash", "sh", "shell", "console"}


@dataclass
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    skip: str | None  # the reason, when marked to skip

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of a markdown file, with their skip markers."""
    found: list[Block] = []
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, body = i, []
        i += 1
        while i < len(lines) and lines[i].rstrip() != "```":
            body.append(lines[i])
            i += 1
        if i == len(lines):
            raise AssertionError(f"{path.relative_to(ROOT)}:{start + 1}: a code fence is never closed")
        j = next((j for j in range(start - 1, -1, -1) if lines[j].strip()), -1)
        prev = lines[j] if j >= 0 else ""
        skip = SKIP.search(prev)
        needs_vllm = NEEDS_VLLM.search(prev)
        if "snippet:" in prev and not skip and not needs_vllm:
            raise AssertionError(f"{path.relative_to(ROOT)}:{j + 1}: malformed marker {prev.strip()!r}; "
                                 "write <!-- snippet: skip (the reason) --> or <!-- snippet: needs vllm -->")
        reason = skip["reason"].strip() if skip else None
        if needs_vllm and not HAVE_VLLM:
            reason = "needs vLLM 0.8.5 (pip install -e '.[vllm085]' from a clone), not installed here"
        found.append(Block(path, start + 1, m["lang"].lower(), "\n".join(body) + "\n", reason))
        i += 1
    return found


ALL = [b for p in DOCS for b in blocks(p)]
PYTHON_FILES = sorted({b.path for b in ALL if b.lang == "python"})

@pytest.fixture(scope="module")
def python_results(tmp_path_factory) -> dict[str, dict]:
    """Each file's python blocks run (``tests/docs/run_snippets.py``): ``{"in
    order": failure, "alone": {where: failure}}``, a failure None or how it failed."""
    todo = {str(p): [{"file": str(b.path), "line": b.line, "code": b.code, "where": b.where}
                     for b in ALL if b.path == p and b.lang == "python" and b.skip is None]
            for p in PYTHON_FILES}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "docs" / "run_snippets.py")], input=json.dumps(todo),
                          capture_output=True, text=True, cwd=tmp_path_factory.mktemp("snippets"), env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]  # a snippet that kills the interpreter
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_snippets_are_found():
    assert ROOT / "README.md" in PYTHON_FILES
    assert sum(b.lang == "python" for b in ALL) >= 6
    assert all(b.skip for b in ALL if b.skip is not None)  # a skip gives its reason


@pytest.mark.parametrize("path", PYTHON_FILES, ids=[str(p.relative_to(ROOT)) for p in PYTHON_FILES])
def test_python_blocks_run_in_order_as_one_session(path, python_results):
    if not any(b.path == path and b.lang == "python" and b.skip is None for b in ALL):
        pytest.skip("every python block of this file is marked to skip")
    failure = python_results[str(path)]["in order"]
    assert failure is None, failure


@pytest.mark.parametrize("path", PYTHON_FILES, ids=[str(p.relative_to(ROOT)) for p in PYTHON_FILES])
def test_each_python_block_runs_alone(path, python_results):
    alone = python_results[str(path)]["alone"]
    if not alone:
        pytest.skip("every python block of this file is marked to skip")
    assert alone.keys() == {b.where for b in ALL if b.path == path and b.lang == "python" and b.skip is None}
    failures = [f for f in alone.values() if f is not None]
    assert not failures, "\n\n".join(failures)


@pytest.mark.parametrize("block", [b for b in ALL if b.lang == "json"], ids=lambda b: b.where)
def test_json_blocks_are_valid_and_traces_load(block, tmp_path):
    from gpukv.tools.traces import load_trace

    text = block.code.strip()
    if "\n" not in text:  # one JSON Lines record: a Mooncake trace line
        json.loads(text)
        trace = tmp_path / "trace.jsonl"
    else:
        data = json.loads(text)
        assert "steps" in data, f"{block.where}: a JSON block that is not a trace; teach this test what it is"
        trace = tmp_path / "trace.json"
    trace.write_text(text + "\n")
    loaded = load_trace(trace)
    assert loaded.requests or loaded.steps, block.where


# ------------------------------------------------------------------ shell

def _help(*argv: str) -> str:
    from gpukv.tools.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as e:
        main([*argv, "--help"])
    assert e.value.code == 0
    return out.getvalue()


def _options(*argv: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", _help(*argv)))


def _commands(text: str) -> list[list[str]]:
    """Each simple command of a shell text (continuations joined, comments
    dropped), split into words."""
    lexer = shlex.shlex(text.replace("\\\n", " "), posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    commands: list[list[str]] = [[]]
    for word in lexer:
        if word in {";", "&&", "||", "|", "&"} or word == "\n":
            commands.append([])
        else:
            commands[-1].append(word)
    return [c for c in commands if c]


def _shell_texts() -> list[tuple[str, str]]:
    """(where, text) for every shell block, line by line, and every inline
    code span that starts with ``gpukv``."""
    texts = []
    for b in ALL:
        if b.lang in SHELLS:
            # one logical line at a time: `for ... do` bodies stay with their commands
            for k, line in enumerate(b.code.replace("\\\n", " \0").split("\n")):
                texts.append((f"{b.where} (+{k + 1})", line.replace("\0", "")))
    for path in DOCS:
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for span in re.findall(r"`(gpukv [^`]*)`", line):
                if re.match(r"gpukv [\w-]+(\s|$)", span):  # not "gpukv replay: FILE:LINE: problem"
                    texts.append((f"{path.relative_to(ROOT)}:{n}", span))
    return texts


def _gpukv_invocations(words: list[str]) -> list[str] | None:
    """The arguments of a gpukv command (``gpukv``, ``.venv/bin/gpukv``,
    ``python -m gpukv``), or None when the command is something else."""
    for i, w in enumerate(words):
        if w == "gpukv" and i >= 2 and words[i - 1] == "-m":
            return words[i + 1:]
        if w == "gpukv" or w.endswith("/bin/gpukv"):
            return words[i + 1:]
    return None


def test_gpukv_commands_in_the_docs_use_options_that_exist():
    known = {"": _options(), "replay": _options("replay"), "sweep": _options("sweep")}
    checked, wrong = 0, []
    for where, text in _shell_texts():
        for words in _commands(text):
            args = _gpukv_invocations(words)
            if args is None:
                continue
            sub = args[0] if args and not args[0].startswith("-") else ""
            if sub not in known:
                wrong.append(f"{where}: no subcommand {sub!r}: {text.strip()}")
                continue
            for a in args:
                if a.startswith("--") and a.split("=")[0] not in known[sub]:
                    wrong.append(f"{where}: gpukv {sub} has no option {a.split('=')[0]}: {text.strip()}")
            checked += 1
    assert not wrong, "\n".join(wrong)
    assert checked >= 15  # the parsing found the commands


def test_files_named_in_shell_blocks_exist():
    missing = []
    for where, text in _shell_texts():
        for words in _commands(text):
            for w in words:
                repo_file = re.fullmatch(r"[\w./-]+\.(py|sh|xz)", w) and not w.startswith(("../", "/"))
                if repo_file and not (ROOT / w).is_file():
                    missing.append(f"{where}: {w}")
    assert not missing, "\n".join(missing)


def test_extras_and_scheduler_classes_in_shell_blocks_exist():
    """``pip install 'gpukv[X]'`` or ``pip install -e '.[X]'`` names an extra of pyproject.toml, and
    ``--scheduler-cls gpukv.vllm.NAME`` a class one of the vLLM adapters
    exports (read from ``gpukv/vllm/__init__.py``: each vLLM version's
    ``__all__``; importing it here would need that vLLM)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
                 ["project"]["optional-dependencies"])
    exported = set(re.findall(r'"(\w+)"', " ".join(re.findall(r"__all__ = \[([^\]]*)\]",
                                                                (ROOT / "gpukv/vllm/__init__.py").read_text()))))
    wrong, extras_seen, classes_seen = [], 0, 0
    for where, text in _shell_texts():
        for extra in re.findall(r"(?:gpukv|'\.)\[([\w,-]+)\]", text):  # (gpukv[X], or '.[X]' in a clone)
            extras_seen += 1
            wrong += [f"{where}: no extra {e!r} in pyproject.toml" for e in extra.split(",") if e not in extras]
        for name in re.findall(r"--scheduler-cls gpukv\.vllm\.(\w+)", text):
            classes_seen += 1
            if name not in exported:
                wrong.append(f"{where}: gpukv.vllm exports no {name}")
    assert not wrong, "\n".join(wrong)
    assert extras_seen >= 2 and classes_seen >= 2  # the parsing found them


def test_gpukv_version_prints_the_one_version():
    import gpukv
    from gpukv.tools.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert out.getvalue().split() == ["gpukv", gpukv.__version__]


def test_the_version_is_written_in_one_place():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "gpukv.__version__"}
    assert project["project"]["license"] == "Apache-2.0"  # an SPDX expression (PEP 639)


# ------------------------------------------------------- the snippet runner

def _run(code: str) -> dict:
    """``code`` as a block at line 10 of a file, run by tests/docs/run_snippets.py's
    rules in a fresh namespace; the namespace after it."""
    from . import run_snippets

    namespace: dict = {"__name__": "__main__"}
    run_snippets.run_block({"file": "doc.md", "line": 10, "code": code, "where": "doc.md:10"}, namespace)
    return namespace


def test_a_comment_that_states_a_value_is_checked():
    _run("x = [1, 2]\nx + [3]  # the list: [1, 2, 3]\ny, z = 2, {'a': 1}  # 2, {'a': 1}\nprint(len(x))  # 2\n")
    for wrong, says in (("[1, 2] + [3]  # the list: [1, 2, 4]", "[1, 2, 4]"), ("a, b = 1, 2  # 1, 3", "(1, 3)"),
                        ("print(7)  # 8", "8")):
        with pytest.raises(AssertionError, match=re.escape(f"doc.md:11: {wrong.split('  #')[0]} gives")) as e:
            _run(wrong + "\n")
        assert str(e.value).endswith(f"but its comment says {says}")


def test_prose_comments_and_other_statements_are_not_checked():
    ns = _run("n = 3  # three of them\nn + 1  # [B] or [B, k] tensor\nimport math  # 5\n"
              "for i in range(2): n += i  # 1\n")
    assert ns["n"] == 4


def test_a_statement_runs_once_even_when_its_value_is_checked():
    ns = _run("calls = []\ncalls.append(1) or len(calls)  # 1\nprint(calls.append(2))  # None\n")
    assert ns["calls"] == [1, 2]


def test_a_block_that_uses_an_earlier_one_fails_alone(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("```python\nm = 2\n```\n\n```python\nm * 3  # 6\n```\n", encoding="utf-8")
    found = [{"file": str(doc), "line": b.line, "code": b.code, "where": f"doc.md:{b.line}"} for b in blocks(doc)]
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "docs" / "run_snippets.py")],
                          input=json.dumps({str(doc): found}), capture_output=True, text=True, timeout=60)
    result = json.loads(proc.stdout.strip().splitlines()[-1])[str(doc)]
    assert result["in order"] is None and result["alone"]["doc.md:1"] is None
    assert "NameError: name 'm' is not defined" in result["alone"]["doc.md:5"]
    assert result["alone"]["doc.md:5"].endswith("doc.md:5: this python block fails as pasted (traceback above)")


# What a user reads imports the public API: gpukv's own names, its errors
# (gpukv.errors), the vLLM adapters (gpukv.vllm), the block-hash scheme
# (gpukv.core.hashing) and the events' wire format (gpukv.events); no private
# module, no other submodule's name.
_GPUKV_IMPORT = re.compile(r"^\s*(?:from\s+(gpukv(?:\.[\w.]+)?)\s+import\s+(.+)|import\s+(gpukv\.[\w.]+))", re.M)
_ALLOWED_FROM = {"gpukv", "gpukv.errors", "gpukv.vllm", "gpukv.core.hashing", "gpukv.events"}


def _user_code() -> list[tuple[str, str]]:
    found = [(b.where, b.code) for path in DOCS for b in blocks(path) if b.lang == "python"]
    found += [(str(p.relative_to(ROOT)), p.read_text()) for p in sorted((ROOT / "examples").glob("*.py"))]
    return found


def test_docs_and_examples_import_only_the_public_api():
    wrong = []
    for where, code in _user_code():
        for m in _GPUKV_IMPORT.finditer(code):
            module, names, plain = m.group(1), m.group(2), m.group(3)
            private = names is not None and any(n.strip().startswith("_") for n in names.strip("()").split(","))
            if plain is not None or module not in _ALLOWED_FROM or private:
                wrong.append(f"{where}: {m.group(0).strip()}")
    assert wrong == []


def test_no_notes_in_the_test_tree():
    assert sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").rglob("*.md")) == []


_ISSUE = re.compile(r"[Ii]ssues? ?#?[0-9]+")


def test_no_issue_numbers_in_code_or_headings():
    """History points at a tracker the repository does not have: code and
    headings say what, not when (the prose of docs/performance.md, a lab
    notebook, may keep them)."""
    hits = []
    for folder in ("gpukv", "tests", "benchmarks", "examples"):
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix not in {".py", ".md", ".txt", ".toml"} or not path.is_file():
                continue
            for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if _ISSUE.search(line):
                    hits.append(f"{path.relative_to(ROOT)}:{i}")
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if line.startswith("#") and _ISSUE.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{i}")
    assert hits == []
