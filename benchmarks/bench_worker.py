"""Block ids on the device: what a step costs to carry the block ids from
gpukv's table to the attention's, with vLLM's own model runner and with
``gpukv.vllm.Worker``.

Needs vLLM 0.33 or later (Model Runner V2's ``BlockTables``). Three
workloads, block size 16, one full-attention group, vLLM's ``max_num_reqs``
256 rows of width 8,192 (``max_model_len`` 131,072):

* ``decode-256``: 256 running requests decode one token each; their lengths
  are spread so that 16 of them start a new block every step (16 new ids);
* ``admit-8k``: one request of 8,192 tokens admitted with no hit: 512 new
  ids, 8,192 tokens computed (the previous step's request finished);
* ``admit-128k``: one request of 131,072 tokens admitted with its first
  122,880 tokens hit (a conversation's next turn; vLLM 0.34 also re-sends a
  resumed request whole): its ``NewRequestData`` carries all 8,192 ids,
  8,192 tokens computed.

Each step has two parts, timed and counted apart:

* **handoff** (the scheduler's side, today on both paths): the step's new
  ids read from gpukv's table in one device-to-host copy, a ``Block`` per id
  (``gpukv.vllm.v0_33.views.blocks_of``, as the adapter builds them), vLLM's
  ``KVCacheBlocks`` and its ``get_block_ids`` lists, which ``SchedulerOutput``
  carries (and pickles to every other rank when TP > 1);
* **runner**: vLLM's ``BlockTables`` as Model Runner V2 drives it:
  ``append_block_ids`` for new and running requests, ``apply_staged_writes``,
  ``gather_block_tables`` and ``compute_slot_mappings`` (``prepare_attn``).
  With the worker the same calls reach ``GpukvBlockTables``
  (``gpukv.vllm.v0_33.tables``): nothing staged, the block counts and the
  index-to-row map uploaded, gather and slot mapping on gpukv's rows.

gpukv's own step (its kernels write the new ids into its table: the same
work on both paths) is not counted: its table is filled directly between
steps (``GpukvTables``, the attributes the binding reads). Three rows per
workload: ``vllm`` (vLLM's runner, today's path), ``worker`` (the gpukv
worker as built: the scheduler still does the handoff) and ``worker, no
handoff`` (the runner alone: what a scheduler that skips the handoff under
the worker would cost; that scheduler change is not built).

Counted per step:

* ``h2d B``: every host buffer the device reads, through vLLM's buffers
  (``UvaBuffer.uva`` / ``NonUvaBuffer.uva``: read over UVA on a GPU, copied
  without it; and vLLM 0.33's ``async_tensor_h2d`` of staged contents):
  staged ids, write indices, block counts, the row map;
* ``d2h B``: the ids read back in the handoff (4 bytes an id);
* ``pickled B``: the step's block-id lists, pickled (what a
  ``SchedulerOutput`` adds for them on its way to other ranks);
* ``objects``: ``sys.getallocatedblocks()`` after the part less before
  (garbage collected first, the part's output held): the Python objects (and
  small buffers) the part leaves alive;
* ``launches``: Triton kernel launches;
* ``ms``: the part's thread CPU time (``torch.set_num_threads(1)``), the
  median over the timed steps. Without CUDA the kernels' bodies are skipped
  (each launch counted, none run: the interpreter's time says nothing of a
  GPU's), so the time is the host's Python, numpy and torch work; with CUDA
  the kernels run and ``wall ms`` adds each step's wall time to a
  synchronize.

Run: ``PYTHONPATH=. VENV/bin/python benchmarks/bench_worker.py`` (VENV with
vLLM 0.33+); ``--quick`` for a smoke run; ``--json OUT`` for the numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import pickle
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import MappingProxyType, SimpleNamespace
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import gpukv._runtime  # noqa: E402,F401  (before vLLM imports Triton: the interpreter without CUDA)

BLOCK_SIZE = 16
MAX_NUM_REQS = 256
WIDTH = 131072 // BLOCK_SIZE  # (128-token aligned already, as vLLM's get_block_table_width makes it)
TOKEN_BUDGET = 8192
POOL = 1 << 20  # block ids drawn below this, above 256 (Python's small ints are shared, not built)


@dataclass(frozen=True)
class Workload:
    name: str
    running: int  # decode: running requests, one token each a step
    prompt: int  # admission: the prompt's tokens
    hit: int  # admission: tokens hit in the prefix cache


WORKLOADS = {
    "decode-256": Workload("decode-256", 256, 0, 0),
    "admit-8k": Workload("admit-8k", 0, 8192, 0),
    "admit-128k": Workload("admit-128k", 0, 131072, 122880),
}


class GpukvTables:
    """gpukv's block tables as its step leaves them, with the accessors
    ``gpukv.vllm.v0_33.binding`` reads of a device manager (``block_table``,
    int32[1, rows, W]; ``blocks_held_per_row``, each row's block count on
    the host; ``request_rows``, request ids to rows; ``rows_generation``;
    ``stream``)."""

    def __init__(self, device: torch.device) -> None:
        table = torch.zeros((1, MAX_NUM_REQS, WIDTH), dtype=torch.int32, device=device)
        self._rows = SimpleNamespace(block_table=table, num_held=np.zeros(MAX_NUM_REQS, dtype=np.int64))
        self.rows_generation = 0
        self._reqs: dict[str, int] = {}
        self.request_rows = MappingProxyType(self._reqs)
        self.block_table = table
        self.blocks_held_per_row = self._rows.num_held
        self.stream = torch.cuda.Stream() if device.type == "cuda" else None


@dataclass
class Request:
    rid: str
    index: int  # vLLM's request index
    row: int  # gpukv's row
    num_blocks: int
    computed: int  # tokens computed before this step
    block_hashes: list[Any] = field(default_factory=list)


@dataclass
class StepPlan:
    """One step as the scheduler hands it over: new requests (all their
    ids) and running ones with new ids, the batch's device inputs."""

    new: list[Request]
    grown: list[Request]  # running requests with one new block
    batch: list[Request]
    tokens: list[int]  # tokens scheduled, per request of the batch
    finished: list[Request]
    read_rows: torch.Tensor | None = None  # (device) the new ids' rows and positions in gpukv's table
    read_cols: torch.Tensor | None = None
    inputs: tuple[torch.Tensor, ...] = ()  # idx_mapping, query_start_loc, positions


