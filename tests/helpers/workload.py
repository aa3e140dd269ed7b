"""The tests' shared helpers (one module: test files import from here, never
from each other).

``drive`` applies the same random scheduling steps to one or more managers and
calls ``check(step_index, managers, results)`` after every step, so a test can
compare the device manager with the reference step by step; ``check`` and
``assert_same`` are that comparison. ``chunked_session`` is another such
session, of chunked prefills, token budgets, lookahead and the batched
``decode`` entry. ``state_of`` is everything an object holds, as plain
values (the catalogues' snapshots).
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import torch

from gpukv.core.hashing import MMItem
from gpukv.core.requests import NewRequest, RunningUpdate
from gpukv.device.manager import DeviceManager
from gpukv.events.schema import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from gpukv.reference.manager import ReferenceManager

KEY = bytes(range(16))


def _prompt(rng: random.Random, docs: list[list[int]]) -> list[int]:
    """A prompt that often shares a prefix with another one."""
    if docs and rng.random() < 0.7:
        base = rng.choice(docs)
        cut = rng.randint(0, len(base))
        tail = rng.randint(0 if cut else 1, 12)
        return base[:cut] + [rng.randrange(2**32) if rng.random() < 0.1 else rng.randrange(50) for _ in range(tail)]
    return [rng.randrange(50) for _ in range(rng.randint(1, 24))]


def random_steps(seed: int, num_steps: int, *, extras: bool = True, max_new: int = 4):
    """Yield (finish_fraction, decode_fraction, new requests) per step; the
    driver turns fractions into concrete ids against the managers' state."""
    rng = random.Random(seed)
    docs: list[list[int]] = []
    counter = 0
    for _ in range(num_steps):
        new = []
        for _ in range(rng.randint(0, max_new)):
            tokens = _prompt(rng, docs)
            if rng.random() < 0.5:
                docs.append(tokens)
            kw = {}
            if extras:
                r = rng.random()
                if r < 0.1:
                    kw["cache_salt"] = rng.choice(["s1", "s2"])
                elif r < 0.2:
                    kw["lora_id"] = rng.choice([1, 2])
                elif r < 0.25:
                    kw["skip_prefix_cache"] = True
                elif r < 0.3 and len(tokens) > 3:
                    kw["mm_items"] = (MMItem(1, 2, rng.choice(["img-a", "img-b"])),)
            new.append(NewRequest(f"q{counter}", tokens, **kw))
            counter += 1
        yield rng.random() * 0.5, rng.random(), new, rng


