"""Random request streams on a vLLM 0.33 scheduler, every step recorded.

:func:`run_stream` drives one scheduler class through a seeded stream:
requests arrive over the first steps with prompts drawn from a few shared
prefixes (so they hit each other's blocks), random lengths and output
budgets, under a small token budget and pool (chunked prefill, preemption and
resumption), with speculative drafts (some accepted, some rejected), prompt
logprobs and aborts. :class:`StepRecord` is what one step shows from outside
the block manager: the ``SchedulerOutput`` as plain data, the stats and usage,
the KV events published, the tokens returned. Two classes that make the same
decisions produce equal records, so ``run_stream(gpukv_cls, seed) ==
run_stream(VllmScheduler, seed)`` is the step-by-step comparison a gpukv class
has to pass.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from .harness import (
    BlockTables,
    Engine,
    KVView,
    LoRARequest,
    PauseState,
    RequestStatus,
    make_requests,
    make_scheduler,
)

PREFIX_BLOCKS = (0, 1, 2, 3)  # a prompt shares 0..3 blocks of one of the prefixes
NUM_PREFIXES = 3
BLOCK_SIZE = 16


@dataclass(frozen=True)
class StreamConfig:
    """A stream's shape; ``seed`` decides everything else."""

    seed: int
    num_requests: int = 24
    arrival_steps: int = 12
    num_blocks: int = 20
    max_num_batched_tokens: int = 64
    max_num_seqs: int = 6
    long_prefill_threshold: int = 0  # the scheduler config's long_prefill_token_threshold (0: none)
    adaptive_threshold: bool = False  # with it: floored at a fair share of the budget (..._adaptive)
    num_speculative_tokens: int = 2  # 0: no speculative decoding
    abort_rate: float = 0.004
    sliding_window: int | None = None  # a sliding-window group of this many tokens (None: full attention only)
    hybrid: bool = False  # with sliding_window: a full-attention group, then the window group
    second_window: int | None = None  # with sliding_window: a second window group of this many tokens
    mla: bool = False  # MLA layers (MLAAttentionSpec, SlidingWindowMLASpec) in place of the attention groups above
    mm: bool = False  # images in the prompts (MM_IMAGES: the same placeholders, other content), an encoder budget
    max_output_tokens: int = 47  # each request's output budget: 1..this many tokens
    kv_events: bool = True  # False: no KV events (what gpukv's batched running loop needs)
    # vLLM 0.34 on: prompt-logprob requests start scoring at a random prompt token (their hits bounded there)
    bounded_hits: bool = False
    cache_aware_window: int = 0  # vLLM 0.34 on: cache-aware admission over the first N waiting requests
    watermark: float = 0.0  # the scheduler config's watermark (fraction of the pool kept free at admission)
    prefix_caching: bool = True  # False: no block is ever cached (a window's released blocks all uncached)
    priority: bool = False  # the priority policy, each request a random priority 0..3
    lora: bool = False  # each request one of LORAS (a base one, reloads and re-pointed ids among them)
    max_loras: int = 0  # with lora: a LoRAConfig allowing this many adapters a step (0: none)
    prefill_interval: int = 1  # the prefill cadence (prefill_schedule_interval)
    bends: bool = False  # each schedule() at random throttled (DP prefill balancing), paused for new requests or all
    reset_rate: float = 0.0  # before a step with running requests: reset_prefix_cache(reset_running_requests=True)


@dataclass
class StepRecord:
    """One step, as plain comparable data."""

    new: list[tuple[str, tuple[tuple[int, ...], ...], int]]
    cached: list[tuple[str, bool, tuple[tuple[int, ...], ...] | None, int, int]]
    num_scheduled_tokens: dict[str, int]
    spec_decode_tokens: dict[str, tuple[int, ...]]
    finished: frozenset[str]
    preempted: frozenset[str]
    tokens: dict[str, tuple[int, ...]] = field(default_factory=dict)
    finish_reasons: dict[str, str] = field(default_factory=dict)
    prefix_cache: tuple[int, ...] | None = None
    spec: tuple[int, int, int] | None = None
    usage: float | None = None
    events: list[tuple[Any, ...]] = field(default_factory=list)
    aborted: tuple[str, ...] = ()  # finish_requests(..., FINISHED_ABORTED) just before this step
    reset: bool | None = None  # reset_prefix_cache(reset_running_requests=True)'s answer just before this step
    boundaries: dict[str, int] = field(default_factory=dict)  # new requests' shared_prefix_boundary
    encoder_inputs: dict[str, tuple[int, ...]] = field(default_factory=dict)  # multimodal inputs scheduled


