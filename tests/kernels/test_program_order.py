"""Program-order fuzzing (``tests/helpers/program_order.py``): each launch's programs
run last-first or shuffled instead of in Triton's interpreter's order, with
small tiles so launches have several programs.

* the mode itself: a kernel that records the order its programs ran in;
  tiles shrink and come back; a Triton whose interpreter differs is refused;
* the device manager against the reference under both orders, step by step;
* a selection of the kernel tests under both orders (a pytest subprocess with
  ``GPUKV_PROGRAM_ORDER`` set, as a developer would run all of them).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import triton  # (tests/conftest.py imported gpukv._runtime first: the interpreter on CPU)
import triton.language as tl

import gpukv._runtime
from gpukv.device.manager import DeviceManager
from gpukv.kernels import blocks, free_queue, hash_table
from gpukv.reference.manager import ReferenceManager
from program_order import from_env, program_order
from workload import KEY, check, chunked_session, drive

pytestmark = pytest.mark.skipif(not gpukv._runtime.INTERPRETED,
                                reason="program order is fuzzed under Triton's interpreter only")

#: This module enters the mode itself (tests/conftest.py leaves it alone).
OWN_PROGRAM_ORDER = True

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# --------------------------------------------------------------------------
# the mode
# --------------------------------------------------------------------------


@triton.jit
def _ticket_kernel(counter_ptr, out_ptr):
    """Each program takes the next ticket and stores it at its own index (the
    program ids flattened with the last axis fastest): the order they ran in."""
    pid = (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(2) + tl.program_id(2)
    tl.store(out_ptr + pid, tl.atomic_add(counter_ptr, 1))


def tickets(grid: tuple) -> list[int]:
    n = grid[0] * (grid[1] if len(grid) > 1 else 1) * (grid[2] if len(grid) > 2 else 1)
    counter = torch.zeros(1, dtype=torch.int32)
    out = torch.full((n,), -1, dtype=torch.int32)
    _ticket_kernel[grid](counter, out)
    return out.tolist()


@pytest.mark.parametrize("grid", [(7,), (2, 3), (2, 3, 2)])
def test_programs_run_in_the_order_asked(grid):
    n = len(tickets(grid))
    assert tickets(grid) == list(range(n))  # the interpreter's own order
    with program_order("reverse", tile=None) as ran:
        assert tickets(grid) == list(range(n - 1, -1, -1))
    assert ran.launches == [("_ticket_kernel", n)]
    shuffled = []
    for seed in (0, 0, 1):
        with program_order("shuffle", seed, tile=None):
            shuffled.append([tickets(grid) for _ in range(3)])
    for order in shuffled[0] + shuffled[2]:
        assert sorted(order) == list(range(n)) and order != list(range(n))  # never the interpreter's order
    assert shuffled[0] == shuffled[1]  # seeded: the same orders again
    assert shuffled[0] != shuffled[2]
    assert len({tuple(order) for order in shuffled[0]}) > 1  # each launch draws its own order
    assert tickets(grid) == list(range(n))  # restored


def test_one_program_and_nested_contexts():
    with program_order("shuffle", tile=None):
        assert tickets((1,)) == [0]
        with program_order("reverse", tile=None):
            assert tickets((3,)) == [2, 1, 0]
        assert sorted(tickets((3,))) == [0, 1, 2]
    assert tickets((3,)) == [0, 1, 2]


def test_tiles_shrink_inside_and_come_back():
    before = (blocks._TILE, hash_table.insert.__kwdefaults__["tile"], free_queue.DEFAULT_TILE)
    with pytest.raises(RuntimeError, match="boom"), program_order("reverse", tile=4):
        assert (blocks._TILE, hash_table.insert.__kwdefaults__["tile"], free_queue.DEFAULT_TILE) == (4, 4, 4)
        assert free_queue.FreeQueue.create(8, "cpu").tile == 4
        raise RuntimeError("boom")  # restored on an error too
    assert (blocks._TILE, hash_table.insert.__kwdefaults__["tile"], free_queue.DEFAULT_TILE) == before
    assert free_queue.FreeQueue.create(8, "cpu").tile == before[2]


def test_an_unexpected_interpreter_is_refused(monkeypatch):
    from triton.runtime import interpreter

    def other_call(self, *args_dev, **kwargs):  # a loop of another shape
        for x, y, z in self.programs():
            self.fn(x, y, z, *args_dev, **kwargs)

    monkeypatch.setattr(interpreter.GridExecutor, "__call__", other_call)
    refused = pytest.raises(RuntimeError, match="not what tests/helpers/program_order.py was written for")
    with refused, program_order("reverse"):
        pass
    assert interpreter.GridExecutor.__call__ is other_call


def test_a_moved_tile_is_refused(monkeypatch):
    monkeypatch.delattr(blocks, "_TILE")
    with pytest.raises(RuntimeError, match="not found to shrink"), program_order("shuffle"):
        pass


def test_bad_arguments():
    with pytest.raises(ValueError, match="order"), program_order("sideways"):
        pass
    with pytest.raises(ValueError, match="power of two"), program_order("reverse", tile=6):
        pass
    assert from_env("reverse") == ("reverse", 0) and from_env("shuffle:12") == ("shuffle", 12)
    with pytest.raises(ValueError, match="GPUKV_PROGRAM_ORDER"):
        from_env("shuffle:x")


# --------------------------------------------------------------------------
# the device manager against the reference
# --------------------------------------------------------------------------


@pytest.mark.parametrize("order, seed", [("reverse", 0), ("shuffle", 1)])
def test_device_manager_matches_the_reference_in_any_program_order(order, seed):
    """Steps of new requests sharing prefixes, running updates, finishes and
    preemptions (full attention and a sliding window), then chunked prefills,
    budgets, lookahead and batched decodes: results, block ids, reference
    counts, the free queue, the table and the invariants after every call."""
    with program_order(order, seed) as ran:
        windows = [None, 3]
        ref = ReferenceManager(20, 2, sliding_windows=windows, hash_key=KEY)
        dev = DeviceManager(20, 2, sliding_windows=windows, hash_key=KEY, max_model_len=256)
        drive([ref, dev], seed, 6, check, max_new=3)
        assert dev.make_prefix_cache_stats() == ref.make_prefix_cache_stats()
        chunked_session(seed, (None, 6), steps=8)
    # The small tiles made launches of several programs: all but the one-program kernels.
    # (The allocation's erases run inside ``_place_kernel``, and the hits' touches inside
    # ``_admission_entries_kernel`` and ``_place_hits_kernel``: the manager launches no ``_erase_kernel``,
    # ``_touch_kernel`` or ``_remove_kernel``.)
    several = [name for name, n in ran.launches if n > 1]
    assert len(several) > len(ran.launches) / 2, ran.launches
    assert {"_insert_kernel", "_place_kernel", "_admission_entries_kernel", "_place_hits_kernel",
            "_lookup_kernel"} <= set(several)


# --------------------------------------------------------------------------
# kernel tests under both orders
# --------------------------------------------------------------------------

#: Kernel tests rerun under each order: the hash table (whose placement the
#: order changes), the free queue, the pool's block kernels and the admission's
#: lookup; a few seconds each. ``GPUKV_PROGRAM_ORDER=... pytest tests/kernels``
#: runs them all (docs/fuzzing.md).
KERNEL_TESTS = [
    "tests/kernels/test_hash_table.py::test_table_full_flag",
    "tests/kernels/test_hash_table.py::test_random_batches_match_model",
    "tests/kernels/test_hash_table.py::test_tombstone_pileup_then_maybe_rebuild[64-None]",
    "tests/kernels/test_free_queue.py::test_random_batches_match_model",
    "tests/kernels/test_blocks.py",
    "tests/kernels/test_lookup.py",
    "tests/kernels/test_gather.py::test_several_programs_match_plain_indexing",
]


@pytest.mark.parametrize("order", ["reverse", "shuffle:3"])
def test_kernel_tests_pass_in_any_program_order(order):
    env = {**os.environ, "GPUKV_PROGRAM_ORDER": order}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *KERNEL_TESTS],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
