"""The main job: a serving loop over a trace, driving a block manager.

The loop is vLLM v1's scheduling policy reduced to what the block manager
sees (``docs/design.md`` §4 states it in full): each step frees what finished,
gives running requests the blocks for their new tokens (preempting the most
recently admitted request while they do not fit), and, when nothing was
preempted, admits waiting requests from the front. A prefill computes the whole
prompt in its step.

A preempted request keeps every token it has, including those its update
brought in the step it was preempted in (vLLM appended them before scheduling:
the previous step sampled them), so its resumed prefill computes them; step
and Mooncake traces alike. With Mooncake arrivals by timestamp, stretches in
which nothing runs or waits are skipped, not stepped through: step numbers
keep the arrival clock, the report's ``steps`` counts the steps run and
``skipped_idle_steps`` the rest. The managers hash the tokens themselves.
"""

from __future__ import annotations

import itertools
import os
import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import numpy as np

from gpukv.request import NewRequest, RunningUpdate
from gpukv.traces import Trace, TraceRequest


@dataclass
class ReplayOptions:
    block_size: int = 16
    num_blocks: int = 65_536
    max_model_len: int = 131_072
    max_num_seqs: int = 256
    admission: str = "batch"  # or "one": one step call per admitted request (vLLM's order)
    uncached_first: bool = True
    prompt_only: bool = False
    backend: str = "reference"
    hash_key: bytes | str | None = None
    progress: bool = False
    max_steps: int | None = None


@dataclass
class _Live:
    """A request as the replay's scheduler sees it."""

    spec: TraceRequest
    tokens: np.ndarray  # every token known: prompt + generated so far
    status: str = "waiting"  # waiting | running | finished | rejected
    sampled: int = 0  # generated tokens sampled so far (Mooncake)
    admitted_step: int | None = None
    num_cached_tokens: int | None = None
    block_ids: list[list[int]] | None = None
    preemptions: int = 0
    finished_step: int | None = None
    reason: str | None = None

    @property
    def rid(self) -> str:
        return self.spec.request_id


def make_manager(opts: ReplayOptions):
    if opts.backend == "reference":
        from gpukv.reference import KVCacheManager
    elif opts.backend == "device":
        from gpukv.manager import KVCacheManager
    else:
        raise ValueError(f"unknown backend {opts.backend!r}: use 'reference' or 'device'")
    kwargs = dict(max_model_len=opts.max_model_len, max_num_reqs=2 * opts.max_num_seqs) if opts.backend == "device" else {}
    return KVCacheManager(opts.num_blocks, opts.block_size, uncached_first=opts.uncached_first, hash_key=opts.hash_key,
                          **kwargs)


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


# Where stderr is no terminal, a line at most every this many seconds, and
# none at all for a replay shorter than PLAIN_DELAY_S.
PLAIN_INTERVAL_S = 15.0
PLAIN_DELAY_S = 5.0


def _columns(stream) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (OSError, ValueError, AttributeError):
        return 0


