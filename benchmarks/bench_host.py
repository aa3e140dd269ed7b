"""Host cost per scheduling step: the device manager against vLLM 0.8.5's
KVCacheManager (and gpukv's reference), same work, same process.

"Host cost" is what a step costs the CPU thread that calls the manager, with
the kernels' own time taken out. On a GPU that is the wall time of the call
(launches are asynchronous; the manager reads the device only when it must,
and a step that reads counts it in ``counters.d2h``). Under Triton's
interpreter (no GPU) the kernels run on the host:

* decode: the benchmark runs two managers on the same calls: the
  real one, whose device reads (``_read``) are recorded, and a twin timed
  with the kernel bodies skipped (``gpukv.kernels.capture.
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

What is left is Python, numpy and torch glue: the "device manager"
column. A real GPU launch also costs host time in Triton's launch path
(``JITFunction.run``: hooks, argument binding, the specialisation key, the
kernel-cache lookup; the launcher; the driver call), which the interpreter
does not run. ``benchmarks/launch_cost.py`` measures it: the counted pass
records every launch the real step makes, and a child process with the
interpreter off replays each through Triton's real ``JITFunction.run`` and
C launcher, compiled for sm_90 and linked against a stub CUDA driver whose
``cuLaunchKernelEx`` does nothing (what is and is not included: that
module's docstring). So, per step:

* ``eager``: the twin's figure plus the launch path of every launch of the
  step (step i of the twin plus sample i of the launch path, back to back):
  a launch the manager replays through its compiled launcher, any other
  (a free's release, the table's rebuild) through ``JITFunction.run``, as
  each goes on a GPU (the table's "launches" column counts those);
* ``replayed`` (``gpukv.device.graphs.DecodeGraphs`` replays a decode bucket's
  launches as one CUDA graph, ``AdmissionGraphs`` an admission's as two):
  the twin's figure plus the graph launches, counted as 0 here
  (``cudaGraphLaunch`` cannot run without a GPU; the twin still counts the
  replayed launches' hooks, a slight over-estimate).

On a GPU the figures are measured directly: ``eager`` is the wall time of
``decode``/``step``, ``replayed`` that of ``DecodeGraphs.decode``, each with
its GPU time from CUDA events; ``--twin-check`` also runs the benchmark
with CUDA hidden (the twin, on the same host) and prints real / twin per
row. (Not run yet: no GPU was lent to the session that wrote it.)

Workloads (block size 16, one full-attention group):

* ``decode B``: B running requests (prompts of 100 to 115 tokens, staggered:
  ``prompt_len``) each append one token,
  B = 1 .. 1024: the device manager's ``decode(rows, tokens)`` with the tokens
  in a device tensor (as a model runner has them), vLLM's
  ``allocate_slots(request, 1)`` per request, the reference's ``decode``;
  in a pool of 24 blocks a request, or of ``--decode-pool-blocks`` (a row
  per size), with prompts from ``--decode-prompt-len`` (a row per length)
  to 15 more: whether the host's cost stays flat in both;
* ``prefill``: a step admits 16 requests of 256 tokens sharing a 128-token
  prefix and frees the previous step's 16 (device and reference: one
  ``step``; vLLM: ``free`` + ``get_computed_blocks`` + ``allocate_slots``
  per request);
* ``churn``: 8 new 1,024-token requests a step into a pool full of cached
  blocks (every allocation evicts), the previous step's 8 freed.

On a GPU the table also gives each step's GPU time (CUDA events around the
call, read after the host time is taken).

    PYTHONPATH=.:DIR DIR/venv/bin/python benchmarks/bench_host.py [--repeats 3] [--json out.json]

(DIR from ``../shared/tools/vllm085/setup.sh DIR``; without it the vLLM
column is skipped with a message.) p50 and p99 over the timed steps, after
warm-up steps that compile every kernel variant; each workload runs
``--repeats`` times with fresh managers (vLLM's alongside, in the same
process), and a figure is the median of the repeats' p50 (p99), a ratio
the median of the repeats' ratios (their range in the JSON).
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
from gpukv.core.requests import NewRequest
from gpukv.device.manager import DeviceManager
from gpukv.kernels import capture
from gpukv.reference.manager import ReferenceManager

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import launch_cost  # noqa: E402
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
    k0 = capture.kernel_seconds()
    t0 = time.perf_counter()
    call()
    wall = time.perf_counter() - t0
    if cuda and gpu_ms is not None:
        end.record()
        end.synchronize()
        gpu_ms.append(start.elapsed_time(end))
    return (wall - (capture.kernel_seconds() - k0)) * 1e3


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
        with capture.kernel_bodies_skipped():
            for a in calls:
                times.append(host_ms(lambda a=a: got.append(getattr(self.twin, method)(*a))))
        if got != expect or self._reads:
            raise SystemExit(f"the timing twin diverged on {method}")
        return times

    @property
    def counted(self):
        return self.twin if self.twin is not None else self.real


#: Shortest prompt of the decode workloads (``--decode-prompt-len``).
PROMPT_LEN = 100


def prompt_len(i: int, shortest: int = PROMPT_LEN) -> int:
    """Request i's prompt in the decode workloads: 100 to 115 tokens by
    default, so that from B = 16 on, every step some rows need a new block
    and some fill one (every phase of the step runs, as in a serving batch),
    not all at once."""
    return shortest + i % BS


def decode_pool_blocks(B: int, pool: int | None) -> int:
    """The decode workloads' pool: ``pool`` blocks, or by default room for
    every request's prompt and steps with blocks to spare."""
    return B * 24 + 8 if pool is None else pool


