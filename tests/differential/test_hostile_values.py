"""Hostile integers never reach numpy unchecked.

``decode([2**63 - 1], [8])``, ``step(running=RunningBatch([2**63 - 1], [8]))``
and ``row_token_counts([2**63 - 1])`` once reached ``np.bincount``, which
sized its output by the largest row: it overflowed and wrote out of bounds
(SIGSEGV or SIGABRT in most child processes, an untyped ``IndexError`` in the
others), and a row of ``2**40`` raised an uncaught ``MemoryError`` that
stopped the manager. Each is now a typed refusal that changes nothing; the
calls run here in child processes, which must exit cleanly.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpukv.core.limits import LIMITS, MAX_COUNT, MAX_LOOKAHEAD, MAX_MODEL_LEN, MAX_NEW_TOKENS, MAX_TOKEN_BUDGET
from gpukv.core.requests import NewRequest
from gpukv.device.manager import DeviceManager
from gpukv.reference.manager import ReferenceManager

KEY = bytes(range(16))
ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import sys
from gpukv.errors import GpukvInputError
from gpukv.device.manager import DeviceManager
from gpukv.reference.manager import ReferenceManager
from gpukv.core.requests import NewRequest
from gpukv.core.running_batch import RunningBatch

KEY = bytes(range(16))
m = (ReferenceManager(24, 2, hash_key=KEY, max_model_len=32) if sys.argv[1] == "reference"
     else DeviceManager(24, 2, hash_key=KEY, max_model_len=32, max_num_reqs=4))
m.step(new=[NewRequest("a", [1, 2, 3, 4, 5])])
for row in (2**63 - 1, 2**40, 2**31, -1, -2**63):
    for call in (lambda: m.decode([row], [8]), lambda: m.step(running=RunningBatch([row], [8])),
                 lambda: m.row_token_counts([row])):
        try:
            call()
        except GpukvInputError as e:
            print(type(e).__name__, e.argument)
        else:
            print("accepted", row)
assert not m.failed
assert m.decode([m.row_of("a")], [8]).ok  # the manager still works
print("done")
"""


@pytest.mark.parametrize("kind", ["reference", "device"])
def test_hostile_rows_are_refused_in_a_child_process_that_exits_cleanly(kind):
    env = dict(os.environ, PYTHONPATH=str(ROOT), TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", CHILD, kind], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    assert out.stdout.splitlines() == ["InvalidInputError rows"] * 15 + ["done"]


def test_one_limit_table():
    assert LIMITS["token_budget"] == (0, MAX_TOKEN_BUDGET) == (0, 2**31 - 1)
    assert LIMITS["num_lookahead_tokens"] == (0, MAX_LOOKAHEAD) == (0, MAX_MODEL_LEN)
    assert LIMITS["num_new_tokens"] == (0, MAX_NEW_TOKENS) == (0, MAX_MODEL_LEN)
    assert LIMITS["num_running_requests"] == (0, MAX_COUNT)


def test_the_largest_budget_is_taken_alike_and_is_no_cap():
    results = []
    for m in (ReferenceManager(16, 2, hash_key=KEY, max_model_len=32),
              DeviceManager(16, 2, hash_key=KEY, max_model_len=32, max_num_reqs=4)):
        res = m.step(new=[NewRequest("a", [1, 2, 3, 4, 5]), NewRequest("b", [6, 7, 8])],
                     token_budget=MAX_TOKEN_BUDGET)
        results.append(res)
        assert not m.failed
        m.check_invariants()
    assert results[0] == results[1]
    assert results[0].num_admitted == 2 and results[0].num_new_tokens == [5, 3]
