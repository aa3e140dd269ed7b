"""gpukv's worker (``gpukv.vllm.Worker``): Model Runner V2's block tables on
gpukv's device tables, against vLLM's own.

The differential: a random stream (admissions with hits, chunked prefill,
decode, preemption and resumption, aborts; full attention, a sliding-window
group alone, or both) on gpukv's device scheduler, and
at every step two copies of vLLM's ``BlockTables``, run as the model runner
runs them: vLLM's own, fed the block ids of vLLM's own scheduler on the same
stream (new requests' block ids, running ones' new ids appended), and the
gpukv worker's (adopted: no id written, gpukv's table read by gpukv's rows).
gpukv's ``SchedulerOutput`` carries no block id at all (they stay on the
device): checked every step. The gathered
``input_block_tables`` (the whole persistent buffers) and ``slot_mappings``
must be identical every step, from vLLM's own kernels under Triton's
interpreter (``runner_shims``).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

# isort: off
from . import harness  # noqa: F401  (first: it skips this module where vLLM 0.33 is not importable)
# isort: on
import gpukv.vllm as gpukv033
from gpukv.vllm.v0_33.binding import BINDING, TablesMovedError
from gpukv.vllm.v0_33.groups import UnsupportedConfigError
from gpukv.vllm.v0_33.ordering import TableOrdering
from gpukv.vllm.v0_33.worker_config import check_worker_config

from .harness import BlockTables as HarnessTables
from .harness import VllmAsyncScheduler, VllmScheduler, is_async
from .runner_shims import shimmed
from .streams import BLOCK_SIZE, StreamConfig, coverage, run_stream

MAX_MODEL_LEN = 512  # (run_stream's)
WIDTH = MAX_MODEL_LEN // BLOCK_SIZE  # vLLM's table width at that length (already 128-token aligned)
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # (gpukv's manager runs on CUDA where it can)


class Runner:
    """Model Runner V2's use of ``BlockTables`` over one step: request
    indices handed out and taken back, ``add_requests`` /
    ``update_requests`` / ``apply_staged_writes``, then ``prepare_attn``'s
    gather and slot mapping; both tables get the same calls."""

    def __init__(self, ours, theirs, max_num_reqs: int) -> None:
        self.ours, self.theirs = ours, theirs
        self.index: dict[str, int] = {}
        self.free = list(range(max_num_reqs))  # (highest first: vLLM's indices are not gpukv's rows)
        self.computed = torch.zeros(max_num_reqs, dtype=torch.int32, device=DEVICE)
        self.steps = 0
        self.masked = 0  # gathers that nulled an id vLLM's own table held (below a sliding window)

    def step(self, out) -> None:
        for rid in sorted(out.finished_req_ids | (out.preempted_req_ids or set())):
            if rid in self.index:
                self.free.append(self.index.pop(rid))
        for new in out.scheduled_new_reqs:
            i = self.index[new.req_id] = self.free.pop()
            self.computed[i] = new.num_computed_tokens
            self.theirs.append_block_ids(i, new.block_ids, overwrite=True)
            self.ours.append_block_ids(i, new.block_ids, overwrite=True)
            self.ours.set_row(i, new.req_id)  # (GpukvModelRunner.add_requests)
        cached = out.scheduled_cached_reqs
        for rid, computed, new_ids in zip(cached.req_ids, cached.num_computed_tokens, cached.new_block_ids,
                                          strict=True):
            self.computed[self.index[rid]] = computed
            if new_ids is not None:
                self.theirs.append_block_ids(self.index[rid], new_ids, overwrite=False)
        self.theirs.apply_staged_writes()
        self.ours.apply_staged_writes()
        if out.total_num_scheduled_tokens:
            self.prepare_attn(out)

    def nulled(self, idx: torch.Tensor, gathered: tuple[torch.Tensor, ...]) -> int:
        """1 if the gather nulled an entry of vLLM's own table, else 0."""
        for group, (source, table) in enumerate(zip(self.theirs.block_tables, gathered, strict=True)):
            for b, i in enumerate(idx.tolist()):
                n = int(self.theirs.num_blocks.np[group, i])
                if bool(((source.gpu[i, :n] != 0) & (table[b, :n] == 0)).any()):
                    return 1
        return 0

    def prepare_attn(self, out) -> None:
        ids = list(out.num_scheduled_tokens)
        idx = torch.tensor([self.index[r] for r in ids], dtype=torch.int64, device=DEVICE)
        counts = [out.num_scheduled_tokens[r] for r in ids]
        qsl = torch.tensor(np.concatenate([[0], np.cumsum(counts)]), dtype=torch.int32, device=DEVICE)
        positions = torch.tensor(np.concatenate([np.arange(int(self.computed[i]), int(self.computed[i]) + n)
                                                 for i, n in zip(idx.tolist(), counts, strict=True)]), device=DEVICE)
        padded = min(len(ids) + 1, len(self.computed))  # (a padded batch, as CUDA graphs run it)
        theirs = self.theirs.gather_block_tables(idx, padded, num_computed_tokens=self.computed)
        ours = self.ours.gather_block_tables(idx, padded, num_computed_tokens=self.computed)
        for a, b in zip(theirs, ours, strict=True):
            assert torch.equal(a, b), (out, a, b)
        self.masked += self.nulled(idx, theirs)
        for a, b in zip(self.theirs.input_block_tables, self.ours.input_block_tables, strict=True):
            assert torch.equal(a, b)  # (the whole persistent buffers, stale rows included)
        tokens = int(qsl[-1]) + 3
        a = self.theirs.compute_slot_mappings(idx, qsl, positions, tokens)
        b = self.ours.compute_slot_mappings(idx, qsl, positions, tokens)
        assert torch.equal(a, b), (out, a, b)
        assert torch.equal(self.theirs.slot_mappings, self.ours.slot_mappings)
        self.steps += 1