def decode_gpukv(kind: str, B: int, steps: int, warmup: int, pool: int | None = None,
                 shortest: int = PROMPT_LEN) -> tuple[list[float], dict]:
    """Host ms per decode step (``kind``: "device", "reference", or on CUDA
    "graphs": the device manager through ``gpukv.device.graphs.DecodeGraphs``)."""
    rng = random.Random(B)
    kw = dict(hash_key=bytes(16), max_model_len=4096, max_num_reqs=B)
    new = [NewRequest(f"d{i}", [rng.randrange(VOCAB) for _ in range(prompt_len(i, shortest))]) for i in range(B)]
    rows = np.arange(B, dtype=np.int64)  # rows are handed out from 0
    num_blocks = decode_pool_blocks(B, pool)
    if kind == "reference":
        m = ReferenceManager(num_blocks, BS, **kw)
        m.step(new=new)
        times = [host_ms(lambda: m.decode(rows, np.random.randint(0, VOCAB, size=B)))
                 for _ in range(warmup + steps)]
        return times[warmup:], {}
    if kind == "graphs":
        return _decode_graphs(B, steps, warmup, kw, new, rows, num_blocks)
    m = Twin(lambda: DeviceManager(num_blocks, BS, **kw))
    m.setup("step", (), (), new)
    toks = [(rows, torch.randint(0, VOCAB, (B,), device=m.dev)) for _ in range(warmup + steps + 1)]
    for a in toks[:warmup]:  # kernels run on both (and compile, on a GPU)
        m.setup("decode", *a)
    times = m.run("decode", toks[warmup:-1])
    _sync(m.dev)
    return times, dict(_count(m, "decode", *toks[-1]), gpu_ms=m.gpu_ms)


def _decode_graphs(B: int, steps: int, warmup: int, kw: dict, new: list, rows,
                   num_blocks: int) -> tuple[list[float], dict]:
    """On CUDA: the decode replayed as one CUDA graph per bucket (the first
    step of the bucket captures it, in the warm-up)."""
    from gpukv.device.graphs import DecodeGraphs

    m = DeviceManager(num_blocks, BS, **kw)
    m.step(new=new)
    graphs = DecodeGraphs(m)
    toks = [torch.randint(0, VOCAB, (B,), device=m.device) for _ in range(warmup + steps)]
    for t in toks[:warmup]:
        graphs.decode(rows, t)
    gpu_ms: list[float] = []
    times = [host_ms(lambda t=t: graphs.decode(rows, t), m.device, gpu_ms) for t in toks[warmup:]]
    _sync(m.device)
    return times, dict(m.counters.as_dict(), gpu_ms=gpu_ms, graph_replays=graphs.replays)


