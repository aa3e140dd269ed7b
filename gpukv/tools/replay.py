"""The main job: a serving loop over a trace, driving a block manager.

The loop is vLLM v1's scheduling policy (0.8.5's ``Scheduler.schedule``)
reduced to what the block manager sees (``docs/design.md`` §4,
``docs/chunked_prefill.md``): each step frees what finished, schedules the
running requests in admission order (a decoding request its new token, a
request still prefilling its next prompt chunk), preempting the most recently
admitted request while they do not fit, and, when nothing was preempted,
admits waiting requests from the front, each computing the first chunk of its
prompt with vLLM's rule: each request is looked up and given ``min(tokens -
hit, cap, budget left)`` tokens beyond its hit, charged only those
(``admission="one"``: one ``get_computed_blocks`` + ``allocate_slots`` per
request, as vLLM calls its manager; ``"batch"``: one batched ``step()`` that
applies the same loop on the device). A step schedules at
most ``max_num_batched_tokens`` tokens (vLLM's token budget; None: no budget)
and a chunk is at most ``long_prefill_token_threshold`` tokens (0: no cap);
once the budget is spent, later running requests wait a step and nothing more
is admitted. With no
budget and no cap a prefill computes the whole prompt in its admission step.
A request samples its first output token in the step that computes its last
prompt chunk, as vLLM does, and decodes from the next step on. The budget
applies to Mooncake traces; a step trace says what each step does and runs
unbudgeted.

A preempted request keeps every token it has, including those its update
brought in the step it was preempted in (vLLM appended them before scheduling:
the previous step sampled them), so its resumed prefill computes them; step
and Mooncake traces alike. With Mooncake arrivals by timestamp, stretches in
which nothing runs or waits are skipped, not stepped through: step numbers
keep the arrival clock, the report's ``steps`` counts the steps run and
``skipped_idle_steps`` the rest. The managers hash the tokens themselves.

Beside the hit rate it reaches, a report gives the ceiling
(``no_eviction_hit_rate``: the same trace against a cache that never evicts,
one pass over the prompts), how much of the pool the running requests would
need at their full length (``peak_demand_tokens``), and how many of the
tokens computed were recomputed after a preemption (``gpukv.tools.report``
builds the report from a ``ReplayOutcome``: the values read from the replay
once it has run).
"""

from __future__ import annotations

import itertools
import os
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import numpy as np

from gpukv import _runtime
from gpukv.core.requests import NewRequest, RunningUpdate
from gpukv.tools.defaults import (  # the CLI reads them without importing torch
    DEFAULT_ARRIVAL,  # noqa: F401  (gpukv.tools.replay.DEFAULT_ARRIVAL as before)
    DEFAULT_BLOCK_SIZE,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_NUM_BLOCKS,
    DEFAULT_STEP_MS,  # noqa: F401  (as before)
    PLAIN_DELAY_S,
    PLAIN_INTERVAL_S,
)
from gpukv.tools.report import ReplayOutcome, build_report, no_eviction_hit_rate  # noqa: F401  (re-exported)
from gpukv.tools.traces import Trace, TraceRequest

if TYPE_CHECKING:
    from gpukv.core.metrics import PrefixCacheStats
    from gpukv.tools.prometheus import ServingMetrics


@dataclass
class ReplayOptions:
    block_size: int = DEFAULT_BLOCK_SIZE
    num_blocks: int = DEFAULT_NUM_BLOCKS
    max_model_len: int = 131_072
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    # Both apply vLLM's waiting loop (each request looked up, then new tokens
    # beyond its hit, charged alone): "batch" in one step() call for the
    # step's new requests (gpukv's batched admission), "one" by one call pair
    # per request (get_computed_blocks, allocate_slots), as vLLM's scheduler.
    admission: str = "batch"
    uncached_first: bool = True
    prompt_only: bool = False
    backend: str = "reference"
    hash_key: bytes | str | None = None
    progress: bool = False
    max_steps: int | None = None
    # vLLM 0.8.5's default for its OpenAI server on a GPU of >= 70 GiB (the
    # H100/H200 gpukv targets; 2048 on smaller ones). None: no budget.
    max_num_batched_tokens: int | None = DEFAULT_MAX_NUM_BATCHED_TOKENS
    long_prefill_token_threshold: int = 0  # per request per step; 0: no cap (vLLM's default)
    # A gpukv.tools.prometheus.ServingMetrics updated after every step, or None.
    metrics: ServingMetrics | None = None
    # Compute the ceiling (no_eviction_hit_rate) for the report; a sweep
    # computes it once for all its points instead.
    ceiling: bool = True
    # Called as on_progress(requests done, step) after every step (a sweep's
    # workers report through it), or None.
    on_progress: Callable[[int, int], None] | None = None