def _groups(block_ids):
    return None if block_ids is None else tuple(tuple(group) for group in block_ids)


def record_output(out) -> StepRecord:
    """A ``SchedulerOutput`` as a :class:`StepRecord` (the model's side filled in later)."""
    c = out.scheduled_cached_reqs
    resumed = getattr(c, "resumed_req_ids", ())  # (a V1 model runner's; vLLM 0.34 re-sends them as new)
    return StepRecord(
        new=[(n.req_id, _groups(n.block_ids), n.num_computed_tokens) for n in out.scheduled_new_reqs],
        cached=[(rid, rid in resumed, _groups(ids), computed, outputs) for rid, ids, computed, outputs
                in zip(c.req_ids, c.new_block_ids, c.num_computed_tokens, c.num_output_tokens, strict=True)],
        num_scheduled_tokens=dict(out.num_scheduled_tokens),
        spec_decode_tokens={rid: tuple(t) for rid, t in out.scheduled_spec_decode_tokens.items()},
        finished=frozenset(out.finished_req_ids),
        preempted=frozenset(out.preempted_req_ids or ()),
        encoder_inputs={rid: tuple(inputs) for rid, inputs in out.scheduled_encoder_inputs.items()},
    )


def recorded_step(engine: Engine, records: list[StepRecord]) -> Any:
    """One engine step, its output and what its updates returned appended to
    ``records`` (nothing when there was nothing to schedule); the output."""
    before = len(engine.results)
    out = engine.step()
    if out is not None:
        records.append(record_output(out))
    for results in engine.results[before:]:
        record_results(records[-1], results, engine.scheduler)
    return out


def _event(event) -> tuple[Any, ...]:
    fields = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "group_idx", "medium",
              "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "lora_id", "lora_name", "extra_keys")
    return (type(event).__name__, *(getattr(event, name, None) for name in fields))


def record_results(record: StepRecord, results, scheduler) -> None:
    """Fill in what ``update_from_output`` returned and published."""
    for eco in results.values():
        for o in eco.outputs:
            record.tokens[o.request_id] = tuple(o.new_token_ids)
            if o.finish_reason is not None:
                record.finish_reasons[o.request_id] = o.finish_reason.name
        stats = eco.scheduler_stats
        if stats is not None:
            p = stats.prefix_cache_stats
            record.prefix_cache = (p.requests, p.queries, p.hits, p.preempted_requests, p.preempted_queries,
                                   p.preempted_hits)
            s = stats.spec_decoding_stats
            record.spec = None if s is None else (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens)
            record.usage = round(stats.kv_cache_usage, 9)
    if scheduler.enable_kv_cache_events:
        record.events.extend(_event(e) for e in scheduler.kv_event_publisher.take())


def make_prompts(rng: random.Random, n: int) -> list[list[int]]:
    """Prompts of 1..3 blocks of one of the shared prefixes, then 1..40 own tokens."""
    prefixes = [[rng.randrange(5000) for _ in range(3 * BLOCK_SIZE)] for _ in range(NUM_PREFIXES)]
    prompts = []
    for _ in range(n):
        shared = rng.choice(PREFIX_BLOCKS) * BLOCK_SIZE
        own = [rng.randrange(5000, 9000) for _ in range(rng.randrange(1, 41))]
        prompts.append(rng.choice(prefixes)[:shared] + own)
    return prompts


def lora_adapter(name: str, int_id: int, path: str) -> LoRARequest:
    """A vLLM ``LoRARequest`` (``lora_name``, ``lora_int_id``, ``lora_path``)."""
    return LoRARequest(lora_name=name, lora_int_id=int_id, lora_path=path)


#: A stream's LoRA adapters (``StreamConfig.lora``): none; one adapter; the same name and path under a new int id
#: (a reload: vLLM shares its KV); the first int id at another path (re-pointed: it shares nothing); another name.
LORAS = (None, lora_adapter("sql", 1, "/adapters/sql"), lora_adapter("sql", 2, "/adapters/sql"),
         lora_adapter("sql", 1, "/adapters/sql-v2"), lora_adapter("chat", 3, "/adapters/chat"))


