"""Manager time per scheduling step: the device manager against the reference.

A serving-like loop: ``--running`` requests decode one token per step, and
every step ``--new`` requests arrive that share a few long system prompts, so
lookups hit. Both managers get the same steps; we report the mean and p50
manager time per step of each, measured side by side in one run, their ratio,
and the device manager's kernel launches and host reads per step.

    PYTHONPATH=. python benchmarks/bench_step.py --steps 50 --running 256 --new 16

On a machine without CUDA the device manager runs under Triton's interpreter,
which says nothing about GPU speed; use small sizes there (the defaults are
sized for a GPU).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from gpukv import _runtime  # noqa: F401  (sets TRITON_INTERPRET before triton loads)
from gpukv.core.requests import NewRequest, RunningUpdate
from gpukv.device.manager import DeviceManager
from gpukv.reference.manager import ReferenceManager


def workload(args, rng):
    prompts = [[rng.randrange(32000) for _ in range(args.prompt_len)] for _ in range(4)]
    counter = 0
    running: list[str] = []
    for _step in range(args.steps + args.warmup):
        finished = running[: max(0, len(running) - args.running)]
        running = running[len(finished):]
        decode = [RunningUpdate(rid, [rng.randrange(32000)]) for rid in running]
        new = []
        for _ in range(args.new):
            base = rng.choice(prompts)
            tail = [rng.randrange(32000) for _ in range(rng.randint(1, args.prompt_len // 4))]
            new.append(NewRequest(f"r{counter}", base + tail))
            counter += 1
        yield finished, decode, new
        running += [r.request_id for r in new]


def run(manager, args, sync):
    rng = random.Random(args.seed)
    times = []
    launches = []
    syncs = []
    for i, (finished, decode, new) in enumerate(workload(args, rng)):
        sync()
        t = time.perf_counter()
        res = manager.step(finished, decode, new)
        sync()
        dt = time.perf_counter() - t
        if not res.ok or res.num_admitted != len(new):
            raise SystemExit(f"step {i}: the pool is too small for this workload (raise --num-blocks)")
        if i >= args.warmup:
            times.append(dt * 1e3)
            if hasattr(manager, "counters"):
                launches.append(manager.counters.launches)
                syncs.append(manager.counters.syncs)
    return times, launches, syncs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--running", type=int, default=256)
    p.add_argument("--new", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=65536)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    max_len = args.prompt_len * 2 + args.steps + args.warmup + 8
    ref = ReferenceManager(args.num_blocks, args.block_size, hash_key=bytes(16))
    dev = DeviceManager(args.num_blocks, args.block_size, hash_key=bytes(16), max_model_len=max_len)
    sync = torch.cuda.synchronize if dev.device.type == "cuda" else (lambda: None)
    t_ref, _, _ = run(ref, args, lambda: None)
    t_dev, launches, syncs = run(dev, args, sync)
    where = torch.cuda.get_device_name() if dev.device.type == "cuda" else "CPU, Triton interpreter"
    out = {
        "device": where,
        "steps": args.steps, "running": args.running, "new_per_step": args.new, "prompt_len": args.prompt_len,
        "reference_ms_mean": statistics.mean(t_ref), "reference_ms_p50": statistics.median(t_ref),
        "device_ms_mean": statistics.mean(t_dev), "device_ms_p50": statistics.median(t_dev),
        "speedup_mean": statistics.mean(t_ref) / statistics.mean(t_dev),
        "launches_per_step": statistics.mean(launches), "host_reads_per_step": statistics.mean(syncs),
    }
    print(f"step benchmark on {where}: {args.running} running + {args.new} new/step, prompts of {args.prompt_len}")
    print(f"  reference  mean {out['reference_ms_mean']:.3f} ms  p50 {out['reference_ms_p50']:.3f} ms")
    print(f"  device     mean {out['device_ms_mean']:.3f} ms  p50 {out['device_ms_p50']:.3f} ms")
    print(f"  ratio (reference / device): {out['speedup_mean']:.2f}x; device launches/step "
          f"{out['launches_per_step']:.1f}, host reads/step {out['host_reads_per_step']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