def decode_vllm(vllm_kv, B: int, steps: int, warmup: int, pool: int | None = None,
                shortest: int = PROMPT_LEN) -> list[float]:
    rng = random.Random(B)
    d = VllmDriver(vllm_kv, num_blocks=decode_pool_blocks(B, pool), max_model_len=4096)
    rids = [f"d{i}" for i in range(B)]
    d.admit([(r, [rng.randrange(VOCAB) for _ in range(prompt_len(i, shortest))]) for i, r in enumerate(rids)])
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
    if kind == "graphs":  # on CUDA: the admissions replayed as CUDA graphs
        from gpukv.device.graphs import AdmissionGraphs

        dm = DeviceManager(num_blocks, BS, **kw)
        graphs = AdmissionGraphs(dm)
        for a in calls[: fill + warmup]:
            graphs.step(*a)
        gpu_ms: list[float] = []
        times = [host_ms(lambda a=a: graphs.step(*a), dm.device, gpu_ms) for a in calls[fill + warmup: -1]]
        _sync(dm.device)
        return times, dict(dm.counters.as_dict(), gpu_ms=gpu_ms, graph_replays=graphs.replays)
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
    """Counters of one more call; on the interpreter also ``launch_list``:
    the launches the real manager made in it (``launch_cost.capturing``),
    for the per-launch cost."""
    if m.twin is None:
        return _count_one(m.real, method, *args)
    m.twin.counters.count_torch_ops = True
    try:
        with launch_cost.capturing() as launches:
            m.run(method, [args])
    finally:
        m.twin.counters.count_torch_ops = False
    out = m.twin.counters.as_dict()
    if len(launches) != out.get("launches"):
        print(f"  note: {len(launches)} launches recorded, {out.get('launches')} counted", file=sys.stderr)
    return dict(out, launch_list=list(launches))


def _median(xs: list[float]) -> float:
    return float(np.median(np.asarray(xs)))


def _repeat_stats(r: dict, launch_us: list[float] | None, interp: bool) -> dict:
    """p50/p99 of one repeat's samples, and their ratios to vLLM's.

    ``device``: the twin's figure on the interpreter (kernels and launches
    out), the wall time of the call on CUDA. ``eager``: on the interpreter
    the twin's step i plus the launch path's sample i (``launch_cost``), on
    CUDA the wall time. ``replayed``: on the interpreter the twin's figure
    plus the graph launches counted as 0 (not measurable without a GPU), on
    CUDA the wall time through ``DecodeGraphs`` or ``AdmissionGraphs``."""
    dv, vl = r["dv"], r["vl"]
    eager = None
    if not interp:
        eager = dv
    elif launch_us is not None:
        eager = [d + u / 1e3 for d, u in zip(dv, launch_us, strict=True)]
    replayed = dv if interp else r.get("gr")
    out: dict = {"device_p50_ms": pct(dv, 50), "device_p99_ms": pct(dv, 99), "reference_p50_ms": pct(r["rf"], 50)}
    for name, xs in (("eager", eager), ("replayed", replayed), ("vllm", vl)):
        if xs:
            out[f"{name}_p50_ms"], out[f"{name}_p99_ms"] = pct(xs, 50), pct(xs, 99)
    if launch_us is not None:
        out["launch_p50_us"], out["launch_p99_us"] = pct(launch_us, 50), pct(launch_us, 99)
    if vl:
        for name in ("device", "eager", "replayed"):
            for q in ("p50", "p99"):
                if f"{name}_{q}_ms" in out:
                    key = "ratio_p50" if (name, q) == ("device", "p50") else f"ratio_{name}_{q}"
                    out[key] = out[f"{name}_{q}_ms"] / out[f"vllm_{q}_ms"]
    gpu = r["counts"].get("gpu_ms") or []
    if gpu:
        out["gpu_p50_ms"], out["gpu_p99_ms"] = pct(gpu, 50), pct(gpu, 99)
    if r.get("gr_gpu"):
        out["replayed_gpu_p50_ms"] = pct(r["gr_gpu"], 50)
    return out


