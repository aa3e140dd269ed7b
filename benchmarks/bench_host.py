"""Host cost per scheduling step: the device manager against vLLM 0.8.5's
KVCacheManager (and gpukv's reference), same work, same process.

"Host cost" is what a step costs the CPU thread that calls the manager, with
the kernels' own time taken out. On a GPU that is the wall time of the call
(launches are asynchronous; the manager reads the device only when it must,
and a step that reads counts it in ``counters.d2h``). Under Triton's
interpreter (no GPU) the kernels run on the host:

* decode: the benchmark runs two managers on the same calls: the
  real one, whose device reads (``_read``) are recorded, and a twin timed
  with the kernel bodies skipped (``gpukv.kernels._common.
  kernel_bodies_skipped``: each launch still goes through Triton's launch
  path and its hooks) whose reads return the real one's values. The host
  learns the device's state only through those reads, and the decode's host
  path never indexes with a device result, so the twin does exactly the host
  work of the real step (checked: both return the same results); its wall
  time minus the interpreter's own launch path (``kernel_seconds``) is the
  host cost.
* prefill and churn: the same twin (their host path, like the decode's,
  never indexes with a device result: every entry after the plan's one
  upload is derived on the device, ``gpukv.kernels.prefill``).

What is left is Python, numpy and torch glue. A real GPU launch also costs
host time in Triton's launcher; on a CPU it is outside the figure, and the
``launches`` column says how many a GPU step adds.

Workloads (block size 16, one full-attention group):

* ``decode B``: B running requests (100-token prompts) each append one token,
  B = 1 .. 1024: the device manager's ``decode(rows, tokens)`` with the tokens
  in a device tensor (as a model runner has them), vLLM's
  ``allocate_slots(request, 1)`` per request, the reference's ``decode``;
* ``prefill``: a step admits 16 requests of 256 tokens sharing a 128-token
  prefix and frees the previous step's 16 (device and reference: one
  ``step``; vLLM: ``free`` + ``get_computed_blocks`` + ``allocate_slots``
  per request);
* ``churn``: 8 new 1,024-token requests a step into a pool full of cached
  blocks (every allocation evicts), the previous step's 8 freed.

On a GPU the table also gives each step's GPU time (CUDA events around the
call, read after the host time is taken; eager launches, not a graph).

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


def host_ms(call, dev: torch.device | None = None, gpu_ms: list | None = None) -> float:
    """Milliseconds the call costs the host, kernels taken out. On CUDA,
    ``gpu_ms`` (when given) also gets the GPU time of the call's work, from
    CUDA events around it (read after the host time is taken)."""
    cuda = dev is not None and dev.type == "cuda"
    if dev is not None:
        _sync(dev)
    if cuda and gpu_ms is not None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    k0 = _common.kernel_seconds()
    t0 = time.perf_counter()
    call()
    wall = time.perf_counter() - t0
    if cuda and gpu_ms is not None:
        end.record()
        end.synchronize()
        gpu_ms.append(start.elapsed_time(end))
    return (wall - (_common.kernel_seconds() - k0)) * 1e3


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q))


# ------------------------------------------------------------------ decode
class Twin:
    """A manager, and on the interpreter its timing twin (module docstring):
    ``run`` makes a list of calls on the real manager first, recording its
    device reads, then times the same calls on the twin back to back, its
    kernels skipped and its reads answered from the record (back to back, so
    the host code runs warm, as vLLM's manager does in its own loop)."""

    def __init__(self, make):
        self.real = make()
        self.dev = self.real.device
        self.twin = make() if self.dev.type != "cuda" else None
        self.gpu_ms: list[float] = []  # on CUDA: each timed call's GPU time
        self._reads: list = []
        if self.twin is not None:
            real_read, twin_counters = self.real._read, self.twin.counters

            def recording(t, _read=real_read):
                out = _read(t)
                self._reads.append(out)
                return out

            def replaying(_t):  # stands in for _read(t): the answer comes from the record
                twin_counters.d2h += 1
                return self._reads.pop(0)

            self.real._read, self.twin._read = recording, replaying

    def setup(self, method: str, *args) -> None:
        """An untimed call on both, kernels running (to build the same state)."""
        for m in (self.real, self.twin) if self.twin is not None else (self.real,):
            getattr(m, method)(*args)
        self._reads.clear()

    def run(self, method: str, calls: list[tuple]) -> list[float]:
        """Host milliseconds of each call (``calls``: argument tuples)."""
        if self.twin is None:
            return [host_ms(lambda a=a: getattr(self.real, method)(*a), self.dev, self.gpu_ms) for a in calls]
        expect = [getattr(self.real, method)(*a) for a in calls]
        times, got = [], []
        with _common.kernel_bodies_skipped():
            for a in calls:
                times.append(host_ms(lambda a=a: got.append(getattr(self.twin, method)(*a))))
        if got != expect or self._reads:
            raise SystemExit(f"the timing twin diverged on {method}")
        return times

    @property
    def counted(self):
        return self.twin if self.twin is not None else self.real


def decode_gpukv(kind: str, B: int, steps: int, warmup: int) -> tuple[list[float], dict]:
    rng = random.Random(B)
    kw = dict(hash_key=bytes(16), max_model_len=4096, max_num_reqs=B)
    new = [NewRequest(f"d{i}", [rng.randrange(VOCAB) for _ in range(100)]) for i in range(B)]
    rows = np.arange(B, dtype=np.int64)  # rows are handed out from 0
    if kind == "reference":
        m = ReferenceManager(B * 24 + 8, BS, **kw)
        m.step(new=new)
        times = [host_ms(lambda: m.decode(rows, np.random.randint(0, VOCAB, size=B)))
                 for _ in range(warmup + steps)]
        return times[warmup:], {}
    m = Twin(lambda: DeviceManager(B * 24 + 8, BS, **kw))
    m.setup("step", (), (), new)
    toks = [(rows, torch.randint(0, VOCAB, (B,), device=m.dev)) for _ in range(warmup + steps + 1)]
    for a in toks[:warmup]:  # kernels run on both (and compile, on a GPU)
        m.setup("decode", *a)
    times = m.run("decode", toks[warmup:-1])
    _sync(m.dev)
    return times, dict(_count(m, "decode", *toks[-1]), gpu_ms=m.gpu_ms)


def decode_vllm(vllm_kv, B: int, steps: int, warmup: int) -> list[float]:
    rng = random.Random(B)
    d = VllmDriver(vllm_kv, num_blocks=B * 24 + 8, max_model_len=4096)
    rids = [f"d{i}" for i in range(B)]
    d.admit([(r, [rng.randrange(VOCAB) for _ in range(100)]) for r in rids])
    times = []
    for s in range(warmup + steps):
        toks = [rng.randrange(VOCAB) for _ in rids]
        t = host_ms(lambda toks=toks: d.decode(rids, toks))
        if s >= warmup:
            times.append(t)
    return times


# ------------------------------------------------------------------ prefill
def _prefill_batches(steps: int, batch: int = 16, length: int = 256, shared: int = 128):
    rng = random.Random(1)
    prefix = [rng.randrange(VOCAB) for _ in range(shared)]
    return [[(f"p{s}.{i}", prefix + [rng.randrange(VOCAB) for _ in range(length - shared)]) for i in range(batch)]
            for s in range(steps)]


def _prefill_steps(steps: int, batch_size: int = 16) -> list[tuple[list, list]]:
    """(finished, new) per step: ``batch_size`` requests of 256 tokens sharing
    a 128-token prefix, the previous step's finished."""
    out, prev = [], []
    for batch in _prefill_batches(steps, batch_size):
        out.append((prev, batch))
        prev = [r for r, _ in batch]
    return out


CHURN_BATCH, CHURN_LEN = 8, 1024


def _churn_steps(steps: int) -> list[tuple[list, list]]:
    """(finished, new) per step: 8 new 1,024-token requests into a pool full of
    cached blocks (every allocation evicts), the previous step's 8 finished;
    the first 4 steps fill the pool."""
    rng = random.Random(3)
    out, prev = [], []
    for s in range(steps + 4):
        batch = [(f"c{s}.{i}", [rng.randrange(VOCAB) for _ in range(CHURN_LEN)]) for i in range(CHURN_BATCH)]
        out.append((prev, batch))
        prev = [r for r, _ in batch]
    return out


STEP_WORKLOADS = {  # name: (steps builder, pool blocks, untimed leading steps)
    "prefill": (_prefill_steps, 8192, 0),
    "churn": (_churn_steps, 4 * CHURN_BATCH * CHURN_LEN // BS + 1, 4),
}


def steps_gpukv(kind: str, work: str, steps: int, warmup: int, batch: int = 16) -> tuple[list[float], dict]:
    build, num_blocks, fill = STEP_WORKLOADS[work]
    kw = dict(hash_key=bytes(16), max_model_len=4096, max_num_reqs=max(32, 2 * batch))
    plan = build(warmup + steps + 1, batch) if work == "prefill" else build(warmup + steps + 1)
    calls = [(finished, (), [NewRequest(r, t) for r, t in b]) for finished, b in plan]
    if kind == "reference":
        m = ReferenceManager(num_blocks, BS, **kw)
        times = [host_ms(lambda a=a: m.step(*a)) for a in calls[:-1]]
        return times[fill + warmup:], {}
    m = Twin(lambda: DeviceManager(num_blocks, BS, **kw))
    for a in calls[: fill + warmup]:  # kernels run on both (and compile, on a GPU)
        m.setup("step", *a)
    times = m.run("step", calls[fill + warmup: -1])
    _sync(m.dev)
    return times, dict(_count(m, "step", *calls[-1]), gpu_ms=m.gpu_ms)


def steps_vllm(vllm_kv, work: str, steps: int, warmup: int, batch_size: int = 16) -> list[float]:
    build, num_blocks, fill = STEP_WORKLOADS[work]
    d = VllmDriver(vllm_kv, num_blocks=num_blocks, max_model_len=4096)
    times = []
    plan = build(warmup + steps, batch_size) if work == "prefill" else build(warmup + steps)
    for s, (finished, batch) in enumerate(plan):
        t = host_ms(lambda batch=batch, finished=finished: d.admit(batch, finished=finished))
        if s >= fill + warmup:
            times.append(t)
    return times


def _count_one(m, method: str, *args) -> dict:
    """One more call with torch kernels counted too (a separate pass: the
    counting hook costs host time itself)."""
    m.counters.count_torch_ops = True
    try:
        getattr(m, method)(*args)
    finally:
        m.counters.count_torch_ops = False
    return m.counters.as_dict()


def _count(m: Twin, method: str, *args) -> dict:
    if m.twin is None:
        return _count_one(m.real, method, *args)
    m.twin.counters.count_torch_ops = True
    try:
        m.run(method, [args])
    finally:
        m.twin.counters.count_torch_ops = False
    return m.twin.counters.as_dict()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--batches", type=int, nargs="*", default=[1, 4, 16, 64, 256, 1024], help="decode batch sizes")
    p.add_argument("--prefill-batches", type=int, nargs="*", default=[1, 4, 16, 64],
                   help="new requests per prefill step (16 is the issue's target; larger ones take minutes a step "
                        "under the interpreter)")
    p.add_argument("--steps", type=int, default=30, help="timed steps per workload")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (compiles every variant)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    vllm_kv = _vllm()
    dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    where = torch.cuda.get_device_name() if dev.type == "cuda" else f"CPU ({platform.machine()}), Triton interpreter"
    rows = []
    work = [(f"decode B={B}", "decode", B) for B in args.batches]
    work += [(f"prefill {B}x256 (128 shared)", "prefill", B) for B in args.prefill_batches]
    work += [("churn 8x1024 into a full pool", "churn", 0)]
    for label, kind, B in work:
        if kind == "decode":
            dv, counts = decode_gpukv("device", B, args.steps, args.warmup)
            rf, _ = decode_gpukv("reference", B, args.steps, args.warmup)
            vl = decode_vllm(vllm_kv, B, args.steps, args.warmup) if vllm_kv else None
        else:
            dv, counts = steps_gpukv("device", kind, args.steps, args.warmup, B or 16)
            rf, _ = steps_gpukv("reference", kind, args.steps, args.warmup, B or 16)
            vl = steps_vllm(vllm_kv, kind, args.steps, args.warmup, B or 16) if vllm_kv else None
        gpu = counts.pop("gpu_ms", [])
        row = {"work": label, "batch": B, "device_p50_ms": pct(dv, 50), "device_p99_ms": pct(dv, 99),
               "reference_p50_ms": pct(rf, 50), "counters": counts}
        if gpu:
            row.update(gpu_p50_ms=pct(gpu, 50), gpu_p99_ms=pct(gpu, 99))
        if vl:
            row.update(vllm_p50_ms=pct(vl, 50), vllm_p99_ms=pct(vl, 99), ratio_p50=pct(dv, 50) / pct(vl, 50))
        rows.append(row)
        print(f"  {label}: device {row['device_p50_ms']:.3f} ms"
              + (f", vLLM {row['vllm_p50_ms']:.3f} ms, ratio {row['ratio_p50']:.2f}x" if vl else ""),
              file=sys.stderr)
    print(f"Host cost per step, kernels excluded ({where}; gpukv {gpukv.__version__}, torch {torch.__version__}, "
          f"vLLM {getattr(vllm_kv, 'VLLM_VERSION', 'not importable')}); p50 (p99) ms over {args.steps} steps")
    print("| work | vLLM 0.8.5 | device manager | ratio device/vLLM | reference | launches | torch ops | H2D | D2H "
          "| GPU time |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        c = r["counters"]
        v = f"{r['vllm_p50_ms']:.3f} ({r['vllm_p99_ms']:.3f})" if "vllm_p50_ms" in r else "-"
        q = f"{r['ratio_p50']:.2f}x" if "ratio_p50" in r else "-"
        g = f"{r['gpu_p50_ms']:.3f} ({r['gpu_p99_ms']:.3f})" if "gpu_p50_ms" in r else "-"
        print(f"| {r['work']} | {v} | {r['device_p50_ms']:.3f} ({r['device_p99_ms']:.3f}) | {q} | "
              f"{r['reference_p50_ms']:.3f} | {c.get('launches', '-')} | {c.get('torch_ops', '-')} | "
              f"{c.get('h2d', '-')} | {c.get('d2h', '-')} | {g} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"where": where, "gpukv": gpukv.__version__, "torch": torch.__version__,
                       "vllm": getattr(vllm_kv, "VLLM_VERSION", None), "python": sys.version.split()[0],
                       "steps": args.steps, "warmup": args.warmup, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
