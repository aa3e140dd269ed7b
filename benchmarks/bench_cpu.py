"""The CPU path against vLLM 0.8.5: gpukv's reference manager and vLLM's v1
KVCacheManager on the same work, side by side in one process.

Four workloads (block size 16, one full-attention group), each timed in thread
CPU time per scheduling step (what the step costs the host, free of other
processes' noise), p50 and mean over the timed steps:

* ``decode``: 256 running requests append and compute one token each;
* ``prefill``: a step admits 16 requests of 256 tokens sharing a 128-token prefix;
* ``single``: one request of 2,048 tokens admitted alone (a miss);
* ``churn``: 8 new 1,024-token requests per step into a pool full of cached
  blocks (every allocation evicts); the step also frees the previous step's 8.

vLLM's side makes the calls its scheduler makes (``get_computed_blocks`` then
``allocate_slots`` per new request, ``allocate_slots(req, 1)`` per decode,
``free``; the request's ``num_computed_tokens`` advanced as the scheduler
does). gpukv's side is one batched ``step()``. Also host hashing throughput.

    PYTHONPATH=.:/path/to/vllm085 /path/to/vllm085/venv/bin/python benchmarks/bench_cpu.py

vLLM's column is skipped with a message where ``vllm_kv`` (from
``../shared/tools/vllm085/``) is not importable.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from gpukv.core import hashing
from gpukv.core.requests import NewRequest, RunningUpdate
from gpukv.reference.manager import ReferenceManager

BLOCK_SIZE = 16
VOCAB = 32000


def _vllm():
    """vllm_kv, or None with the reason printed."""
    shared = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "tools", "vllm085")
    if os.path.isdir(shared) and shared not in sys.path:
        sys.path.append(shared)
    try:
        import vllm_kv  # type: ignore[import-not-found]
    except Exception as exc:  # noqa: BLE001 (any import failure means: no vLLM column)
        print(f"note: vLLM's manager is not importable ({type(exc).__name__}: {exc}); "
              "set it up with ../shared/tools/vllm085/setup.sh DIR and run with DIR/venv/bin/python "
              "and PYTHONPATH=.:DIR", file=sys.stderr)
        return None
    return vllm_kv


@dataclass
class Workload:
    """One benchmark: ``setup(manager_kind)`` returns a step function to time
    and a function that does the untimed work between steps."""

    name: str
    what: str
    steps: int


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


# ----------------------------------------------------------------- gpukv side
class GpukvDriver:
    def __init__(self, num_blocks: int, max_model_len: int):  # noqa: ARG002  (VllmDriver's signature: one make() builds either)
        self.m = ReferenceManager(num_blocks, BLOCK_SIZE, hash_key=bytes(16))

    def admit(self, reqs: list[tuple[str, list[int]]], finished: list[str] = ()) -> None:
        res = self.m.step(finished=list(finished), new=[NewRequest(rid, toks) for rid, toks in reqs])
        assert res.num_admitted == len(reqs), "pool too small for the workload"

    def decode(self, rids: list[str], toks: list[int]) -> None:
        res = self.m.step(running=[RunningUpdate(r, [t]) for r, t in zip(rids, toks, strict=True)])
        assert res.ok

    def free(self, rids: list[str]) -> None:
        if rids:
            self.m.step(finished=rids)


# ------------------------------------------------------------------ vLLM side
class VllmDriver:
    def __init__(self, vllm_kv, num_blocks: int, max_model_len: int):
        self.kv = vllm_kv
        self.m = vllm_kv.make_manager(num_blocks=num_blocks, block_size=BLOCK_SIZE, max_model_len=max_model_len)
        self.reqs: dict = {}

    def admit(self, reqs: list[tuple[str, list[int]]], finished: list[str] = ()) -> None:
        self.free(list(finished))
        for rid, toks in reqs:
            req = self.kv.make_request(rid, toks)
            blocks, hit = self.m.get_computed_blocks(req)
            got = self.m.allocate_slots(req, req.num_tokens - hit, blocks)
            assert got is not None, "pool too small for the workload"
            req.num_computed_tokens = req.num_tokens
            self.reqs[rid] = req

    def decode(self, rids: list[str], toks: list[int]) -> None:
        for rid, t in zip(rids, toks, strict=True):
            req = self.reqs[rid]
            req.append_output_token_ids(t)
            assert self.m.allocate_slots(req, 1) is not None
            req.num_computed_tokens += 1

    def free(self, rids: list[str]) -> None:
        for rid in rids:
            self.m.free(self.reqs.pop(rid))


# ---------------------------------------------------------------- workloads
def _time(step: Callable[[], None]) -> float:
    t = time.thread_time()
    step()
    return (time.thread_time() - t) * 1e3


def bench_decode(make, steps: int, batch: int = 256) -> list[float]:
    rng = random.Random(0)
    d = make(num_blocks=batch * 24, max_model_len=4096)
    rids = [f"d{i}" for i in range(batch)]
    d.admit([(r, _tokens(rng, 100)) for r in rids])
    out = []
    for _ in range(steps):
        toks = _tokens(rng, batch)  # drawn outside the timed call
        out.append(_time(lambda toks=toks: d.decode(rids, toks)))
    return out


def bench_prefill(make, steps: int, batch: int = 16, length: int = 256, shared: int = 128) -> list[float]:
    rng = random.Random(1)
    d = make(num_blocks=8192, max_model_len=4096)
    prefix = _tokens(rng, shared)
    out, prev = [], []
    for s in range(steps):
        reqs = [(f"p{s}.{i}", prefix + _tokens(rng, length - shared)) for i in range(batch)]
        d.free(prev)
        out.append(_time(lambda reqs=reqs: d.admit(reqs)))
        prev = [r for r, _ in reqs]
    return out


def bench_single(make, steps: int, length: int = 2048) -> list[float]:
    rng = random.Random(2)
    d = make(num_blocks=4096, max_model_len=4096)
    out, prev = [], []
    for s in range(steps):
        req = [(f"s{s}", _tokens(rng, length))]
        d.free(prev)
        out.append(_time(lambda req=req: d.admit(req)))
        prev = [f"s{s}"]
    return out


def bench_churn(make, steps: int, batch: int = 8, length: int = 1024) -> list[float]:
    rng = random.Random(3)
    per_step = batch * length // BLOCK_SIZE
    d = make(num_blocks=4 * per_step + 1, max_model_len=4096)
    prev: list[str] = []
    for w in range(4):  # fill the pool with cached blocks
        reqs = [(f"w{w}.{i}", _tokens(rng, length)) for i in range(batch)]
        d.admit(reqs, finished=prev)
        prev = [r for r, _ in reqs]
    out = []
    for s in range(steps):
        reqs = [(f"c{s}.{i}", _tokens(rng, length)) for i in range(batch)]
        out.append(_time(lambda reqs=reqs, prev=prev: d.admit(reqs, finished=prev)))
        prev = [r for r, _ in reqs]
    return out


WORKLOADS = {
    "decode": ("decode step, 256 running requests, 1 token each", bench_decode, 60),
    "prefill": ("step admitting 16 requests of 256 tokens sharing a 128-token prefix", bench_prefill, 40),
    "single": ("one request of 2,048 tokens admitted alone", bench_single, 40),
    "churn": ("eviction churn: 8 new 1,024-token requests per step into a full pool", bench_churn, 20),
}


def bench_hashing(reps: int = 20) -> dict:
    """Host block hashing: a single request of 2,048 tokens (``hash_block_chain``)
    and a batch of 256 requests of 256 tokens (``hash_requests``)."""
    rng = random.Random(4)
    key = bytes(16)
    one = _tokens(rng, 2048)
    t = time.thread_time()
    for _ in range(reps):
        hashing.hash_block_chain(key, one, BLOCK_SIZE)
    single_s = (time.thread_time() - t) / reps
    batch = [_tokens(rng, 256) for _ in range(256)]
    t = time.thread_time()
    hashing.hash_requests(key, batch, BLOCK_SIZE)
    batch_s = time.thread_time() - t
    return {
        "single_us_per_block": single_s / (2048 // BLOCK_SIZE) * 1e6,
        "single_tokens_per_s": 2048 / single_s,
        "batch_us_per_block": batch_s / (256 * 256 // BLOCK_SIZE) * 1e6,
        "batch_tokens_per_s": 256 * 256 / batch_s,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--only", nargs="*", choices=list(WORKLOADS), help="run only these workloads")
    p.add_argument("--scale", type=float, default=1.0, help="multiply the number of timed steps")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    vllm_kv = _vllm()
    rows = []
    for name in args.only or list(WORKLOADS):
        what, fn, steps = WORKLOADS[name]
        steps = max(3, int(steps * args.scale))
        ours = fn(lambda **kw: GpukvDriver(**kw), steps)
        theirs = fn(lambda **kw: VllmDriver(vllm_kv, **kw), steps) if vllm_kv else None
        row = {"workload": name, "what": what, "steps": steps,
               "gpukv_ms_p50": statistics.median(ours), "gpukv_ms_mean": statistics.mean(ours)}
        if theirs:
            row.update(vllm_ms_p50=statistics.median(theirs), vllm_ms_mean=statistics.mean(theirs),
                       ratio_p50=statistics.median(ours) / statistics.median(theirs))
        rows.append(row)
    hashes = bench_hashing()
    print(f"CPU path: gpukv reference vs vLLM {getattr(vllm_kv, 'VLLM_VERSION', '(not importable)')} "
          f"KVCacheManager, thread CPU time per step, block size {BLOCK_SIZE}, "
          f"{platform.processor() or platform.machine()}")
    print("| work | vLLM p50 ms | gpukv p50 ms | ratio |")
    print("| --- | --- | --- | --- |")
    for r in rows:
        v = f"{r['vllm_ms_p50']:.3f}" if "vllm_ms_p50" in r else "-"
        q = f"{r['ratio_p50']:.2f}x" if "ratio_p50" in r else "-"
        print(f"| {r['what']} | {v} | {r['gpukv_ms_p50']:.3f} | {q} |")
    print(f"host hashing: single request {hashes['single_us_per_block']:.2f} us/block "
          f"({hashes['single_tokens_per_s'] / 1e6:.1f} M tokens/s); batch of 256 x 256 tokens "
          f"{hashes['batch_us_per_block']:.2f} us/block ({hashes['batch_tokens_per_s'] / 1e6:.1f} M tokens/s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"python": sys.version.split()[0], "vllm": getattr(vllm_kv, "VLLM_VERSION", None),
                       "workloads": rows, "hashing": hashes}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