def drive(managers, seed: int, num_steps: int, check, *, extras: bool = True, max_new: int = 4) -> None:
    """Apply one random workload to every manager in lockstep.

    The first manager's state decides which requests finish and decode (all
    managers must agree anyway; ``check`` asserts it). A running update that
    does not fit preempts the most recently admitted request, as the replay
    does; refused new requests are retried next step.
    """
    running: list[str] = []
    waiting: list[NewRequest] = []
    steps = random_steps(seed, num_steps, extras=extras, max_new=max_new)
    for step, (p_finish, p_decode, new, rng) in enumerate(steps):
        finished = [rid for rid in running if rng.random() < p_finish]
        running = [rid for rid in running if rid not in finished]
        updates = [RunningUpdate(rid, [rng.randrange(50) for _ in range(rng.randint(1, 3))])
                   for rid in running if rng.random() < p_decode]
        m0 = managers[0]
        # Like the replay, refuse at arrival what could never fit the pool.
        waiting.extend(r for r in new if -(-len(r.token_ids) // m0.block_size) * m0.num_groups <= m0.num_blocks - 1)
        candidates = list(waiting)
        results = [m.step(finished, updates, candidates) for m in managers]
        check(step, managers, results)
        res = results[0]
        while not res.ok:
            k = res.running_failed_at
            victim = running.pop()
            results = [m.step(finished=[victim]) for m in managers]
            check(step, managers, results)
            updates = [u for u in updates[k:] if u.request_id != victim]
            if not updates:
                break
            results = [m.step(running=updates) for m in managers]
            check(step, managers, results)
            res = results[0]
        else:
            admitted = candidates[: res.num_admitted]
            running.extend(r.request_id for r in admitted)
            waiting = waiting[res.num_admitted:]
        # A request that can never fit is dropped so the workload keeps moving.
        if waiting and not running:
            waiting.pop(0)


def assert_same(ref, dev) -> None:
    """The device manager's state equals the reference's: free queue,
    reference counts, cache table, requests and their block ids; both pass
    their invariants."""
    assert dev.free_queue() == ref.free_queue()
    assert dev.pool.ref_counts() == ref.pool.ref_cnt
    assert dev.pool.table_entries() == ref.pool.table()
    assert sorted(dev.request_ids()) == sorted(ref.request_ids())
    for rid in ref.request_ids():
        assert dev.get_block_ids(rid) == ref.get_block_ids(rid), rid
    dev.check_invariants()
    ref.check_invariants()


def check(step, managers, results) -> None:
    """``drive``'s per-step check for a (reference, device) pair: the same
    results, the same state."""
    ref, dev = managers
    assert results[1] == results[0], f"step {step}"
    assert_same(ref, dev)


def chunked_session(seed: int, windows, steps: int = 20) -> None:
    """Random chunked admissions under token budgets, chunk continuations,
    decodes with lookahead and finishes under a small pool (24 blocks of 4
    tokens), about a third of the running updates releasing behind a random
    processed count (``num_processed_tokens``), the device manager compared
    with the reference after every call: results, block ids, computed counts,
    the free queue and the invariants."""
    rng = random.Random(seed)
    ref, dev = (cls(24, 4, sliding_windows=list(windows), hash_key=KEY, max_model_len=64)
                for cls in (ReferenceManager, DeviceManager))
    next_id = 0
    for _ in range(steps):
        ids = ref.request_ids()
        finished = [r for r in ids if rng.random() < 0.15]
        running = []
        for rid in ids:
            if rid in finished or rng.random() < 0.2:
                continue
            known = len(ref._requests[rid].tokens)
            left = known - ref.num_computed_tokens(rid)
            lookahead = rng.choice([0, 0, 3])
            chunk = rng.randint(1, left) if left else None
            after = known + 1 if chunk is None else ref.num_computed_tokens(rid) + chunk
            # vLLM 0.33's processed tokens, behind the computed ones (or capped at the blocks held)
            processed = rng.randint(0, after) if rng.random() < 1 / 3 else None
            if left:
                running.append(RunningUpdate(rid, (), chunk, lookahead, processed))
            elif known < 50:
                running.append(RunningUpdate(rid, [rng.randint(0, 2)], None, lookahead, processed))
        new = []
        for _ in range(rng.randint(0, 3)):
            n = rng.randint(1, 30)
            chunk = rng.choice([None, rng.randint(1, n)])
            new.append(NewRequest(f"r{next_id}", [rng.randint(0, 2) for _ in range(n)],
                                  num_tokens_to_compute=chunk, num_lookahead_tokens=rng.choice([0, 0, 5])))
            next_id += 1
        if rng.random() < 0.3 and running and not finished and not new:
            # the batched entry: continue the chunked rows only
            mid = [u for u in running if not len(u.new_token_ids)]
            if mid:
                rows = [ref.row_of(u.request_id) for u in mid]
                chunks = [u.num_tokens_to_compute for u in mid]
                results = [m.decode(rows, None, num_tokens_to_compute=chunks) for m in (ref, dev)]
                assert results[0] == results[1]
                continue
        budget = rng.choice([None, None, rng.randint(0, 40)])  # for the new requests (vLLM's waiting loop)
        results = [m.step(finished, running, new, token_budget=budget) for m in (ref, dev)]
        assert results[0] == results[1]
        for rid in ref.request_ids():
            assert dev.get_block_ids(rid) == ref.get_block_ids(rid), rid
            assert dev.num_computed_tokens(rid) == ref.num_computed_tokens(rid), rid
        assert dev.free_queue() == ref.free_queue()
        ref.check_invariants()
        dev.check_invariants()


def event_atoms(batches: list[KVEventBatch]) -> list[tuple]:
    """KV-cache events one block at a time (the managers may cut batches and
    runs differently): ``("stored", digest, parent, tokens, lora, group)``,
    ``("removed", digest, group)``, ``("cleared",)``."""
    out: list[tuple] = []
    for batch in batches:
        for e in batch.events:
            if isinstance(e, BlockStored):
                parent, bs = e.parent_block_hash, e.block_size
                for i, d in enumerate(e.block_hashes):
                    out.append(("stored", d, parent, tuple(e.token_ids[i * bs:(i + 1) * bs]), e.lora_id, e.group))
                    parent = d
            elif isinstance(e, BlockRemoved):
                out += [("removed", d, e.group) for d in e.block_hashes]
            else:
                assert isinstance(e, AllBlocksCleared), e
                out.append(("cleared",))
    return out


def waiting_loop_one_at_a_time(m, new, token_budget: int | None = None, chunk: int | None = None) -> list[int]:
    """vLLM 0.8.5's waiting loop on a manager's single-request calls: per
    request, ``get_computed_blocks`` then ``allocate_slots`` for ``min(tokens -
    hit, chunk, budget left)`` tokens past the hit, stopping before a request
    once the budget is spent and at the first that does not fit. Returns the
    admitted requests' hits (tokens): what ``step(new=..., token_budget=)``
    must equal."""
    hits = []
    left = token_budget
    for req in new:
        if left is not None and left <= 0:
            break
        computed = m.get_computed_blocks(req)
        num_new = len(req.token_ids) - computed.num_tokens
        num_new = min(num_new, chunk if chunk is not None else num_new, left if left is not None else num_new)
        req = dataclasses.replace(req, num_tokens_to_compute=None)  # (allocate_slots' num_tokens says it)
        if m.allocate_slots(req, computed=computed, num_tokens=num_new) is None:
            break
        hits.append(computed.num_tokens)
        if left is not None:
            left -= num_new
    return hits


def state_of(obj, seen=None):
    """Everything an object holds, recursively, as comparable plain values:
    tensors as (dtype, shape, device, bytes), dicts in their order."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        return ("tensor", str(obj.dtype), tuple(obj.shape), obj.device.type,
                obj.detach().cpu().contiguous().numpy().tobytes())
    if isinstance(obj, np.ndarray):
        return ("array", obj.dtype.str, obj.shape, obj.tobytes())
    if obj is None or isinstance(obj, (bool, int, float, str, bytes, np.generic, torch.device, torch.dtype)):
        return obj
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, [state_of(x, seen) for x in obj])
    if isinstance(obj, (set, frozenset)):
        return ("set", sorted(repr(x) for x in obj))
    if isinstance(obj, dict):
        return ("dict", [(state_of(k, seen), state_of(v, seen)) for k, v in obj.items()])
    if callable(obj) and not hasattr(obj, "__dict__"):
        return ("callable", repr(obj))
    if id(obj) in seen:
        return ("seen", type(obj).__name__)
    seen.add(id(obj))
    fields = dict(vars(obj)) if hasattr(obj, "__dict__") else {}
    for name in getattr(type(obj), "__slots__", ()):
        if hasattr(obj, name):
            fields[name] = getattr(obj, name)
    return (type(obj).__name__, {k: state_of(v, seen) for k, v in sorted(fields.items())})