def _row(label: str, B: int, reps: list[dict], launch: dict | None, interp: bool, decode: bool,
         steps: int) -> dict:
    """One table row: each figure the median over the repeats of that
    repeat's p50 (p99); ``ratio_*_range``: the repeats' lowest and highest."""
    per = []
    for i, r in enumerate(reps):
        us = launch["step_us"][0][i * steps:(i + 1) * steps] if launch else None
        per.append(_repeat_stats(r, us, interp))
    counts = {k: v for k, v in reps[-1]["counts"].items() if k not in ("gpu_ms", "launch_list")}
    row: dict = {"work": label, "batch": B, "counters": counts, "repeats": per,
                 "graph": "DecodeGraphs" if decode else "AdmissionGraphs"}
    for key in per[0]:
        vals = [p[key] for p in per if key in p]
        row[key] = _median(vals)
        if key.startswith("ratio"):
            row[f"{key}_range"] = [min(vals), max(vals)]
    if launch:
        n = launch["launches"][0]
        row["launches_timed"] = n
        row["launches_not_replayed"] = launch.get("not_replayed", [0])[0]  # timed through JITFunction.run
        if n:
            row["per_launch_us"] = row["launch_p50_us"] / n
    return row


def _launch_paths(jobs: dict, steps: int, repeats: int) -> dict:
    """``launch_cost.measure`` of each job's step, ``steps`` samples in each
    of ``repeats`` child processes, their samples in order (repeat i's
    eager figures add child i's). One child per repeat, because on this
    machine a process's launch path keeps one speed for its whole life, and
    it is one of two (about 3.5 or 6 us a launch for the same launches, on
    the same code): the median over repeats is then not one process's
    luck. ``per_kernel_us``: each kernel's median over the children;
    ``per_child_launch_us``: each child's mean per launch over all jobs."""
    outs = [launch_cost.measure(jobs, samples=steps) for _ in range(repeats)]
    merged = dict(outs[0], jobs={})
    for name in jobs:
        merged["jobs"][name] = dict(outs[0]["jobs"][name],
                                    step_us=[[t for out in outs for t in out["jobs"][name]["step_us"][0]]])
    merged["per_kernel_us"] = {k: _median([out["per_kernel_us"][k] for out in outs]) for k in outs[0]["per_kernel_us"]}
    n = sum(outs[0]["jobs"][name]["launches"][0] for name in jobs)
    merged["per_child_launch_us"] = [sum(_median(out["jobs"][name]["step_us"][0]) for name in jobs) / max(n, 1)
                                     for out in outs]
    return merged


