"""Block-hashing throughput: the host scheme (gpukv.core.hashing, keyed BLAKE3 via
the ``blake3`` package) and the device kernel (gpukv.kernels.block_hash).

Cases (block size ``--block-size``, default 16):

* single: one request of ``--single-tokens`` (2,048) tokens, a Python list,
  hashed by ``hash_block_chain`` (what admitting one request costs);
* batch: ``--batch`` (256) requests of ``--batch-tokens`` (256) tokens, lists,
  hashed by ``hash_requests``; and the same as int32 arrays (no list intake);
* blocks: the batch's blocks as independent (parent, tokens, extra) rows,
  hashed by ``block_digests_lanes`` (one block position of many requests).

Each host figure is the best of ``--repeat`` timed runs (wall clock; on a
shared machine the best run is the one least disturbed), as microseconds per
block and million tokens per second. ``--old-rev REV`` also times
``gpukv/core/hashing.py`` as of git revision REV (e.g. the last SipHash one) on the
same inputs, loaded into a temporary module, for a before/after table.

The device rows need CUDA: the chained kernel over the single request and over
the batch, timed with CUDA events after a warm-up (compilation excluded).
Without CUDA they are skipped with a message (Triton's interpreter says
nothing about GPU speed).

    PYTHONPATH=. python benchmarks/bench_hashing.py [--old-rev REV] [--json out.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from gpukv import _runtime
from gpukv.core import hashing

REPO = Path(__file__).resolve().parents[1]


def best_seconds(fn, repeat: int, min_time: float = 0.05) -> float:
    """The best time of one call of ``fn`` over ``repeat`` runs, each run
    looping long enough (``min_time``) for the clock."""
    fn()  # warm caches (keyed hasher, imports)
    number = 1
    while True:
        t = time.perf_counter()
        for _ in range(number):
            fn()
        if time.perf_counter() - t >= min_time or number >= 1 << 20:
            break
        number *= 2
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        for _ in range(number):
            fn()
        best = min(best, (time.perf_counter() - t) / number)
    return best


def load_old_module(rev: str):
    """gpukv/core/hashing.py as of git revision ``rev`` (gpukv/hashing.py in a
    revision from before the layers' folders), as a standalone module."""
    shown = [subprocess.run(["git", "show", f"{rev}:{where}"], cwd=REPO, capture_output=True, text=True)
             for where in ("gpukv/core/hashing.py", "gpukv/hashing.py")]
    found = [proc.stdout for proc in shown if proc.returncode == 0]
    if not found:
        raise SystemExit(f"--old-rev {rev}: no gpukv/core/hashing.py nor gpukv/hashing.py there "
                         f"({shown[-1].stderr.strip()})")
    src = found[0]
    path = Path(tempfile.mkdtemp()) / "gpukv_hashing_old.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("gpukv_hashing_old", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def host_rows(mod, label: str, args, key, single, batch) -> list[dict]:
    bs = args.block_size
    rows = []
    n_single = len(single) // bs
    t = best_seconds(lambda: mod.hash_block_chain(key, single, bs), args.repeat)
    rows.append(dict(case=f"single {len(single)} tokens", impl=label, blocks=n_single, seconds=t))
    n_batch = sum(len(t) // bs for t in batch)
    t = best_seconds(lambda: mod.hash_requests(key, batch, bs), args.repeat)
    rows.append(dict(case=f"batch {len(batch)} x {len(batch[0])} tokens", impl=label, blocks=n_batch, seconds=t))
    arrays = [np.asarray(t, dtype=np.int32) for t in batch]
    t = best_seconds(lambda: mod.hash_requests(key, arrays, bs), args.repeat)
    rows.append(dict(case="batch, int32 arrays", impl=label, blocks=n_batch, seconds=t))
    toks = np.array([t[i * bs:(i + 1) * bs] for t in batch for i in range(len(t) // bs)], dtype=np.int64)
    rng = np.random.default_rng(args.seed)
    parents = rng.integers(0, 2**63, size=(len(toks), 2), dtype=np.int64).astype(np.uint64)
    extras = np.zeros((len(toks), 2), dtype=np.uint64)
    t = best_seconds(lambda: mod.block_digests_lanes(key, parents, toks, extras), args.repeat)
    rows.append(dict(case=f"blocks {len(toks)} independent", impl=label, blocks=len(toks), seconds=t))
    return rows


def device_rows(args, key, single, batch) -> list[dict]:
    import torch

    from gpukv.kernels import block_hash as kb

    bs = args.block_size
    dev = torch.device("cuda")
    k = kb.key_lanes(key, dev)
    root = hashing.digests_to_lanes([hashing.root_digest(key)]).view(np.int64)
    rows = []
    for case, reqs in ((f"single {len(single)} tokens", [single]),
                       (f"batch {len(batch)} x {len(batch[0])} tokens", batch)):
        width = max(len(t) for t in reqs)
        toks = np.zeros((len(reqs), width), dtype=np.int64)
        for r, t in enumerate(reqs):
            toks[r, : len(t)] = t
        tokens = torch.tensor(toks.astype(np.uint32).view(np.int32), device=dev)
        counts = torch.tensor([len(t) // bs for t in reqs], dtype=torch.int32, device=dev)
        parents = torch.tensor(np.repeat(root, len(reqs), axis=0), device=dev)
        out = kb.hash_block_chains(k, parents, tokens, counts, block_size=bs)  # compile, warm up
        torch.cuda.synchronize()
        # Bit-identical to the host before timing it.
        want = [hashing.hash_block_chain(key, t, bs) for t in reqs[:4]]
        got = [hashing.lanes_to_digests(out[r, : len(w)].cpu().numpy()) for r, w in enumerate(want)]
        assert got == want, "device digests differ from the host's"
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        best = float("inf")
        for _ in range(args.repeat):
            start.record()
            for _ in range(args.device_iters):
                kb.hash_block_chains(k, parents, tokens, counts, out=out, block_size=bs)
            end.record()
            torch.cuda.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3 / args.device_iters)
        rows.append(dict(case=case, impl="device BLAKE3 (Triton)", blocks=int(counts.sum()), seconds=best))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--single-tokens", type=int, default=2048)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--batch-tokens", type=int, default=256)
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--device-iters", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--old-rev", help="also time gpukv/core/hashing.py as of this git revision")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)

    rng = np.random.default_rng(args.seed)
    key = hashing.resolve_hash_key(bytes(rng.integers(0, 256, 16, dtype=np.uint8)))
    single = rng.integers(0, 128_000, args.single_tokens).tolist()
    batch = [rng.integers(0, 128_000, args.batch_tokens).tolist() for _ in range(args.batch)]

    rows = host_rows(hashing, "host BLAKE3 (blake3 package)", args, key, single, batch)
    if args.old_rev:
        old = load_old_module(args.old_rev)
        rows += host_rows(old, f"host {args.old_rev} (old hashing.py)", args, key, single, batch)
    if _runtime.CUDA_AVAILABLE:
        rows += device_rows(args, key, single, batch)
        device_note = None
    else:
        device_note = "device rows skipped: no CUDA (the interpreter's speed says nothing about a GPU's)"

    bs = args.block_size
    print(f"block hashing, block size {bs}, best of {args.repeat} runs "
          f"(python {sys.version.split()[0]}, {os.cpu_count()} CPUs)")
    print(f"{'case':<28} {'implementation':<34} {'us/block':>10} {'Mtokens/s':>10}")
    for r in rows:
        r["us_per_block"] = r["seconds"] / r["blocks"] * 1e6
        r["mtokens_per_s"] = r["blocks"] * bs / r["seconds"] / 1e6
        print(f"{r['case']:<28} {r['impl']:<34} {r['us_per_block']:>10.3f} {r['mtokens_per_s']:>10.2f}")
    if device_note:
        print(device_note)
    single_new = rows[0]["us_per_block"]
    print(f"single request: {single_new:.3f} us per {bs}-token block "
          f"({'within' if single_new <= 1.0 else 'OVER'} the 1 us target)")
    if args.json:
        Path(args.json).write_text(json.dumps({"block_size": bs, "rows": rows, "device_note": device_note},
                                              indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