class _Progress:
    """Requests done, on stderr, with tqdm: a live bar on a terminal, a plain
    line every ``PLAIN_INTERVAL_S`` seconds elsewhere (so CI logs show it)."""

    def __init__(self, enabled: bool, total: int, desc: str = "replay") -> None:
        self.bar = None
        self.done = 0
        if not enabled:
            return
        from tqdm import tqdm

        tty = sys.stderr.isatty()
        sized = tty and _columns(sys.stderr) > 0  # a pty with no size set reports 0 columns
        self.bar = tqdm(
            total=total, desc=desc, unit="req", disable=False, leave=True,
            file=sys.stderr if tty else _PlainLines(sys.stderr),
            mininterval=0.5 if tty else PLAIN_INTERVAL_S, maxinterval=PLAIN_INTERVAL_S * 2,
            delay=0 if tty else PLAIN_DELAY_S, ascii=not tty,
            dynamic_ncols=sized, ncols=None if sized else 80, nrows=None if sized else 24,
        )

    def update(self, done: int, step: int) -> None:
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
    """Runs one trace through one manager; ``run()`` returns the report dict."""

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
        self.trace, self.opts = trace, opts
        self.manager = manager if manager is not None else make_manager(opts)
        self.waiting: deque[_Live] = deque()
        self.running: list[_Live] = []
        self.live: dict[str, _Live] = {}
        self.step_ms: list[float] = []
        self.hit_rate: list[float] = []  # token hit rate so far, after each step
        self.blocks_in_use: list[int] = []
        self.messages: list[str] = []
        self.totals = dict(prompt_tokens=0, cached_tokens=0, admissions=0, preemptions=0)
        self.stats = None
        self.skipped_steps = 0  # idle steps between far-apart arrivals, not run

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
                progress.update(sum(l.status in ("finished", "rejected") for l in self.live.values()), step)
                if opts.max_steps is not None and executed >= opts.max_steps:
                    self.messages.append(f"stopped after --max-steps {opts.max_steps}")
                    break
        except BaseException:
            progress.close(step, ok=False)
            raise
        progress.update(sum(l.status in ("finished", "rejected") for l in self.live.values()), step)
        progress.close(step)
        return self._report(executed, time.perf_counter() - t0)

    def _mooncake_events(self) -> tuple[list[str], dict[str, np.ndarray]]:
        finish, decode = [], {}
        for live in self.running:
            if self.opts.prompt_only or live.sampled >= live.spec.output_length:
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
        opts = self.opts
        # (1) finish, in the listed order
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
        # (2) arrivals join the back of the waiting queue
        for spec in arrivals:
            self._arrive(spec, step)
        # (3) decode, in the running list's (admission) order
        updates = []
        for live in list(self.running):
            tokens = decode.get(live.rid)
            if tokens is None:
                continue
            if len(live.tokens) + len(tokens) > opts.max_model_len:
                self.running.remove(live)
                finished.append(live.rid)
                self._finish(live, step, "finished", reason="reached max_model_len")
                continue
            updates.append(RunningUpdate(live.rid, tokens))
        batch = []
        if opts.admission == "batch":
            # The front of the queue, stopping at a request that can never fit
            # (it waits until nothing runs, then is rejected below).
            for live in itertools.islice(self.waiting, max(0, opts.max_num_seqs - len(self.running))):
                if self._never_fits(live):
                    break
                batch.append(live)
        result = self._timed(self.manager.step, finished, updates, [self._new_request(l) for l in batch])
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
            live.tokens = np.concatenate([live.tokens, u.new_token_ids])
            if live.spec.output_length is not None:
                live.sampled += 1
        # (4) admission, only when nothing was preempted
        if not preempted:
            if opts.admission == "batch":
                for i in range(result.num_admitted):
                    self._admitted(self.waiting.popleft(), step, result.num_computed_tokens[i])
            else:
                while self.waiting and len(self.running) < opts.max_num_seqs and not self._never_fits(self.waiting[0]):
                    res = self._timed(self.manager.step, (), (), [self._new_request(self.waiting[0])])
                    if res.num_admitted == 0:
                        break
                    self._admitted(self.waiting.popleft(), step, res.num_computed_tokens[0])
            if not self.running and self.waiting:
                # Nothing runs, so every block is free; a request that still
                # does not fit never will. Rejecting it keeps the replay moving.
                self._reject(self.waiting.popleft(), step, "did not fit into an empty pool")
        self.step_ms.append(self._t_step * 1e3)
        tot = self.totals
        self.hit_rate.append(tot["cached_tokens"] / tot["prompt_tokens"] if tot["prompt_tokens"] else 0.0)
        self.blocks_in_use.append(self.manager.num_blocks - 1 - self.manager.num_free_blocks)
        stats = self.manager.make_prefix_cache_stats()
        if self.stats is None:
            self.stats = stats
        else:
            self.stats.merge(stats)

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
        ``max_model_len`` or needs more blocks than the pool has."""
        n = len(live.tokens)
        return n > self.opts.max_model_len or -(-n // self.opts.block_size) * self.manager.num_groups > self.manager.num_blocks - 1

    def _new_request(self, live: _Live) -> NewRequest:
        # The manager hashes the tokens itself (caller-supplied digests are
        # deprecated: they could poison the cache).
        spec = live.spec
        return NewRequest(spec.request_id, live.tokens, lora_id=spec.lora_id, mm_items=spec.mm_items,
                          cache_salt=spec.cache_salt, skip_prefix_cache=spec.skip_prefix_cache)

    def _admitted(self, live: _Live, step: int, num_cached: int) -> None:
        live.status = "running"
        self.running.append(live)
        if live.admitted_step is None:
            live.admitted_step = step
            live.num_cached_tokens = num_cached
            live.block_ids = self.manager.get_block_ids(live.rid)
        self.totals["admissions"] += 1
        self.totals["prompt_tokens"] += len(live.tokens)
        self.totals["cached_tokens"] += num_cached
        if live.spec.output_length is not None:
            live.sampled += 1  # the prefill samples the next token

    def _preempt(self, live: _Live, unapplied=None) -> None:
        self._timed(self.manager.free, live.rid)
        if unapplied is not None and len(unapplied):
            # The tokens its update brought this step (for a Mooncake request,
            # the last sampled one; vLLM keeps them and the resumed prefill
            # computes them).
            live.tokens = np.concatenate([live.tokens, np.asarray(unapplied, dtype=np.int64)])
        elif live.spec.output_length is not None and live.sampled > 0:
            # A Mooncake request preempted without an update this step still
            # keeps its last sampled token.
            live.tokens = np.concatenate([live.tokens, live.spec.output_tokens(live.sampled - 1, live.sampled)])
        live.status = "waiting"
        live.preemptions += 1
        self.totals["preemptions"] += 1
        self.waiting.appendleft(live)

    def _finish(self, live: _Live, step: int, status: str, reason: str | None = None) -> None:
        live.status = status
        live.finished_step = step
        live.reason = reason

    def _reject(self, live: _Live, step: int, reason: str) -> None:
        self._finish(live, step, "rejected", reason)
        self.messages.append(f"request {live.rid} rejected: {reason}")

    # ---------------------------------------------------------------- report
    def _report(self, num_steps: int, wall_s: float) -> dict:
        stats = self.stats
        tot = self.totals
        ms = np.array(self.step_ms) if self.step_ms else np.zeros(1)
        summary = {
            "backend": self.opts.backend,
            "requests": len(self.live),
            "finished": sum(l.status == "finished" for l in self.live.values()),
            "rejected": sum(l.status == "rejected" for l in self.live.values()),
            "steps": num_steps,
            "skipped_idle_steps": self.skipped_steps,
            "prompt_tokens": tot["prompt_tokens"],
            "cached_tokens": tot["cached_tokens"],
            "token_hit_rate": tot["cached_tokens"] / tot["prompt_tokens"] if tot["prompt_tokens"] else 0.0,
            "queries": stats.queries if stats else 0,
            "hits": stats.hits if stats else 0,
            "block_hit_rate": stats.hit_rate if stats else 0.0,
            "lookup_requests": stats.requests if stats else 0,
            "admissions": tot["admissions"],
            "preemptions": tot["preemptions"],
            "evictions": self.manager.num_evictions,
            "max_blocks_in_use": max(self.blocks_in_use, default=0),
            "mean_blocks_in_use": float(np.mean(self.blocks_in_use)) if self.blocks_in_use else 0.0,
            "manager_ms_per_step_mean": float(ms.mean()),
            "manager_ms_per_step_p50": float(np.percentile(ms, 50)),
            "manager_ms_per_step_p99": float(np.percentile(ms, 99)),
            "wall_s": wall_s,
        }
        requests = {}
        for rid, l in self.live.items():
            requests[rid] = {
                "admitted_step": l.admitted_step,
                "num_prompt_tokens": l.spec.input_length,
                "num_cached_tokens": l.num_cached_tokens,
                "block_ids": l.block_ids,
                "preemptions": l.preemptions,
                "status": l.status,
                "finished_step": l.finished_step,
                **({"reason": l.reason} if l.reason else {}),
            }
        return {
            "config": {
                "block_size": self.opts.block_size, "num_blocks": self.opts.num_blocks,
                "max_model_len": self.opts.max_model_len, "max_num_seqs": self.opts.max_num_seqs,
                "admission": self.opts.admission, "uncached_first": self.opts.uncached_first,
                "prompt_only": self.opts.prompt_only, "trace_kind": self.trace.kind,
                "backend": self.opts.backend,
                "sliding_windows": list(getattr(self.manager, "sliding_windows", [None])),
            },
            "summary": summary,
            "requests": requests,
            "final": {"free_queue": self.manager.free_queue(), "num_free_blocks": self.manager.num_free_blocks},
            "messages": self.messages,
            "step_ms": [round(x, 4) for x in self.step_ms],
            "hit_rate_per_step": [round(x, 5) for x in self.hit_rate],
            "blocks_in_use": self.blocks_in_use,
        }