#: A stream's images (``StreamConfig.mm``), as (identifier, length): one of two in the shared prefixes' first
#: two blocks at MM_OFFSET (the same placeholder tokens, other content), or one of three later in a prompt.
MM_SHARED = (("cat", 20), ("dog", 20))
MM_OWN = (("a", 5), ("b", 11), ("c", 16))
MM_OFFSET = 4
MM_PLACEHOLDER = 9999  # the token every image position holds


def _images(extra: random.Random, prompt: list[int]) -> tuple[list[int], list[tuple[str, int, int]]]:
    """``prompt`` with 0..2 images' placeholders in it, and the images as
    ``make_requests`` takes them (one identifier, one length)."""
    items = []
    if len(prompt) >= MM_OFFSET + 20 and extra.random() < 0.6:
        name, length = extra.choice(MM_SHARED)
        items.append((name, MM_OFFSET, length))
    if extra.random() < 0.5:
        name, length = extra.choice(MM_OWN)
        start = MM_OFFSET + 20 if items else 0
        if len(prompt) - length >= start:
            items.append((name, extra.randrange(start, len(prompt) - length + 1), length))
    prompt = list(prompt)
    for _, offset, length in items:
        prompt[offset:offset + length] = [MM_PLACEHOLDER] * length
    return prompt, items


def _request(rng: random.Random, i: int, prompt: list[int], config: StreamConfig, scheduler: Any,
             extra: random.Random) -> Any:
    max_tokens = rng.randrange(1, config.max_output_tokens + 1)
    logprobs = 1 if rng.random() < (0.3 if config.bounded_hits else 0.1) else None
    # (within the shared prefixes' three blocks, where hits are: a start past them would bound nothing)
    start = rng.randrange(1, min(len(prompt), 3 * BLOCK_SIZE) + 1) if logprobs and config.bounded_hits else None
    prompt, images = _images(extra, prompt) if config.mm else (prompt, [])
    (request,) = make_requests(1, prompt=lambda _: prompt, first_id=i, max_tokens=max_tokens,
                               ignore_eos=True, prompt_logprobs=logprobs, prompt_logprob_start=start,
                               scheduler=scheduler,  # (hashed as the scheduler's engine would: gpukv's needs none)
                               # (from their own generator: the streams without them draw what they always drew)
                               priority=extra.randrange(4) if config.priority else 0,
                               lora_request=extra.choice(LORAS) if config.lora else None, mm_items=images)
    return request


class _Model:
    """The model's side of the stream: samples, draft acceptance, drafts."""

    def __init__(self, rng: random.Random, num_spec: int) -> None:
        self.rng, self.num_spec = rng, num_spec

    def sample(self, request, drafts) -> list[int]:  # noqa: ARG002
        """A random prefix of the step's drafts accepted (an async
        scheduler's -1 placeholders stand for drafts the worker made: a token
        of its own here), then the bonus token."""
        accepted = drafts[: self.rng.randrange(len(drafts) + 1)] if drafts else []
        return [t if t >= 0 else 300 + self.rng.randrange(50) for t in accepted] + [100 + self.rng.randrange(50)]

    def drafts(self, request) -> list[int]:  # noqa: ARG002
        return [200 + self.rng.randrange(50) for _ in range(self.num_spec)]


def _bend_each_schedule(scheduler: Any, rng: random.Random) -> None:
    """Each ``schedule()`` of ``scheduler`` made under what bends vLLM's loop,
    drawn from ``rng``: paused for new requests (15%) or for all (10%), the
    pause lifted when it returns (so the stream ends), and prefills throttled
    as a data-parallel engine core does on its off steps (30%)."""
    schedule = scheduler.schedule

    def bent_schedule(throttle_prefills: bool = False) -> Any:
        draw = rng.random()
        scheduler.set_pause_state(PauseState.PAUSED_NEW if draw < 0.15 else
                                  PauseState.PAUSED_ALL if draw < 0.25 else PauseState.UNPAUSED)
        try:
            return schedule(throttle_prefills=throttle_prefills or rng.random() < 0.3)
        finally:
            scheduler.set_pause_state(PauseState.UNPAUSED)

    scheduler.schedule = bent_schedule


