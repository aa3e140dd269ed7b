"""Host cost per scheduling step: the device manager against vLLM 0.8.5's
KVCacheManager (and gpukv's reference), same work, same process.

"Host cost" is what a step costs the CPU thread that calls the manager, with
the kernels' own time taken out: on a GPU that is the wall time of the call
(launches are asynchronous; the manager reads the device only when it must,
and a step that reads counts it in ``counters.d2h``); under Triton's
interpreter (no GPU) it is the wall time minus the time spent running kernels
on the host (``gpukv.kernels._common.kernel_seconds``: interpreted launches
and the host stand-in for the hashing kernel). What is left is Python, numpy
and torch glue. Caveat for CPU runs: a real GPU launch also costs host time
(Triton's launcher, a few microseconds each); here it is counted inside the
removed kernel time, so the CPU figure is the glue alone and the
``launches`` column says how many launches a GPU step adds.

Workloads (block size 16, one full-attention group):

* ``decode B``: B running requests (100-token prompts) each append one token,
  B = 1 .. 1024: the device manager's ``decode(rows, tokens)`` with the tokens
  in a device tensor (as a model runner has them), vLLM's
  ``allocate_slots(request, 1)`` per request, the reference's ``decode``;
* ``prefill``: a step admits 16 requests of 256 tokens sharing a 128-token
  prefix and frees the previous step's 16 (device and reference: one
  ``step``; vLLM: ``free`` + ``get_computed_blocks`` + ``allocate_slots``
  per request).

    PYTHONPATH=.:DIR DIR/venv/bin/python benchmarks/bench_host.py [--json out.json]

(DIR from ``../shared/tools/vllm085/setup.sh DIR``; without it the vLLM
column is skipped with a message.) p50 and p99 over the timed steps, after
warm-up steps that compile every kernel variant.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time

import numpy as np
import torch

import gpukv
from gpukv.kernels import _common
from gpukv.manager import KVCacheManager as DeviceManager
from gpukv.reference import KVCacheManager as ReferenceManager
from gpukv.request import NewRequest

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_cpu import VllmDriver, _vllm  # noqa: E402

BS = 16
VOCAB = 32000


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def host_ms(call, dev: torch.device | None = None) -> float:
    """Milliseconds the call costs the host, kernels taken out."""
    if dev is not None:
        _sync(dev)
    k0 = _common.kernel_seconds()
    t0 = time.perf_counter()
    call()
    wall = time.perf_counter() - t0
    return (wall - (_common.kernel_seconds() - k0)) * 1e3


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q))


# ------------------------------------------------------------------ decode
def decode_gpukv(kind: str, B: int, steps: int, warmup: int) -> tuple[list[float], dict]:
    rng = random.Random(B)
    kw = dict(hash_key=bytes(16), max_model_len=4096, max_num_reqs=B)
    m = DeviceManager(B * 24 + 8, BS, **kw) if kind == "device" else ReferenceManager(B * 24 + 8, BS, **kw)
    dev = getattr(m, "device", torch.device("cpu"))
    res = m.step(new=[NewRequest(f"d{i}", [rng.randrange(VOCAB) for _ in range(100)]) for i in range(B)])
    rows = np.array(res.rows, dtype=np.int64)
    times, counts = [], {}
    for s in range(warmup + steps):
        toks = torch.randint(0, VOCAB, (B,), device=dev) if kind == "device" else \
            np.random.randint(0, VOCAB, size=B)
        t = host_ms(lambda: m.decode(rows, toks), dev if kind == "device" else None)
        if s >= warmup:
            times.append(t)
    if kind == "device":
        _sync(dev)
        counts = _count(m, lambda: m.decode(rows, torch.randint(0, VOCAB, (B,), device=dev)))
    return times, counts


def decode_vllm(vllm_kv, B: int, steps: int, warmup: int) -> list[float]:
    rng = random.Random(B)
    d = VllmDriver(vllm_kv, num_blocks=B * 24 + 8, max_model_len=4096)
    rids = [f"d{i}" for i in range(B)]
    d.admit([(r, [rng.randrange(VOCAB) for _ in range(100)]) for r in rids])
    times = []
    for s in range(warmup + steps):
        toks = [rng.randrange(VOCAB) for _ in rids]
        t = host_ms(lambda: d.decode(rids, toks))
        if s >= warmup:
            times.append(t)
    return times


# ------------------------------------------------------------------ prefill
def _prefill_batches(steps: int, batch: int = 16, length: int = 256, shared: int = 128):
    rng = random.Random(1)
    prefix = [rng.randrange(VOCAB) for _ in range(shared)]
    return [[(f"p{s}.{i}", prefix + [rng.randrange(VOCAB) for _ in range(length - shared)]) for i in range(batch)]
            for s in range(steps)]


def prefill_gpukv(kind: str, steps: int, warmup: int) -> tuple[list[float], dict]:
    kw = dict(hash_key=bytes(16), max_model_len=4096, max_num_reqs=32)
    m = DeviceManager(8192, BS, **kw) if kind == "device" else ReferenceManager(8192, BS, **kw)
    dev = getattr(m, "device", None)
    times, prev, counts = [], [], {}
    batches = _prefill_batches(warmup + steps + 1)
    for s, batch in enumerate(batches[:-1]):
        new = [NewRequest(r, t) for r, t in batch]
        t = host_ms(lambda: m.step(finished=prev, new=new), dev)
        prev = [r for r, _ in batch]
        if s >= warmup:
            times.append(t)
    if kind == "device":
        counts = _count(m, lambda: m.step(finished=prev, new=[NewRequest(r, t) for r, t in batches[-1]]))
    return times, counts


def prefill_vllm(vllm_kv, steps: int, warmup: int) -> list[float]:
    d = VllmDriver(vllm_kv, num_blocks=8192, max_model_len=4096)
    times, prev = [], []
    for s, batch in enumerate(_prefill_batches(warmup + steps)):
        t = host_ms(lambda: d.admit(batch, finished=prev))
        prev = [r for r, _ in batch]
        if s >= warmup:
            times.append(t)
    return times


def _count(m, call) -> dict:
    """One more step with torch kernels counted too (a separate pass: the
    counting hook costs host time itself)."""
    m.counters.count_torch_ops = True
    try:
        call()
    finally:
        m.counters.count_torch_ops = False
    return m.counters.as_dict()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--batches", type=int, nargs="*", default=[1, 4, 16, 64, 256, 1024], help="decode batch sizes")
    p.add_argument("--steps", type=int, default=30, help="timed steps per workload")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (compiles every variant)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    vllm_kv = _vllm()
    dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    where = torch.cuda.get_device_name() if dev.type == "cuda" else f"CPU ({platform.machine()}), Triton interpreter"
    rows = []
    work = [(f"decode B={B}", "decode", B) for B in args.batches] + [("prefill 16x256 (128 shared)", "prefill", 0)]
    for label, kind, B in work:
        if kind == "decode":
            dv, counts = decode_gpukv("device", B, args.steps, args.warmup)
            rf, _ = decode_gpukv("reference", B, args.steps, args.warmup)
            vl = decode_vllm(vllm_kv, B, args.steps, args.warmup) if vllm_kv else None
        else:
            dv, counts = prefill_gpukv("device", args.steps, args.warmup)
            rf, _ = prefill_gpukv("reference", args.steps, args.warmup)
            vl = prefill_vllm(vllm_kv, args.steps, args.warmup) if vllm_kv else None
        row = {"work": label, "batch": B, "device_p50_ms": pct(dv, 50), "device_p99_ms": pct(dv, 99),
               "reference_p50_ms": pct(rf, 50), "counters": counts}
        if vl:
            row.update(vllm_p50_ms=pct(vl, 50), vllm_p99_ms=pct(vl, 99), ratio_p50=pct(dv, 50) / pct(vl, 50))
        rows.append(row)
        print(f"  {label}: device {row['device_p50_ms']:.3f} ms"
              + (f", vLLM {row['vllm_p50_ms']:.3f} ms, ratio {row['ratio_p50']:.2f}x" if vl else ""),
              file=sys.stderr)
    print(f"Host cost per step, kernels excluded ({where}; gpukv {gpukv.__version__}, torch {torch.__version__}, "
          f"vLLM {getattr(vllm_kv, 'VLLM_VERSION', 'not importable')}); p50 (p99) ms over {args.steps} steps")
    print("| work | vLLM 0.8.5 | device manager | ratio device/vLLM | reference | launches | torch ops | H2D | D2H |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        c = r["counters"]
        v = f"{r['vllm_p50_ms']:.3f} ({r['vllm_p99_ms']:.3f})" if "vllm_p50_ms" in r else "-"
        q = f"{r['ratio_p50']:.2f}x" if "ratio_p50" in r else "-"
        print(f"| {r['work']} | {v} | {r['device_p50_ms']:.3f} ({r['device_p99_ms']:.3f}) | {q} | "
              f"{r['reference_p50_ms']:.3f} | {c.get('launches', '-')} | {c.get('torch_ops', '-')} | "
              f"{c.get('h2d', '-')} | {c.get('d2h', '-')} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"where": where, "gpukv": gpukv.__version__, "torch": torch.__version__,
                       "vllm": getattr(vllm_kv, "VLLM_VERSION", None), "python": sys.version.split()[0],
                       "steps": args.steps, "warmup": args.warmup, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