@dataclass
class _Live:
    """A request as the replay's scheduler sees it."""

    spec: TraceRequest
    tokens: np.ndarray  # every token known: prompt + generated so far
    status: str = "waiting"  # waiting | running | finished | rejected
    sampled: int = 0  # generated tokens sampled so far (Mooncake)
    num_computed: int = 0  # tokens the manager has computed (0 while waiting)
    admitted_step: int | None = None
    num_cached_tokens: int | None = None
    prefill_done_step: int | None = None  # the step its first prefill computed its last chunk
    block_ids: list[list[int]] | None = None
    preemptions: int = 0
    high_water: int = 0  # the most tokens it ever had computed (a re-admission recomputes up to here)
    finished_step: int | None = None
    reason: str | None = None

    @property
    def rid(self) -> str:
        return self.spec.request_id

    @property
    def prefilling(self) -> bool:
        """Running with known tokens not computed yet: its next chunk is due."""
        return self.status == "running" and self.num_computed < len(self.tokens)

    @property
    def unsent_sampled(self) -> int:
        """Mooncake: tokens sampled but not yet appended to ``tokens`` (the
        next decode update brings them)."""
        if self.spec.output_length is None:
            return 0
        return self.sampled - (len(self.tokens) - self.spec.input_length)

    def record(self) -> dict:
        """Its line of the report."""
        return {
            "admitted_step": self.admitted_step,
            "num_prompt_tokens": self.spec.input_length,
            "num_cached_tokens": self.num_cached_tokens,
            "prefill_done_step": self.prefill_done_step,
            "block_ids": self.block_ids,
            "preemptions": self.preemptions,
            "status": self.status,
            "finished_step": self.finished_step,
            **({"reason": self.reason} if self.reason else {}),
        }


class _TokenBudget:
    """What one step may still schedule: vLLM's ``token_budget`` (None: no
    budget) and ``long_prefill_token_threshold``, the cap on one request's
    chunk (0: no cap)."""

    def __init__(self, total: int | None, cap: int) -> None:
        self.left = total
        self.cap = cap

    @property
    def spent(self) -> bool:
        return self.left is not None and self.left <= 0

    def chunk(self, remaining: int) -> int:
        """The tokens a request with ``remaining`` uncomputed ones computes now."""
        n = remaining if self.cap <= 0 else min(remaining, self.cap)
        return n if self.left is None else min(n, self.left)

    def charge(self, num_tokens: int) -> None:
        if self.left is not None:
            self.left -= num_tokens


def make_manager(opts: ReplayOptions):
    if opts.backend == "reference":
        from gpukv.reference.manager import ReferenceManager

        return ReferenceManager(opts.num_blocks, opts.block_size, uncached_first=opts.uncached_first,
                                hash_key=opts.hash_key)
    if opts.backend == "device":
        from gpukv.device.manager import DeviceManager

        return DeviceManager(opts.num_blocks, opts.block_size, uncached_first=opts.uncached_first,
                             hash_key=opts.hash_key, max_model_len=opts.max_model_len,
                             max_num_reqs=2 * opts.max_num_seqs, max_num_batched_tokens=opts.max_num_batched_tokens)
    raise ValueError(f"unknown backend {opts.backend!r}: use 'reference' or 'device'")


class _PlainLines:
    """A file for tqdm where stderr is no terminal (CI logs, files): each
    refresh becomes one plain line, no carriage returns or padding."""

    def __init__(self, stream) -> None:
        self.stream = stream

    def write(self, text: str) -> None:
        text = text.replace("\r", "").strip()
        if text:
            self.stream.write(text + "\n")

    def flush(self) -> None:
        self.stream.flush()


def _columns(stream) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (OSError, ValueError, AttributeError):
        return 0