def run_stream(cls: type, config: StreamConfig, *, check_tables: bool = True, max_steps: int = 400,
               tables: BlockTables | None = None):
    """Run ``config``'s stream on a ``cls`` scheduler; returns its step records.

    Everything random comes from ``config.seed`` and the requests' own state,
    so two classes making the same decisions see the same stream. With
    ``check_tables`` each step also checks the block tables rebuilt from the
    outputs against the manager (``harness.BlockTables``, or ``tables``: a
    subclass of it that also looks at each step)."""
    rng = random.Random(config.seed)
    scheduler = make_scheduler(cls, num_blocks=config.num_blocks, max_num_seqs=config.max_num_seqs,
                               max_num_batched_tokens=config.max_num_batched_tokens, max_model_len=512,
                               num_speculative_tokens=config.num_speculative_tokens or None, block_size=BLOCK_SIZE,
                               sliding_window=config.sliding_window, hybrid=config.hybrid,
                               second_window=config.second_window, mla=config.mla,
                               enable_kv_cache_events=config.kv_events, cache_aware_window=config.cache_aware_window,
                               watermark=config.watermark, enable_prefix_caching=config.prefix_caching,
                               policy="priority" if config.priority else "fcfs", max_loras=config.max_loras,
                               prefill_schedule_interval=config.prefill_interval,
                               long_prefill_token_threshold=config.long_prefill_threshold,
                               adaptive_threshold=config.adaptive_threshold,
                               encoder_budget=64 if config.mm else 0)
    extra = random.Random(config.seed + 2)  # (priorities and adapters)
    resets = random.Random(config.seed + 4)
    if config.bends:
        _bend_each_schedule(scheduler, random.Random(config.seed + 3))
    model = _Model(random.Random(config.seed + 1), config.num_speculative_tokens)
    engine = Engine(scheduler, sample=model.sample, drafts=model.drafts if config.num_speculative_tokens else None,
                    tables=tables or (BlockTables() if check_tables else None))
    prompts = make_prompts(rng, config.num_requests)
    arrivals = sorted(rng.randrange(config.arrival_steps) for _ in prompts)
    records: list[StepRecord] = []
    pending = list(range(config.num_requests))
    for step in range(max_steps):
        while pending and arrivals[pending[0]] <= step:
            i = pending.pop(0)
            scheduler.add_request(_request(rng, i, prompts[i], config, scheduler, extra))
        aborted = _maybe_abort(rng, scheduler, config.abort_rate)
        reset = _maybe_reset(resets, scheduler, config.reset_rate)
        if not pending and not scheduler.has_requests() and not engine.in_flight:
            break
        before = len(engine.results)
        out = engine.step()
        if out is not None:
            records.append(record_output(out))
            records[-1].aborted = aborted
            records[-1].reset = reset
            records[-1].boundaries = {rid: scheduler.requests[rid].shared_prefix_boundary
                                      for rid, *_ in records[-1].new if rid in scheduler.requests}
        for results in engine.results[before:]:
            record_results(records[-1], results, scheduler)
    else:
        raise AssertionError(f"stream {config.seed} did not finish in {max_steps} steps")
    KVView(scheduler).assert_empty()
    return records


def _maybe_abort(rng: random.Random, scheduler, rate: float) -> tuple[str, ...]:
    """Abort one live request, with probability ``rate`` per live request."""
    live = sorted(scheduler.requests, key=int)
    if not live or rng.random() >= rate * len(live):
        return ()
    victim = rng.choice(live)
    scheduler.finish_requests([victim], RequestStatus.FINISHED_ABORTED)
    return (victim,)


def _maybe_reset(rng: random.Random, scheduler, rate: float) -> bool | None:
    """With probability ``rate`` while requests run: the prefix cache reset
    with every running request preempted (what an engine does after new
    weights are loaded), its answer; else None."""
    if not rate or not scheduler.running or rng.random() >= rate:
        return None
    return scheduler.reset_prefix_cache(reset_running_requests=True)


def coverage(records: list[StepRecord]) -> dict[str, int]:
    """How much of what a stream is for it exercised."""
    return {
        "hits": sum(1 for r in records for _, _, computed in r.new if computed > 0),
        # a step that ran a request but returned no token for it: a partial prefill (synchronous runs)
        "chunks": sum(1 for r in records for rid in r.num_scheduled_tokens if rid not in r.tokens),
        "preemptions": sum(len(r.preempted) for r in records),
        "spec_steps": sum(1 for r in records if r.spec_decode_tokens),
        "aborts": sum(len(r.aborted) for r in records),
        "finished": sum(len(r.finish_reasons) for r in records),
        "stored_events": sum(1 for r in records for e in r.events if e[0] == "BlockStored"),
        "removed_events": sum(1 for r in records for e in r.events if e[0] == "BlockRemoved"),
    }
