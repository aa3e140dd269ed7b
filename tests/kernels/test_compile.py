"""Every Triton kernel compiles for NVIDIA GPUs, checked without one.

Triton's interpreter (how the other kernel tests run on a machine without
CUDA) accepts code the real compiler rejects, so these tests compile every
kernel of ``gpukv.kernels`` ahead of time with Triton's real compiler for
sm_80 and sm_90, in subprocesses with the interpreter off and a fresh, empty
Triton cache, for the argument specialisations that real manager steps launch
(recorded by ``tests/kernels/aot.py``, which holds all of the logic; see its
docstring). ``benchmarks/compile_table.py`` prints the registers, spills and
shared memory of the same compiles.
"""

from __future__ import annotations

import pytest

import gpukv._runtime  # noqa: F401  (the interpreter on machines without CUDA)
from tests.kernels import aot

pytest.importorskip("triton.backends.nvidia.compiler")

#: Distinct compiled signatures a kernel may have over the two recorded
#: device-manager runs (full attention; full + sliding window), whose counts,
#: lengths and stamps change every step. A kernel's signatures may differ only
#: by launcher call site or manager kind (a constexpr such as HAS_VALID or the
#: number of KV-cache groups, a strided view, a pointer's alignment), never
#: by a per-step count. Before the per-step ints were ``do_not_specialize``,
#: these runs compiled up to 7 signatures per kernel, 53 in all; after, 2 at
#: most, 25 in all (``benchmarks/compile_table.py`` prints the figures).
MAX_SIGNATURES_PER_KERNEL = 3


@pytest.fixture(scope="module")
def discovered():
    return aot.discover()


@pytest.fixture(scope="module")
def recording(discovered):
    kernels = discovered[0]
    return aot.record(kernels)


def _listing(sigs) -> str:
    return "\n".join("  " + s.describe() for s in sigs)


def test_discovery_finds_kernels_and_their_helpers(discovered):
    kernels, helpers, unused = discovered
    # A few known ones, so a broken discovery cannot pass by finding nothing.
    for name in ("lookup._admit_kernel", "free_queue._push_kernel", "hash_table._insert_kernel",
                 "block_hash._hash_block_chains_kernel", "blocks._record_kernel"):
        assert name in kernels, sorted(kernels)
    for name in ("lookup._pending", "block_hash.segment_digest", "free_queue._compact_window"):
        assert name in helpers, sorted(helpers)
    assert not set(kernels) & set(helpers) and not set(kernels) & set(unused)


def test_every_kernel_is_launched_by_the_workloads(discovered, recording):
    kernels = discovered[0]
    unlaunched = sorted(set(kernels) - set(recording.per_kernel()))
    assert not unlaunched, (
        f"kernels never launched by tests/kernels/aot.py's WORKLOADS, so never compiled here: {unlaunched}; "
        "extend manager_workload or direct_launches")


def test_every_kernel_compiles_for_sm80_and_sm90(recording):
    sigs = recording.signatures()
    results = aot.compile_all(sigs)
    failed = [r for r in results if not r.ok]
    assert not failed, "\n\n".join(
        f"{r.kernel} does not compile for {r.target}\n  signature: {r.signature}\n  {r.error}" for r in failed)
    assert len(results) == len(sigs) * len(aot.TARGETS)
    no_regs = [f"{r.kernel} {r.target}" for r in results if r.registers is None or r.spill_stores is None]
    assert not no_regs, f"no register/spill counts in ptxas's log for {no_regs}"


def test_per_step_integers_are_not_specialised(discovered, recording):
    kernels = discovered[0]
    labels = [label for label, _ in aot.MANAGER_WORKLOADS]
    by_kernel: dict = {}
    for sig in set().union(*(recording.by_workload[x] for x in labels)):
        by_kernel.setdefault(sig.kernel, []).append(sig)
    over = {k: v for k, v in by_kernel.items() if len(v) > MAX_SIGNATURES_PER_KERNEL}
    assert not over, "\n".join(
        f"{k}: {len(v)} compiled signatures in the manager runs (at most {MAX_SIGNATURES_PER_KERNEL}); "
        f"is a per-step int missing from its do_not_specialize?\n{_listing(v)}" for k, v in over.items())
    # The same kinds of steps with other counts, lengths and stamps need no new
    # compile: a GPU would stall inside a step for each new one.
    again = aot.record(kernels, workloads=(
        ("full attention, other counts", lambda: aot.manager_workload(windows=(None,), steps=4, seed=3)),
        ("full + sliding window, other counts",
         lambda: aot.manager_workload(windows=(None, 40), uncached_first=False, steps=4, seed=5)),
    ))
    new = sorted(set(again.launches) - set(recording.launches), key=lambda s: s.kernel)
    assert not new, ("steps with other counts compiled new variants (a per-step int is specialised):\n"
                     + _listing(new))