def with_vllms_ids(out, want):
    """gpukv's ``SchedulerOutput`` carrying the block ids of vLLM's own
    scheduler at the same step (``want``, its ``StepRecord``): gpukv's output
    carries none under the worker (the ids stay on the device), and vLLM's
    own ``BlockTables`` must be fed as vLLM's runner would be."""
    new_ids = {rid: [list(g) for g in ids] for rid, ids, _ in want.new}
    cached_ids = {rid: None if ids is None else [list(g) for g in ids] for rid, _, ids, *_ in want.cached}
    assert [n.req_id for n in out.scheduled_new_reqs] == [rid for rid, *_ in want.new]
    assert list(out.scheduled_cached_reqs.req_ids) == [rid for rid, *_ in want.cached]
    cached = dataclasses.replace(out.scheduled_cached_reqs,
                                 new_block_ids=[cached_ids[r] for r in out.scheduled_cached_reqs.req_ids])
    return dataclasses.replace(out, scheduled_new_reqs=[dataclasses.replace(n, block_ids=tuple(new_ids[n.req_id]))
                                                        for n in out.scheduled_new_reqs],
                               scheduled_cached_reqs=cached)


ID_READS = ("get_block_ids", "read_block_ids", "block_table_for", "get_computed_blocks", "allocate_slots",
            "read_num_unheld")
"""The device manager's calls that hand block ids to the host (or take them
from it): under the worker, gpukv's scheduler makes none of them."""