def _twin_check(argv: list[str], rows: list[dict]) -> None:
    """On CUDA: run this benchmark again with CUDA hidden (the interpreter's
    twin plus the measured launch path) and print real / twin per row."""
    import os
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "twin.json")
        rest = [a for a in argv if a != "--twin-check"]
        if "--json" in rest:
            i = rest.index("--json")
            del rest[i:i + 2]
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
        subprocess.run([sys.executable, __file__, *rest, "--json", out], env=env, check=True)
        with open(out) as f:
            twin = {r["work"]: r for r in json.load(f)["rows"]}
    print("\nHow close the twin was (real GPU figure / the CPU twin's, p50; the twin run on this host with "
          "CUDA hidden):")
    print("| work | eager real ms | eager twin ms | real/twin | replayed real ms | replayed twin ms | real/twin |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        t = twin.get(r["work"], {})

        def cell(key, r=r, t=t):
            if key in r and key in t:
                return f"{r[key]:.3f} | {t[key]:.3f} | {r[key] / t[key]:.2f}x"
            return "- | - | -"
        print(f"| {r['work']} | {cell('eager_p50_ms')} | {cell('replayed_p50_ms')} |")
        r["twin"] = {k: t.get(k) for k in ("eager_p50_ms", "replayed_p50_ms", "device_p50_ms")}


def _launches(r: dict) -> str:
    """The step's launches, and how many of them the manager does not replay
    (the eager column times those through ``JITFunction.run``)."""
    n, run = r["counters"].get("launches", "-"), r.get("launches_not_replayed")
    return f"{n} ({run} not replayed)" if run else f"{n}"


def _ms(r: dict, name: str) -> str:
    return f"{r[name + '_p50_ms']:.3f} ({r[name + '_p99_ms']:.3f})" if name + "_p50_ms" in r else "-"


def _ratio(r: dict, name: str) -> str:
    p50 = "ratio_p50" if name == "device" else f"ratio_{name}_p50"
    if p50 not in r:
        return "-"
    p99 = r.get(f"ratio_{name}_p99")
    return f"{r[p50]:.2f}x" + (f" ({p99:.2f}x)" if p99 is not None else "")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--batches", type=int, nargs="*", default=[1, 4, 16, 64, 256, 1024], help="decode batch sizes")
    p.add_argument("--prefill-batches", type=int, nargs="*", default=[1, 4, 16, 64],
                   help="new requests per prefill step (16 is the issue's target; larger ones take minutes a step "
                        "under the interpreter)")
    p.add_argument("--churn", action=argparse.BooleanOptionalAction, default=True,
                   help="the churn workload (8 new 1,024-token requests a step into a full pool)")
    p.add_argument("--decode-pool-blocks", type=int, nargs="*", default=[None],
                   help="pool sizes of the decode workloads (a row per size; default: 24 blocks a request)")
    p.add_argument("--decode-prompt-len", type=int, nargs="*", default=[PROMPT_LEN],
                   help="shortest prompts of the decode workloads (a row per length; prompts run to it + 15)")
    p.add_argument("--steps", type=int, default=30, help="timed steps per workload and repeat")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (compiles every variant)")
    p.add_argument("--repeats", type=int, default=3,
                   help="independent runs of each workload (fresh managers); figures are the median over them")
    p.add_argument("--launch-cost", action=argparse.BooleanOptionalAction, default=True,
                   help="on the interpreter, measure Triton's real launch path per launch (benchmarks/"
                        "launch_cost.py) for the eager column")
    p.add_argument("--twin-check", action="store_true",
                   help="on CUDA: also run the benchmark with CUDA hidden and report how close the twin was")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    vllm_kv = _vllm()
    dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    interp = dev.type != "cuda"
    where = torch.cuda.get_device_name() if dev.type == "cuda" else f"CPU ({platform.machine()}), Triton interpreter"
    if interp:
        launch_cost.install()  # before any manager prepares its launches
    work = []
    for B in args.batches:
        for pool in args.decode_pool_blocks:
            for shortest in args.decode_prompt_len:
                label = f"decode B={B}" + (f", pool {pool}" if pool is not None else "") + (
                    f", prompts {shortest}+" if shortest != PROMPT_LEN else "")
                work.append((label, "decode", (B, pool, shortest)))
    work += [(f"prefill {B}x256 (128 shared)", "prefill", (B, None, 0)) for B in args.prefill_batches]
    if args.churn:
        work += [("churn 8x1024 into a full pool", "churn", (0, None, 0))]
    done = []
    for label, kind, (B, pool, shortest) in work:
        reps = []
        for rep in range(args.repeats):
            r: dict = {}
            if kind == "decode":
                shape = dict(pool=pool, shortest=shortest)
                r["dv"], r["counts"] = decode_gpukv("device", B, args.steps, args.warmup, **shape)
                r["rf"], _ = decode_gpukv("reference", B, args.steps, args.warmup, **shape)
                r["vl"] = decode_vllm(vllm_kv, B, args.steps, args.warmup, **shape) if vllm_kv else None
                if not interp:
                    r["gr"], gc = decode_gpukv("graphs", B, args.steps, args.warmup, **shape)
                    r["gr_gpu"] = gc.get("gpu_ms")
            else:
                r["dv"], r["counts"] = steps_gpukv("device", kind, args.steps, args.warmup, B or 16)
                r["rf"], _ = steps_gpukv("reference", kind, args.steps, args.warmup, B or 16)
                r["vl"] = steps_vllm(vllm_kv, kind, args.steps, args.warmup, B or 16) if vllm_kv else None
                if not interp:
                    r["gr"], gc = steps_gpukv("graphs", kind, args.steps, args.warmup, B or 16)
                    r["gr_gpu"] = gc.get("gpu_ms")
            reps.append(r)
            print(f"  {label} [{rep + 1}/{args.repeats}]: device {pct(r['dv'], 50):.3f} ms"
                  + (f", vLLM {pct(r['vl'], 50):.3f} ms" if r["vl"] else ""), file=sys.stderr)
        done.append((label, kind, B, reps))
    launch = None
    if interp and args.launch_cost:
        jobs = {label: [reps[0]["counts"]["launch_list"]] for label, _, _, reps in done}
        try:
            launch = _launch_paths(jobs, args.steps, args.repeats)
        except launch_cost.Unavailable as e:
            print(f"  the launch path cannot be measured here ({e}): no eager column", file=sys.stderr)
    rows = [_row(label, B, reps, launch["jobs"][label] if launch else None, interp, kind == "decode", args.steps)
            for label, kind, B, reps in done]
    head = (f"Host cost per step ({where}; gpukv {gpukv.__version__}, torch {torch.__version__}, "
            f"vLLM {getattr(vllm_kv, 'VLLM_VERSION', 'not importable')}); p50 (p99) ms, each the median of "
            f"{args.repeats} repeats of {args.steps} steps")
    print(head)
    if interp:
        print("device manager: the twin (kernels and launches out); eager: + Triton's launch path per launch "
              "(benchmarks/launch_cost.py); replayed: the twin + one CUDA graph launch, counted as 0 here")
    print("| work | vLLM 0.8.5 | device manager | ratio device/vLLM | eager | ratio eager/vLLM | replayed "
          "| ratio replayed/vLLM | launch path us (per launch) | reference | launches | torch ops | H2D | D2H "
          "| GPU time |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        c = r["counters"]
        lp = (f"{r['launch_p50_us']:.0f} ({r['per_launch_us']:.1f})" if r.get("per_launch_us") is not None
              else "-")
        print(f"| {r['work']} | {_ms(r, 'vllm')} | {_ms(r, 'device')} | {_ratio(r, 'device')} | {_ms(r, 'eager')} "
              f"| {_ratio(r, 'eager')} | {_ms(r, 'replayed')} | {_ratio(r, 'replayed')} "
              f"| {lp} | {r['reference_p50_ms']:.3f} | {_launches(r)} | {c.get('torch_ops', '-')} "
              f"| {c.get('h2d', '-')} | {c.get('d2h', '-')} | {_ms(r, 'gpu')} |")
    if launch:
        print(f"Launch path per kernel, us (median, one kernel's launch back to back; Triton {launch['triton']}, "
              f"sm_90 stub driver): " + ", ".join(f"{k} {v:.1f}" for k, v in launch["per_kernel_us"].items()))
        print("Launch path per launch in each repeat's process (the step's launches back to back), us: "
              + ", ".join(f"{v:.1f}" for v in launch["per_child_launch_us"]))
    if args.twin_check and not interp:
        _twin_check(sys.argv[1:] if argv is None else argv, rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"where": where, "gpukv": gpukv.__version__, "torch": torch.__version__,
                       "vllm": getattr(vllm_kv, "VLLM_VERSION", None), "python": sys.version.split()[0],
                       "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats,
                       "launch_cost": ({k: v for k, v in launch.items() if k != "jobs"} if launch else None),
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