class _Progress:
    """Requests done, on stderr, with tqdm: a live bar on a terminal, a plain
    line every ``PLAIN_INTERVAL_S`` seconds elsewhere (so CI logs show it)."""

    def __init__(self, enabled: bool, total: int, desc: str = "replay", position: int | None = None) -> None:
        self.bar = None
        self.done = 0
        self.step = 0
        if not enabled:
            return
        from tqdm import tqdm

        tty = sys.stderr.isatty()
        sized = tty and _columns(sys.stderr) > 0  # a pty with no size set reports 0 columns
        self.bar = tqdm(
            total=total, desc=desc, unit="req", disable=False, leave=True,
            position=position if tty else 0,  # off a terminal, bars are plain lines: no cursor moves
            file=sys.stderr if tty else _PlainLines(sys.stderr),
            mininterval=0.5 if tty else PLAIN_INTERVAL_S, maxinterval=PLAIN_INTERVAL_S * 2,
            delay=0 if tty else PLAIN_DELAY_S, ascii=not tty,
            dynamic_ncols=sized, ncols=None if sized else 80, nrows=None if sized else 24,
        )

    def update(self, done: int, step: int) -> None:
        self.step = step
        if self.bar is None:
            return
        if done > self.done:
            self.bar.update(done - self.done)
            self.done = done
        self.bar.set_postfix_str(f"step {step}", refresh=False)

    def close(self, step: int, ok: bool = True) -> None:
        if self.bar is None:
            return
        if ok:
            self.bar.set_postfix_str(f"step {step}", refresh=False)
        else:
            self.bar.leave = False  # clear the line, so an error message starts on its own
        self.bar.close()
        self.bar = None


