"""``benchmarks/interpreter_shortcut.py``: with it installed the kernels give
the same results (block digests against the host's, a hash-table lookup),
the language is patched once per launch instead of again per jit helper
call, and ``install()`` changes nothing where the interpreter has no
``_patch_lang``. Each case runs in a child process: the shortcut patches
the process's interpreter for good, and ``tests/helpers/program_order.py``
patches ``GridExecutor`` too, so no test in this process may see it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

if os.environ.get("GPUKV_TEST_DEVICE", "").startswith("cuda"):
    pytest.skip("the shortcut is for Triton's interpreter (no CUDA)", allow_module_level=True)

PRELUDE = """
import json, struct, sys
sys.path.insert(0, "benchmarks")
import torch
import gpukv._runtime  # (the interpreter on where there is no CUDA, before triton loads)
from triton.runtime import interpreter
import interpreter_shortcut
"""

SAME_RESULTS = PRELUDE + """
from gpukv.core import hashing as host
from gpukv.kernels import block_hash as kb, hash_table as ht

calls = []
original = interpreter._patch_lang

def counting(fn):
    calls.append(fn.__name__)
    return original(fn)

interpreter._patch_lang = counting
key = bytes(range(16))
root = struct.unpack("<qq", host.root_digest(key))
tokens = torch.tensor([list(range(32)), list(range(16)) + list(range(100, 116))], dtype=torch.int32)

def digests():
    out = kb.hash_block_chains(key, torch.tensor([root, root], dtype=torch.int64), tokens,
                               torch.tensor([2, 2], dtype=torch.int32), block_size=16)
    return [[struct.pack("<qq", *out[r, b].tolist()) for b in range(2)] for r in range(2)]

plain = digests()
plain_calls, calls[:] = len(calls), []
ok = interpreter_shortcut.install()
shortcut = digests()
shortcut_calls = list(calls)
table = ht.HashTable.create(8, "cpu")
lanes = torch.tensor([struct.unpack("<qq", d) for d in shortcut[0] + shortcut[1][1:]], dtype=torch.int64)
ht.insert(table, lanes[:, 0], lanes[:, 1], 0, torch.tensor([5, 6, 7], dtype=torch.int32))
found = ht.find_oldest(table, lanes[:, 0], lanes[:, 1], 0).tolist()
missing = ht.find_oldest(table, lanes[:1, 0] + 1, lanes[:1, 1], 0).tolist()
print(json.dumps({"installed": ok, "host": [[d.hex() for d in host.hash_block_chain(key, t.tolist(), 16)]
                                            for t in tokens],
                  "plain": [[d.hex() for d in r] for r in plain], "shortcut": [[d.hex() for d in r] for r in shortcut],
                  "plain_calls": plain_calls, "shortcut_calls": shortcut_calls, "found": found,
                  "missing": missing}))
"""

WITHOUT_PATCH_LANG = PRELUDE + """
del interpreter._patch_lang
call = interpreter.GridExecutor.__call__
ok = interpreter_shortcut.install()
print(json.dumps({"installed": ok, "flag": interpreter_shortcut._installed,
                  "call_unchanged": interpreter.GridExecutor.__call__ is call,
                  "patch_lang": hasattr(interpreter, "_patch_lang")}))
"""


def _child(script: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_kernels_give_the_same_results_with_one_patch_per_launch():
    got = _child(SAME_RESULTS)
    assert got["installed"] is True
    assert got["plain"] == got["host"] and got["shortcut"] == got["host"]  # (block digests, bit for bit)
    assert got["found"] == [5, 6, 7] and got["missing"] == [-1]
    # Without it the launch patches the language and every jit helper call patches it again; with it,
    # once per language module the launch's functions see: the kernel's (triton.language), then
    # tl.zeros' (triton.language.core, from triton.language.standard), every other helper call skipped.
    assert got["plain_calls"] > 100
    assert got["shortcut_calls"] == ["_hash_block_chains_kernel", "zeros"]


def test_install_changes_nothing_without_patch_lang():
    assert _child(WITHOUT_PATCH_LANG) == {"installed": False, "flag": False, "call_unchanged": True,
                                          "patch_lang": False}
