"""Every Triton kernel compiled ahead of time for sm_80 and sm_90: registers,
spills, shared memory and compile seconds, as a markdown table. No GPU
needed (Triton's compiler and its bundled ptxas run on the CPU).

    PYTHONPATH=. python benchmarks/compile_table.py [--growth-steps 18]

The signatures compiled are those the recording workloads launch
(``tests/kernels/aot.py``: two short device-manager runs, full attention and
full + sliding window, plus direct launcher calls for what a manager never
launches); a kernel with several signatures reports its worst registers,
spills and shared memory and the sum of its compile seconds. Then the
number of distinct signatures with the kernels' ``do_not_specialize`` marks
and without them (what Triton would compile if every int were specialised),
for the recording and for longer manager runs (``--growth-steps``, 0 skips).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gpukv._runtime  # noqa: E402,F401  (the interpreter on machines without CUDA)
from tests.kernels import aot  # noqa: E402


def _manager_runs(steps: int):
    return (
        ("full attention", lambda: aot.manager_workload(windows=(None,), steps=steps)),
        ("full + sliding window",
         lambda: aot.manager_workload(windows=(None, 40), uncached_first=False, steps=steps, seed=1)),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--growth-steps", type=int, default=18,
                    help="steps of the longer manager runs that count signatures (0: skip)")
    ap.add_argument("--jobs", type=int, default=None, help="compile worker processes (default: min(2, CPUs))")
    args = ap.parse_args()

    import triton

    kernels, helpers, unused = aot.discover()
    t0 = time.perf_counter()
    rec = aot.record(kernels)
    t_rec = time.perf_counter() - t0
    sigs = rec.signatures()
    t0 = time.perf_counter()
    results = aot.compile_all(sigs, jobs=args.jobs)
    t_comp = time.perf_counter() - t0
    targets = ", ".join(f"sm_{t[1]}" for t in aot.TARGETS)
    print(f"Triton {triton.__version__}; targets {targets} (`GPUTarget(\"cuda\", cc, 32)`), fresh Triton cache, "
          f"no GPU. {len(kernels)} kernels ({len(helpers)} jit helpers compiled inside them), "
          f"{len(sigs)} distinct signatures, {len(results)} compiles: {t_comp:.0f} s "
          f"(recording the launches under the interpreter: {t_rec:.0f} s).\n")
    print(aot.markdown_table(results))
    unlaunched = sorted(set(kernels) - set(rec.per_kernel()))
    if unlaunched:
        print(f"\nNOT COMPILED (never launched by the recording workloads): {', '.join(unlaunched)}")
    if unused:
        print(f"\nUnused jit helpers (called by no kernel, compiled nowhere): {', '.join(sorted(unused))}")
    failed = [r for r in results if not r.ok]
    for r in failed:
        print(f"\nFAILED {r.kernel} for {r.target}: {r.signature}\n{r.error}")

    print("\nDistinct compiled signatures, with the kernels' `do_not_specialize` marks / without them:\n")
    print("| workload | with | without | most per kernel, with / without |")
    print("| --- | ---: | ---: | ---: |")
    runs = [("the recording above (manager runs and direct launcher calls)", aot.WORKLOADS),
            ("its two manager runs (5 steps each)", aot.MANAGER_WORKLOADS)]
    if args.growth_steps:
        runs.append((f"the two manager runs, {args.growth_steps} steps each", _manager_runs(args.growth_steps)))
    for label, workloads in runs:
        counts = []
        for honour in (True, False):
            if honour and workloads is aot.WORKLOADS:
                r, labels = rec, None
            elif honour and workloads is aot.MANAGER_WORKLOADS:
                r, labels = rec, [x for x, _ in aot.MANAGER_WORKLOADS]
            else:
                r, labels = aot.record(kernels, honour_do_not_specialize=honour, workloads=workloads), None
            per = r.per_kernel(labels)
            counts.append((sum(per.values()), max(per.values())))
        (w, wmax), (wo, womax) = counts
        print(f"| {label} | {w} | {wo} | {wmax} / {womax} |")
    sys.exit(1 if failed or unlaunched else 0)


if __name__ == "__main__":
    main()