class Counts:
    """What the instrumented vLLM buffers and kernels saw."""

    def __init__(self) -> None:
        self.h2d = 0
        self.launches = 0


@contextlib.contextmanager
def instrumented(counts: Counts, run_kernels: bool) -> Iterator[None]:
    """vLLM's buffers counted as they hand host memory to the device, its
    kernels counted (and skipped unless ``run_kernels``)."""
    from vllm.v1.worker.gpu import block_table, buffer_utils

    def counted_uva(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def uva(self: Any, n: int | None = None) -> torch.Tensor:
            out = original(self, n)
            counts.h2d += out.numel() * out.element_size()
            return out
        return uva

    class Kernel:
        def __init__(self, real: Any) -> None:
            self.real = real

        def __getitem__(self, grid: Any) -> Callable[..., None]:
            def launch(*args: Any, **kwargs: Any) -> None:
                counts.launches += 1
                if run_kernels:
                    self.real[grid](*args, **kwargs)
            return launch

    def counted_h2d(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def h2d(*args: Any, **kwargs: Any) -> torch.Tensor:
            out = original(*args, **kwargs)
            counts.h2d += out.numel() * out.element_size()
            return out
        return h2d

    saved = []
    for owner, name in ((buffer_utils.NonUvaBuffer, "uva"), (buffer_utils.UvaBuffer, "uva")):
        saved.append((owner, name, owner.__dict__[name]))
        setattr(owner, name, counted_uva(owner.__dict__[name]))
    if hasattr(buffer_utils, "async_tensor_h2d"):  # (vLLM 0.33 uploads staged contents this way)
        saved.append((buffer_utils, "async_tensor_h2d", buffer_utils.async_tensor_h2d))
        buffer_utils.async_tensor_h2d = counted_h2d(buffer_utils.async_tensor_h2d)
    for module, name in ((buffer_utils, "_apply_write_kernel"), (block_table, "_gather_block_tables_kernel"),
                         (block_table, "_compute_slot_mappings_kernel")):
        saved.append((module, name, getattr(module, name)))
        setattr(module, name, Kernel(getattr(module, name)))
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


class Scheduler:
    """The workload's requests, their vLLM indices and gpukv rows, and each
    step's plan; writes gpukv's table as gpukv's step would (uncounted)."""

    def __init__(self, workload: Workload, gpukv: GpukvTables, device: torch.device, seed: int = 0) -> None:
        self.workload, self.gpukv, self.device = workload, gpukv, device
        self.rng = np.random.default_rng(seed)
        self.free_rows = list(range(MAX_NUM_REQS))[::-1]
        self.free_indices = list(range(MAX_NUM_REQS))  # (vLLM's indices are not gpukv's rows)
        self.running: list[Request] = []
        self.n = 0

    def _admit(self, tokens: int, computed: int) -> Request:
        num_blocks = -(-tokens // BLOCK_SIZE)
        request = Request(str(self.n), self.free_indices.pop(), self.free_rows.pop(), num_blocks, computed,
                          block_hashes=list(range(computed // BLOCK_SIZE)))
        self.n += 1
        self._write(request, 0, num_blocks)
        self.gpukv._reqs[request.rid] = request.row
        return request

    def _write(self, request: Request, start: int, end: int) -> None:
        ids = torch.from_numpy(self.rng.integers(257, POOL, size=end - start, dtype=np.int32))
        self.gpukv._rows.block_table[0, request.row, start:end] = ids.to(self.device)
        self.gpukv._rows.num_held[request.row] = end

    def _finish(self, request: Request) -> None:
        self.free_rows.append(request.row)
        self.free_indices.append(request.index)
        del self.gpukv._reqs[request.rid]
        self.gpukv._rows.num_held[request.row] = 0

    def first(self) -> StepPlan:
        """The decode workload's requests admitted (before the timed steps)."""
        w = self.workload
        self.running = [self._admit(1000 + i, 1000 + i - 1) for i in range(w.running)]
        return self._plan(self.running, [], self.running, [1] * len(self.running), [])

    def next(self) -> StepPlan:
        w = self.workload
        if w.running:
            grown = []
            for r in self.running:
                r.computed += 1
                if r.computed % BLOCK_SIZE == 0:  # (the token at this position starts a block)
                    self._write(r, r.num_blocks, r.num_blocks + 1)
                    r.num_blocks += 1
                    grown.append(r)
            return self._plan([], grown, self.running, [1] * len(self.running), [])
        finished = self.running
        for r in finished:
            self._finish(r)
        self.running = [self._admit(w.prompt, w.hit)]
        return self._plan(self.running, [], self.running, [w.prompt - w.hit], finished)

    def _plan(self, new: list[Request], grown: list[Request], batch: list[Request], tokens: list[int],
              finished: list[Request]) -> StepPlan:
        plan = StepPlan(new, grown, batch, tokens, finished)
        rows = [r.row for r in new for _ in range(r.num_blocks)] + [r.row for r in grown]
        cols = [c for r in new for c in range(r.num_blocks)] + [r.num_blocks - 1 for r in grown]
        plan.read_rows = torch.tensor(rows, dtype=torch.int64, device=self.device)
        plan.read_cols = torch.tensor(cols, dtype=torch.int64, device=self.device)
        qsl = np.concatenate([[0], np.cumsum(tokens)]).astype(np.int32)
        positions = np.concatenate([np.arange(r.computed, r.computed + n) for r, n in zip(batch, tokens, strict=True)])
        plan.inputs = (torch.tensor([r.index for r in batch], dtype=torch.int64, device=self.device),
                       torch.tensor(qsl, device=self.device), torch.tensor(positions, device=self.device))
        return plan


def handoff(plan: StepPlan, gpukv: GpukvTables) -> tuple[list[Any], int]:
    """The scheduler's side of today's path: the step's new ids read back in
    one copy, ``Block``\\ s and vLLM's ``KVCacheBlocks``, and the lists
    ``SchedulerOutput`` carries; returns them and the bytes read."""
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks

    from gpukv.vllm.v0_33.views import Block, blocks_of

    flat = gpukv._rows.block_table[0][plan.read_rows, plan.read_cols].cpu().numpy()
    out: list[Any] = []
    at = 0
    for r in plan.new:
        ids = flat[at:at + r.num_blocks].tolist()
        at += r.num_blocks
        out.append(KVCacheBlocks((blocks_of(r, ids, r.computed, BLOCK_SIZE),)).get_block_ids())
    for b in flat[at:].tolist():
        out.append(KVCacheBlocks(([Block(b)],)).get_block_ids(allow_none=True))
    return out, flat.nbytes


def runner_step(tables: Any, plan: StepPlan, block_ids: list[Any], computed: torch.Tensor, worker: bool) -> None:
    """Model Runner V2's block-table calls for one step (``add_requests``,
    ``update_requests``, ``prepare_attn``), given the handoff's lists (the
    worker's tables ignore them)."""
    ids = iter(block_ids)
    for r in plan.new:
        tables.append_block_ids(r.index, next(ids), overwrite=True)
        if worker:
            tables.set_row(r.index, r.rid)
    for r in plan.grown:
        tables.append_block_ids(r.index, next(ids), overwrite=False)
    tables.apply_staged_writes()
    idx, qsl, positions = plan.inputs
    tables.gather_block_tables(idx, len(plan.batch), num_computed_tokens=computed)
    tables.compute_slot_mappings(idx, qsl, positions, int(positions.shape[0]))


def make_tables(device: torch.device, worker: bool, gpukv: GpukvTables) -> Any:
    from vllm.v1.worker.gpu.block_table import BlockTables

    from gpukv.vllm.v0_33.binding import TableBinding
    from gpukv.vllm.v0_33.tables import adopt

    tables = BlockTables([BLOCK_SIZE], MAX_NUM_REQS, TOKEN_BUDGET, [WIDTH], device)
    if worker:
        binding = TableBinding()
        tables = adopt(tables, binding)
        binding.publish(gpukv)
    return tables


@dataclass
class PartStats:
    ms: list[float] = field(default_factory=list)
    wall_ms: list[float] = field(default_factory=list)
    h2d: int = 0
    d2h: int = 0
    launches: int = 0
    objects: int = 0
    pickled: int = 0
    ids: int = 0

    def summary(self) -> dict[str, Any]:
        out = {"ms": statistics.median(self.ms), "h2d": self.h2d, "d2h": self.d2h, "launches": self.launches,
               "objects": self.objects, "pickled": self.pickled, "ids": self.ids}
        if self.wall_ms:
            out["wall_ms"] = statistics.median(self.wall_ms)
        return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(workload: Workload, worker: bool, steps: int, warmup: int, device: torch.device) -> dict[str, Any]:
    """One path on one workload: per-step counts (the last step's: every
    step of a workload is alike) and median times."""
    gpukv = GpukvTables(device)
    scheduler = Scheduler(workload, gpukv, device)
    tables = make_tables(device, worker, gpukv)
    computed = torch.zeros(MAX_NUM_REQS, dtype=torch.int32, device=device)
    counts = Counts()
    hand, run = PartStats(), PartStats()
    run_kernels = device.type == "cuda"
    with instrumented(counts, run_kernels):
        if workload.running:
            plan = scheduler.first()
            block_ids, _ = handoff(plan, gpukv)
            runner_step(tables, plan, block_ids, computed, worker)
        for step in range(warmup + steps):
            plan = block_ids = None  # (the last step's objects freed before counting this one's)
            plan = scheduler.next()
            _sync(device)
            gc.collect()
            before = sys.getallocatedblocks()
            t0, w0 = time.thread_time_ns(), time.perf_counter_ns()
            block_ids, d2h = handoff(plan, gpukv)
            t1, w1 = time.thread_time_ns(), time.perf_counter_ns()
            handed = sys.getallocatedblocks() - before
            counts.h2d = counts.launches = 0
            gc.collect()
            before = sys.getallocatedblocks()
            t2, w2 = time.thread_time_ns(), time.perf_counter_ns()
            runner_step(tables, plan, block_ids, computed, worker)
            _sync(device)
            t3, w3 = time.thread_time_ns(), time.perf_counter_ns()
            if step < warmup:
                continue
            hand.ms.append((t1 - t0) / 1e6)
            run.ms.append((t3 - t2) / 1e6)
            if run_kernels:
                hand.wall_ms.append((w1 - w0) / 1e6)
                run.wall_ms.append((w3 - w2) / 1e6)
            hand.objects, hand.d2h = handed, d2h
            hand.pickled = len(pickle.dumps(block_ids, protocol=pickle.HIGHEST_PROTOCOL))
            hand.ids = sum(len(group) for ids in block_ids for group in ids or ())
            run.objects = sys.getallocatedblocks() - before
            run.h2d, run.launches = counts.h2d, counts.launches
    return {"handoff": hand.summary(), "runner": run.summary()}


def rows_of(workload: str, vllm: dict[str, Any], worker: dict[str, Any]) -> list[dict[str, Any]]:
    """The table's three rows of a workload (module docstring)."""
    hand = vllm["handoff"]
    return [
        {"workload": workload, "path": "vllm", "handoff": hand, "runner": vllm["runner"]},
        {"workload": workload, "path": "worker", "handoff": worker["handoff"], "runner": worker["runner"]},
        {"workload": workload, "path": "worker, no handoff", "handoff": None, "runner": worker["runner"]},
    ]


def table(rows: list[dict[str, Any]], cuda: bool) -> list[str]:
    head = ["workload", "path", "ids handed", "d2h B", "pickled B", "handoff objects", "handoff ms", "runner h2d B",
            "runner launches", "runner objects", "runner ms", "step ms"]
    if cuda:
        head += ["runner wall ms"]
    lines = ["| " + " | ".join(head) + " |", "| --- | --- |" + " ---: |" * (len(head) - 2)]
    for r in rows:
        h, run = r["handoff"], r["runner"]
        total = run["ms"] + (h["ms"] if h else 0.0)
        cells = [r["workload"], r["path"]]
        cells += [f"{h['ids']:,}", f"{h['d2h']:,}", f"{h['pickled']:,}", f"{h['objects']:,}", f"{h['ms']:.3f}"] \
            if h else ["0", "0", "0", "0", "-"]
        cells += [f"{run['h2d']:,}", str(run["launches"]), f"{run['objects']:,}", f"{run['ms']:.3f}", f"{total:.3f}"]
        if cuda:
            cells.append(f"{run['wall_ms']:.3f}")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


@contextlib.contextmanager
def cpu_shims() -> Iterator[None]:
    """Without CUDA, vLLM's block-table code on CPU tensors: the shims the
    worker's differential test uses (``tests/test_vllm033/runner_shims.py``;
    none with CUDA)."""
    from tests.test_vllm033.runner_shims import shimmed

    with shimmed():
        yield


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--steps", type=int, default=30, help="timed steps per workload and path")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="2 timed steps after 1: a smoke run")
    parser.add_argument("--json", help="write the numbers here")
    args = parser.parse_args(argv)
    steps, warmup = (2, 1) if args.quick else (args.steps, args.warmup)
    torch.set_num_threads(1)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    rows = []
    with cpu_shims():
        for name in args.workloads:
            vllm = measure(WORKLOADS[name], False, steps, warmup, device)
            worker = measure(WORKLOADS[name], True, steps, warmup, device)
            rows += rows_of(name, vllm, worker)
    import vllm as vllm_module

    where = torch.cuda.get_device_name() if cuda else f"CPU ({platform.machine()}), kernels counted, not run"
    print(f"bench_worker: {steps} timed steps after {warmup}; vLLM {vllm_module.__version__}, "
          f"torch {torch.__version__}; {where}")
    print("\n".join(table(rows, cuda)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"steps": steps, "warmup": warmup, "cuda": cuda, "device": where,
                       "vllm": vllm_module.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