class Replay:
    """Runs one trace through one manager; ``run()`` returns the report dict
    (``gpukv.tools.report.build_report`` of the replay's ``outcome``)."""

    def __init__(self, trace: Trace, opts: ReplayOptions, manager=None) -> None:
        cfg = trace.config
        if trace.kind == "step":
            # A step trace's own config wins over the defaults.
            opts.block_size = cfg.get("block_size", opts.block_size)
            opts.num_blocks = cfg.get("num_blocks", opts.num_blocks)
            opts.max_model_len = cfg.get("max_model_len", opts.max_model_len)
        if opts.admission not in ("batch", "one"):
            raise ValueError(f"admission must be 'batch' or 'one', got {opts.admission!r}")
        if opts.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {opts.max_num_seqs}")
        if opts.max_num_batched_tokens is not None and opts.max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_batched_tokens must be positive or None (no budget), "
                             f"got {opts.max_num_batched_tokens}")
        if opts.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0 (0: no cap), "
                             f"got {opts.long_prefill_token_threshold}")
        self.trace, self.opts = trace, opts
        # A step trace says what each step does (which request decodes which
        # tokens), so it runs as written: every prompt whole in its admission step.
        chunked = trace.kind != "step"
        self.max_num_batched_tokens = opts.max_num_batched_tokens if chunked else None
        self.long_prefill_token_threshold = opts.long_prefill_token_threshold if chunked else 0
        self.manager = manager if manager is not None else make_manager(opts)
        self.waiting: deque[_Live] = deque()
        self.running: list[_Live] = []
        self.live: dict[str, _Live] = {}
        self.step_ms: list[float] = []
        self.hit_rate: list[float] = []  # vLLM's prefix cache hit rate so far, after each step
        self.blocks_in_use: list[int] = []
        self.messages: list[str] = []
        self.totals = dict(prompt_tokens=0, cached_tokens=0, admissions=0, preemptions=0, computed_tokens=0,
                           recomputed_tokens=0)
        self.peak_demand = 0  # the most tokens the running requests need at their full length, over the steps
        self.done = 0  # requests finished or rejected
        self.stats: PrefixCacheStats | None = None
        self.skipped_steps = 0
        self._preemptions_observed = 0  # idle steps between far-apart arrivals, not run

    # --------------------------------------------------------------- driving
    def run(self) -> dict:
        trace, opts = self.trace, self.opts
        n_total = trace.num_requests
        progress = _Progress(opts.progress, n_total, f"replay ({opts.backend})")
        arrivals: dict[int, list[TraceRequest]] = {}
        if trace.steps is None:
            for r in trace.requests:
                arrivals.setdefault(r.arrival_step, []).append(r)
        arrival_steps = sorted(arrivals)
        next_arrival = 0  # index into arrival_steps
        step = 0  # the step's number (with --arrival timestamp: time / step_ms)
        executed = 0  # steps run; idle stretches between arrivals are skipped
        t0 = time.perf_counter()
        try:
            while True:
                if trace.steps is not None:
                    if step >= len(trace.steps):
                        break
                    ev = trace.steps[step]
                    self._step(step, ev.finish, ev.decode, ev.new)
                else:
                    while next_arrival < len(arrival_steps) and arrival_steps[next_arrival] < step:
                        next_arrival += 1
                    if not self.waiting and not self.running:
                        if next_arrival == len(arrival_steps):
                            break
                        # Nothing runs or waits until the next arrival: those steps
                        # would call the manager with nothing to do. Skip them.
                        if arrival_steps[next_arrival] > step:
                            self.skipped_steps += arrival_steps[next_arrival] - step
                            step = arrival_steps[next_arrival]
                    finish, decode = self._mooncake_events()
                    self._step(step, finish, decode, arrivals.get(step, []))
                step += 1
                executed += 1
                progress.update(self.done, step)
                if opts.on_progress is not None:
                    opts.on_progress(self.done, step)
                if opts.max_steps is not None and executed >= opts.max_steps:
                    self.messages.append(f"stopped after --max-steps {opts.max_steps}")
                    break
        except BaseException:
            progress.close(step, ok=False)
            raise
        progress.update(self.done, step)
        progress.close(step)
        return build_report(_outcome(self, executed, time.perf_counter() - t0))

    def _mooncake_events(self) -> tuple[list[str], dict[str, np.ndarray]]:
        """A Mooncake step's events: decoding requests that sampled their last
        token (or, with ``prompt_only``, finished their prefill) finish, the
        others bring the token they sampled last. A request still prefilling
        has no event: the scheduler gives it its next chunk."""
        finish, decode = [], {}
        for live in self.running:
            if live.prefilling:
                continue
            # A Mooncake request always says how many tokens it generates.
            if self.opts.prompt_only or live.sampled >= cast(int, live.spec.output_length):
                finish.append(live.rid)
            else:
                decode[live.rid] = live.spec.output_tokens(live.sampled - 1, live.sampled)
        return finish, decode

    def _timed(self, fn: Callable, *args, **kwargs):
        t = time.perf_counter()
        out = fn(*args, **kwargs)
        self._t_step += time.perf_counter() - t
        return out

    def _step(self, step: int, finish_ids, decode: dict, arrivals: list[TraceRequest]) -> None:
        self._t_step = 0.0
        finished = self._finish_listed(finish_ids, step)
        for spec in arrivals:  # they join the back of the waiting queue
            self._arrive(spec, step)
        budget = _TokenBudget(self.max_num_batched_tokens, self.long_prefill_token_threshold)
        updates = self._running_updates(step, decode, finished, budget)
        batch = self._admission_batch(budget) if self.opts.admission == "batch" else []
        result = self._timed(self.manager.step, finished, updates, [self._new_request(lv, budget.cap) for lv in batch],
                             token_budget=budget.left)
        if not result.ok:
            self._note_demand()  # the running requests a preemption is about to thin out
        preempted = self._apply_running(step, updates, result)
        # Admission, only when nothing was preempted (vLLM's rule).
        if not preempted:
            if self.opts.admission == "batch":
                for hit, new in zip(result.num_computed_tokens, result.num_new_tokens, strict=True):
                    self._admitted(self.waiting.popleft(), step, hit, hit + new)
            else:
                self._admit_one_by_one(step, budget)
            if not self.running and self.waiting:
                # Nothing runs, so every block is free; a request that still
                # does not fit never will. Rejecting it keeps the replay moving.
                self._reject(self.waiting.popleft(), step, "did not fit into an empty pool")
        self._record_step()

    # ------------------------------------------------------------ scheduling
    def _finish_listed(self, finish_ids, step: int) -> list[str]:
        """Finish the listed requests, in order; the running ones' ids (their
        blocks are freed first in the step)."""
        finished: list[str] = []
        for rid in finish_ids:
            live = self.live.get(rid)
            if live is None or live.status in ("finished", "rejected"):
                continue
            if live.status == "running":
                self.running.remove(live)
                finished.append(rid)
            else:
                self.waiting.remove(live)
            self._finish(live, step, "finished")
        return finished

    def _running_updates(self, step: int, decode: dict, finished: list[str],
                         budget: _TokenBudget) -> list[RunningUpdate]:
        """The running requests' updates in admission order while the budget
        lasts: a request still prefilling computes its next chunk, a decoding
        one the tokens it brings. Once the budget is spent the rest wait a
        step: they neither progress nor sample (vLLM stops its running loop
        there too). One that would pass ``max_model_len`` finishes instead
        (appended to ``finished``)."""
        updates = []
        for live in list(self.running):
            if budget.spent:
                break
            if live.prefilling:
                chunk = budget.chunk(len(live.tokens) - live.num_computed)
                updates.append(RunningUpdate(live.rid, (), chunk))
                budget.charge(chunk)
                continue
            tokens = decode.get(live.rid)
            if tokens is None:
                continue
            if len(live.tokens) + len(tokens) > self.opts.max_model_len:
                self.running.remove(live)
                finished.append(live.rid)
                self._finish(live, step, "finished", reason="reached max_model_len")
                continue
            updates.append(RunningUpdate(live.rid, tokens))
            # A Mooncake decode is one token, within any budget left; a step
            # trace (several tokens at once) runs unbudgeted.
            budget.charge(len(tokens))
        return updates

    def _admission_batch(self, budget: _TokenBudget) -> list[_Live]:
        """``admission="batch"``: the front of the waiting queue while seats
        last, stopping at a request that can never fit (it waits until nothing
        runs, then is rejected). The step applies vLLM's waiting loop to them
        on the device: each is looked up and gets ``min(tokens - hit, cap,
        budget left)`` tokens past its hit, charged alone, until the budget is
        spent or one does not fit (``step(..., token_budget=)``)."""
        if budget.spent:
            return []
        batch = []
        for live in itertools.islice(self.waiting, max(0, self.opts.max_num_seqs - len(self.running))):
            if self._never_fits(live):
                break
            batch.append(live)
        return batch

    def _admit_one_by_one(self, step: int, budget: _TokenBudget) -> None:
        """``admission="one"``: vLLM's waiting-queue loop (``Scheduler.schedule``),
        one request at a time from the front of the queue while seats and the
        budget last: look its hit up (``get_computed_blocks``), schedule
        ``min(tokens - hit, cap, budget left)`` new tokens, charged alone (a
        cached prefix is free), and allocate blocks for the hit plus those
        (``allocate_slots``); stop at the first that does not fit."""
        while (self.waiting and len(self.running) < self.opts.max_num_seqs and not budget.spent
               and not self._never_fits(self.waiting[0])):
            live = self.waiting[0]
            request = self._new_request(live, len(live.tokens))
            computed = self._timed(self.manager.get_computed_blocks, request)
            new = budget.chunk(len(live.tokens) - computed.num_tokens)
            if self._timed(self.manager.allocate_slots, request, computed=computed, num_tokens=new) is None:
                break
            budget.charge(new)
            self._admitted(self.waiting.popleft(), step, computed.num_tokens, computed.num_tokens + new)

    def _apply_running(self, step: int, updates: list[RunningUpdate], result) -> bool:
        """Preempt the most recently admitted request while the running
        updates do not fit, then record what the applied ones computed; True
        when anything was preempted."""
        applied = updates[: result.running_failed_at if not result.ok else len(updates)]
        pending = {u.request_id: u.new_token_ids for u in updates}
        preempted = False
        while not result.ok:
            failing = updates[result.running_failed_at]
            victim = self.running.pop()
            # The victim's update of this step was never applied (updates run
            # in admission order and victims are the latest admitted): its
            # tokens were sampled by the previous step, so it keeps them and
            # its resumed prefill computes them, as in vLLM.
            self._preempt(victim, pending.get(victim.rid))
            preempted = True
            if victim.rid == failing.request_id:
                break
            updates = [u for u in updates[result.running_failed_at:] if u.request_id != victim.rid]
            result = self._timed(self.manager.step, (), updates, ())
            applied += updates[: result.running_failed_at if not result.ok else len(updates)]
        for u in applied:
            live = self.live[u.request_id]
            if len(u.new_token_ids):  # a chunk brings none (an empty tuple would make the tokens float)
                live.tokens = np.concatenate([live.tokens, u.new_token_ids])
            chunk = u.num_tokens_to_compute
            upto = len(live.tokens) if chunk is None else live.num_computed + chunk
            self._count_work(live, live.num_computed, upto)
            self._computed(live, upto, step)
        return preempted

    def _record_step(self) -> None:
        self.step_ms.append(self._t_step * 1e3)
        self.blocks_in_use.append(self.manager.num_blocks - 1 - self.manager.read_num_free_blocks())
        self._note_demand()
        stats = self.manager.make_prefix_cache_stats()
        if self.opts.metrics is not None:
            self._observe(self.opts.metrics, stats)
        if self.stats is None:
            self.stats = stats
        else:
            self.stats.merge(stats)
        self.hit_rate.append(self.stats.hit_rate)

    def _note_demand(self) -> None:
        """What the running requests need at their full length, in whole blocks (as the pool holds them)."""
        bs = self.opts.block_size
        self.peak_demand = max(self.peak_demand, bs * sum(-(-self._full_length(lv) // bs) for lv in self.running))

    def _full_length(self, live: _Live) -> int:
        """The tokens ``live`` holds once it finishes (a step trace's request:
        the tokens it has, all the replay knows)."""
        out = live.spec.output_length
        if out is None:
            return len(live.tokens)
        return live.spec.input_length + (0 if self.opts.prompt_only else out)

    def _count_work(self, live: _Live, start: int, stop: int) -> None:
        """``live``'s tokens ``start..stop-1`` are computed now; those it had
        computed before a preemption are counted as recomputed."""
        if stop > start:
            self.totals["computed_tokens"] += stop - start
            self.totals["recomputed_tokens"] += max(0, min(stop, live.high_water) - start)
        live.high_water = max(live.high_water, stop)

    def _observe(self, metrics: ServingMetrics, stats) -> None:
        """This step into the Prometheus metrics (``--metrics-port``)."""
        m = self.manager
        preemptions = self.totals["preemptions"]
        metrics.observe_step(
            stats, usage=self.blocks_in_use[-1] / (m.num_blocks - 1), blocks_in_use=self.blocks_in_use[-1],
            running=len(self.running), waiting=len(self.waiting),
            preemptions=preemptions - self._preemptions_observed, evictions_total=m.read_num_evictions(),
            step_seconds=self._t_step)
        self._preemptions_observed = preemptions

    # ----------------------------------------------------------- transitions
    def _arrive(self, spec: TraceRequest, step: int) -> None:
        tokens = spec.prompt_tokens()
        live = _Live(spec, tokens)
        self.live[spec.request_id] = live
        n_blocks = -(-len(tokens) // self.opts.block_size) * self.manager.num_groups
        if len(tokens) > self.opts.max_model_len:
            self._reject(live, step, f"prompt of {len(tokens)} tokens exceeds max_model_len {self.opts.max_model_len}")
        elif n_blocks > self.manager.num_blocks - 1:
            self._reject(live, step, f"needs {n_blocks} blocks, more than the pool's {self.manager.num_blocks - 1}")
        else:
            self.waiting.append(live)

    def _never_fits(self, live: _Live) -> bool:
        """Whether ``live`` (a resumed request may have grown) exceeds
        ``max_model_len`` or needs more blocks than the pool has. Judged on
        every token, not the first chunk: the prefill must hold them all."""
        n = len(live.tokens)
        return (n > self.opts.max_model_len
                or -(-n // self.opts.block_size) * self.manager.num_groups > self.manager.num_blocks - 1)

    def _new_request(self, live: _Live, chunk: int) -> NewRequest:
        # The manager hashes the tokens itself (caller-supplied digests are
        # deprecated: they could poison the cache). ``chunk``: the most tokens
        # past the hit (0 or the whole prompt: None, the unchunked call).
        spec = live.spec
        # NewRequest takes a 1-D integer array (its docstring); its annotation says only Sequence[int].
        return NewRequest(spec.request_id, live.tokens, lora_id=spec.lora_id, mm_items=spec.mm_items,  # type: ignore[arg-type]
                          cache_salt=spec.cache_salt, skip_prefix_cache=spec.skip_prefix_cache,
                          num_tokens_to_compute=None if chunk <= 0 or chunk >= len(live.tokens) else chunk,
                          num_preemptions=live.preemptions)  # re-admissions count apart in the stats

    def _admitted(self, live: _Live, step: int, num_cached: int, num_computed: int) -> None:
        live.status = "running"
        self.running.append(live)
        if live.admitted_step is None:
            live.admitted_step = step
            live.num_cached_tokens = num_cached
        self.totals["admissions"] += 1
        self.totals["prompt_tokens"] += len(live.tokens)
        self.totals["cached_tokens"] += num_cached
        self._count_work(live, num_cached, num_computed)
        self._computed(live, num_computed, step)

    def _computed(self, live: _Live, num_computed: int, step: int) -> None:
        """The manager has computed ``live``'s first ``num_computed`` tokens.
        Once it has every known one, the step samples the next token (for a
        Mooncake request): as in vLLM, the step that computes a prompt's last
        chunk samples its first output token, and the request decodes from
        the next step on. A request's record keeps its blocks as its first
        prefill leaves them."""
        live.num_computed = num_computed
        if num_computed < len(live.tokens):
            return
        if live.prefill_done_step is None:
            live.prefill_done_step = step
            live.block_ids = self.manager.get_block_ids(live.rid)
        if live.spec.output_length is not None:
            live.sampled += 1

    def _preempt(self, live: _Live, unapplied=None) -> None:
        self._timed(self.manager.free, live.rid)
        if unapplied is not None and len(unapplied):
            # The tokens its update brought this step (for a Mooncake request,
            # the last sampled one; vLLM keeps them and the resumed prefill
            # computes them).
            live.tokens = np.concatenate([live.tokens, np.asarray(unapplied, dtype=np.int64)])
        elif live.unsent_sampled > 0:
            # A Mooncake request preempted without an update this step (one
            # the budget left out) still keeps its last sampled token.
            appended = len(live.tokens) - live.spec.input_length
            live.tokens = np.concatenate([live.tokens, live.spec.output_tokens(appended, live.sampled)])
        live.num_computed = 0
        live.status = "waiting"
        live.preemptions += 1
        self.totals["preemptions"] += 1
        self.waiting.appendleft(live)

    def _finish(self, live: _Live, step: int, status: str, reason: str | None = None) -> None:
        self.done += 1
        live.status = status
        live.finished_step = step
        live.reason = reason

    def _reject(self, live: _Live, step: int, reason: str) -> None:
        self._finish(live, step, "rejected", reason)
        self.messages.append(f"request {live.rid} rejected: {reason}")


def _outcome(replay: Replay, num_steps: int, wall_s: float) -> ReplayOutcome:
    """What the report reads of a finished replay and its manager, read once."""
    manager = replay.manager
    return ReplayOutcome(
        config=_config_record(replay), requests={rid: lv.record() for rid, lv in replay.live.items()},
        trace=replay.trace, ceiling=replay.opts.ceiling, stats=replay.stats, totals=dict(replay.totals),
        running_at_end=len(replay.running), waiting_at_end=len(replay.waiting), steps=num_steps,
        skipped_steps=replay.skipped_steps, peak_demand=replay.peak_demand,
        pool_tokens=(manager.num_blocks - 1) * replay.opts.block_size, evictions=manager.read_num_evictions(),
        final={"free_queue": manager.free_queue(), "num_free_blocks": manager.read_num_free_blocks()},
        messages=replay.messages, step_ms=replay.step_ms, hit_rate=replay.hit_rate,
        blocks_in_use=replay.blocks_in_use, wall_s=wall_s)


def _config_record(replay: Replay) -> dict:
    """The configuration the replay ran with."""
    opts = replay.opts
    return {
        "block_size": opts.block_size, "num_blocks": opts.num_blocks,
        "max_model_len": opts.max_model_len, "max_num_seqs": opts.max_num_seqs,
        "admission": opts.admission, "uncached_first": opts.uncached_first,
        # As applied: a step trace runs unbudgeted (None, 0).
        "max_num_batched_tokens": replay.max_num_batched_tokens,
        "long_prefill_token_threshold": replay.long_prefill_token_threshold,
        "prompt_only": opts.prompt_only, "trace_kind": replay.trace.kind,
        "backend": opts.backend,
        # The device manager's kernels ran under Triton's interpreter (no
        # CUDA): its times per step are the interpreter's, not the GPU's.
        "interpreted": opts.backend == "device" and _runtime.INTERPRETED,
        "sliding_windows": list(getattr(replay.manager, "sliding_windows", [None])),
    }