class IdReadGuard:
    """Records every call the adapter (code under ``gpukv.vllm``) makes to
    one of the device manager's ``ID_READS``, or to ``step`` asking for
    block ids, while ``active``; and counts its id-free admissions
    (``read_prefix_hit``, ``admit``) so a stream that never takes the
    per-request path is seen."""

    def __init__(self, monkeypatch) -> None:
        from gpukv.device.manager import DeviceManager

        self.active = True
        self.id_reads: list[tuple[str, str]] = []
        self.sized: dict[str, int] = {"read_prefix_hit": 0, "admit": 0}
        for name in (*ID_READS, "step", *self.sized):
            monkeypatch.setattr(DeviceManager, name, self._guarded(name, getattr(DeviceManager, name)))

    def _guarded(self, name: str, method):
        import sys

        def call(manager, *args, **kwargs):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if self.active and caller.startswith("gpukv.vllm"):
                if name in self.sized:
                    self.sized[name] += 1
                elif name != "step" or kwargs.get("block_ids"):
                    self.id_reads.append((name, caller))
            return method(manager, *args, **kwargs)

        return call


class DifferentialTables(HarnessTables):
    """The harness's table check, and the two ``BlockTables`` after each
    ``schedule()``, fed the block ids of vLLM's own scheduler on the same
    stream (``vllm_records``): gpukv's output must carry none, and its
    scheduler reads none (``guard``; the harness's own check reads them)."""

    def __init__(self, runner: Runner, vllm_records: list, guard: IdReadGuard) -> None:
        super().__init__()
        self.runner = runner
        self.last = None
        self.vllm_records = iter(vllm_records)
        self.guard = guard

    def update(self, out) -> None:
        assert not any(any(n.block_ids) for n in out.scheduled_new_reqs), "a block id reached the host"
        assert all(not ids for ids in out.scheduled_cached_reqs.new_block_ids), "a block id reached the host"
        out = with_vllms_ids(out, next(self.vllm_records))
        super().update(out)
        self.last = out

    def check(self, scheduler) -> None:
        self.guard.active = False  # (the harness compares gpukv's tables with what the runner was fed)
        try:
            super().check(scheduler)
        finally:
            self.guard.active = True
        self.runner.step(self.last)


def window_reach(config: StreamConfig) -> list[int]:
    """Each group's ``sliding_window_reach``, as Model Runner V2 builds it
    (``SlidingWindowSpec.num_retained_tokens``; 0 for full attention)."""
    if config.sliding_window is None:
        return [0]
    window = [config.sliding_window - 1]
    return [0, *window] if config.hybrid else window


def run_differential(cls: type, config: StreamConfig, guard: IdReadGuard) -> tuple[Runner, list]:
    expected = run_stream(VllmAsyncScheduler if is_async(cls) else VllmScheduler, config, check_tables=False)
    with shimmed() as VllmBlockTables:
        from gpukv.vllm.v0_33.tables import adopt

        reach = window_reach(config)

        def tables():
            return VllmBlockTables([BLOCK_SIZE] * len(reach), config.max_num_seqs, config.max_num_batched_tokens,
                                   [WIDTH] * len(reach), DEVICE, sliding_window_reach=reach)

        ours = adopt(tables())  # (before the scheduler: the runner is built first)
        runner = Runner(ours, tables(), config.max_num_seqs)
        try:
            records = run_stream(cls, config, tables=DifferentialTables(runner, expected, guard))
            assert BINDING.manager is not None and BINDING.manager.rows_generation == BINDING._generation
        finally:
            BINDING.reset()
    return runner, records


STREAM = StreamConfig(seed=1, num_requests=10, arrival_steps=6, num_blocks=12, max_num_batched_tokens=48,
                      max_num_seqs=4, num_speculative_tokens=0, abort_rate=0.02, max_output_tokens=40,
                      kv_events=False)


@pytest.mark.parametrize("cls", [gpukv033.DeviceScheduler, gpukv033.DeviceAsyncScheduler],
                         ids=["sync", "async"])
def test_gathered_tables_and_slot_mappings_are_vllms_every_step(cls, monkeypatch):
    guard = IdReadGuard(monkeypatch)
    runner, records = run_differential(cls, STREAM, guard)
    assert guard.id_reads == []
    seen = coverage(records)
    assert runner.steps == sum(1 for r in records if r.num_scheduled_tokens)
    assert runner.steps >= 10
    assert seen["hits"] >= 1 and seen["chunks"] >= 1 and seen["preemptions"] >= 1, seen
    assert seen["aborts"] >= 1, seen


WINDOWED = dataclasses.replace(STREAM, seed=3, sliding_window=20, num_requests=6, max_output_tokens=20, abort_rate=0.0)


HYBRID = dataclasses.replace(WINDOWED, hybrid=True, num_blocks=20)  # (both groups draw on one pool)


@pytest.mark.parametrize("cls, config", [(gpukv033.DeviceAsyncScheduler, WINDOWED), (gpukv033.DeviceScheduler, HYBRID)],
                         ids=["window-async", "hybrid-sync"])
def test_windows_are_nulled_below_the_window_as_vllm_gathers_them(cls, config, monkeypatch):
    """A sliding-window group alone, and a full-attention group beside one:
    vLLM's gather nulls the entries below each request's window (its table
    still holds the ids it was handed); gpukv's table holds the null block
    where its scheduler released a block, the id where it has not yet (under
    async scheduling a step's window runs ahead of the release), and the
    gather, by gpukv's rows with each row's computed tokens, nulls the same
    entries: the gathered tables agree. Windows take the per-request path
    (a lookup and an admission per request): it reads no block id either."""
    guard = IdReadGuard(monkeypatch)
    runner, records = run_differential(cls, config, guard)
    assert guard.id_reads == []
    assert guard.sized["read_prefix_hit"] >= 1 and guard.sized["admit"] >= 1, guard.sized
    assert runner.steps == sum(1 for r in records if r.num_scheduled_tokens)
    assert runner.masked >= 1  # (steps whose gather nulled an entry vLLM's own table still held)
    seen = coverage(records)
    assert seen["hits"] >= 1 and seen["chunks"] >= 1 and seen["preemptions"] >= 1, seen


def test_unbound_runner_refuses_before_reading():
    with shimmed() as VllmBlockTables:
        from gpukv.vllm.v0_33.tables import adopt

        ours = adopt(VllmBlockTables([BLOCK_SIZE], 4, 48, [WIDTH], DEVICE))
        try:
            with pytest.raises(UnsupportedConfigError, match="no gpukv scheduler in its process"):
                ours.apply_staged_writes()
        finally:
            BINDING.reset()


def test_reallocated_tables_are_refused():
    with shimmed() as VllmBlockTables:
        from gpukv.vllm.v0_33.tables import adopt

        ours = adopt(VllmBlockTables([BLOCK_SIZE], 4, 48, [WIDTH], DEVICE))
        try:
            from gpukv.vllm.v0_33.manager import make_backend

            manager = make_backend("device", num_blocks=20, block_size=BLOCK_SIZE, windows=(None,),
                                   max_model_len=MAX_MODEL_LEN, enable_caching=True, enable_kv_cache_events=False,
                                   max_num_reqs=2)
            assert manager._rows.block_table.shape == (1, 4, WIDTH)  # (sized to the runner's rows)
            ours.apply_staged_writes()
            manager._rows._grow(8)  # (as a step needing more rows would)
            with pytest.raises(TablesMovedError, match="reallocated"):
                ours.apply_staged_writes()
        finally:
            BINDING.reset()


def test_row_map_uploaded_only_when_a_request_is_added_and_padding_reads_no_row():
    with shimmed() as VllmBlockTables:
        from gpukv.vllm.v0_33.tables import adopt

        ours = adopt(VllmBlockTables([BLOCK_SIZE], 4, 48, [WIDTH], DEVICE))
        try:
            from gpukv.vllm.v0_33.manager import make_backend

            manager = make_backend("device", num_blocks=20, block_size=BLOCK_SIZE, windows=(None,),
                                   max_model_len=MAX_MODEL_LEN, enable_caching=True, enable_kv_cache_events=False,
                                   max_num_reqs=4)
            manager._reqs["a"] = 2  # (as an admission into row 2 leaves it)
            ours.set_row(3, "a")
            ours.apply_staged_writes()
            uploaded = ours.row_map.gpu
            assert uploaded.tolist() == [-1, -1, -1, 2, -1]
            ours.apply_staged_writes()  # (a step that added no request: nothing to upload)
            assert ours.row_map.gpu is uploaded
            assert ours.rows_of(torch.tensor([3, -1, 0], device=DEVICE)).tolist() == [2, -1, -1]
            ours.set_row(0, "a")
            ours.apply_staged_writes()
            assert ours.row_map.gpu is not uploaded and ours.row_map.gpu.tolist() == [2, -1, -1, 2, -1]
        finally:
            BINDING.reset()


def test_reference_backend_refused_under_the_worker():
    BINDING.expect(max_num_reqs=4, widths=[WIDTH], block_sizes=[BLOCK_SIZE])
    try:
        with pytest.raises(UnsupportedConfigError, match="reference backend"):
            BINDING.sized("reference", BLOCK_SIZE, 1, 4, MAX_MODEL_LEN)
        assert BINDING.sized("device", BLOCK_SIZE, 1, 2, 500) == (4, WIDTH * BLOCK_SIZE)
    finally:
        BINDING.reset()
    assert BINDING.sized("reference", BLOCK_SIZE, 1, 2, 500) == (2, 500)  # (no worker: as before)


@dataclasses.dataclass
class _Parallel:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    decode_context_parallel_size: int = 1


@dataclasses.dataclass
class _Spec:
    method: str


@dataclasses.dataclass
class _Config:
    parallel_config: _Parallel
    speculative_config: _Spec | None = None


@pytest.mark.parametrize("config, what", [
    (_Config(_Parallel(tensor_parallel_size=2)), "tensor parallel size 2"),
    (_Config(_Parallel(pipeline_parallel_size=2)), "pipeline parallel size 2"),
    (_Config(_Parallel(decode_context_parallel_size=2)), "decode context parallelism"),
    (_Config(_Parallel(), _Spec("eagle")), "speculative method 'eagle'"),
])
def test_worker_refuses_what_it_cannot_serve(config, what):
    with pytest.raises(UnsupportedConfigError, match=what):
        check_worker_config(config)
    check_worker_config(_Config(_Parallel(), _Spec("ngram")))  # (n-gram reads no table)


class _Log:
    """Recorded stream calls: streams and events as names."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, ...]] = []
        self.n = 0

    def current_stream(self):
        return _Stream("runner", self)

    def new_event(self):
        self.n += 1
        return _Event(f"e{self.n}", self)


@dataclasses.dataclass
class _Stream:
    name: str
    log: _Log

    def wait_event(self, event) -> None:
        self.log.calls.append(("wait", self.name, event.name))


@dataclasses.dataclass
class _Event:
    name: str
    log: _Log

    def record(self, stream) -> None:
        self.log.calls.append(("record", stream.name, self.name))


def test_ordering_reads_after_gpukv_writes_and_gpukv_writes_after_reads():
    """Each read waits for gpukv's writes so far; gpukv's stream then waits
    for the read, so its later writes (rows freed at update N, handed out
    at schedule N+1) run after it."""
    log = _Log()
    ordering = TableOrdering(_Stream("gpukv", log), log)  # type: ignore[arg-type]
    ordering.before_read()
    log.calls.append(("read",))
    ordering.after_read()
    assert log.calls == [("record", "gpukv", "e1"), ("wait", "runner", "e1"), ("read",),
                         ("record", "runner", "e2"), ("wait", "gpukv", "e2")]
    nothing = _Log()
    TableOrdering(None, nothing).before_read()  # type: ignore[arg-type]
    TableOrdering(None, nothing).after_read()  # type: ignore[arg-type]
    assert nothing.calls == []  # (no streams without CUDA)
