"""``DeviceManager.prepare_admissions``: every admission bucket a prompt can
meet, and every release bucket its free can, made and its launches kept
before serving, by rounds that admit no request and releases of no entry,
so the first admission or free of a bucket replays its launches; nothing a
call reads changes."""

from __future__ import annotations

import dataclasses

import pytest

from gpukv.core.requests import NewRequest
from gpukv.device.admission_plan import plan_admission, single_prompt_buckets
from gpukv.device.manager import DeviceManager
from gpukv.device.releases import single_request_buckets
from gpukv.reference.manager import ReferenceManager
from workload import KEY, assert_same, check, drive, state_of


def test_the_buckets_of_prompts_up_to_40_tokens_hand_worked():
    # Block size 16. Up to 16 tokens: no hit possible (P 1), one new block,
    # the token slots a power of two. 17-32: a hit of 1 block, 2 new
    # blocks, 1 cached (2 at 32). 33-40: a hit of up to 2 blocks, 3 new
    # blocks (A 4), 2 cached; a dry lookup's block sizes are 1.
    got = single_prompt_buckets(40, 16)
    assert got == [((8, 1, t, 1, 1), dry) for t in (1, 2, 4, 8, 16) for dry in (True, False)] + [
        ((8, 1, 32, 1, 1), True), ((8, 1, 32, 2, 1), False), ((8, 1, 32, 2, 2), False),
        ((8, 2, 64, 1, 1), True), ((8, 2, 64, 4, 2), False)]
    # The engine's step of 16 tokens caps what a step takes and caches; a
    # lookahead of 2 needs a block more at the end of the chunk.
    assert single_prompt_buckets(40, 16, max_chunk=16, num_lookahead_tokens=2)[-2:] == [
        ((8, 2, 64, 1, 1), True), ((8, 2, 64, 2, 1), False)]


@pytest.mark.parametrize("max_chunk, lookahead", [(None, 0), (24, 0), (None, 3), (40, 5)])
def test_every_bucket_the_planner_gives_one_prompt_is_listed(max_chunk, lookahead):
    """Whatever its hit cap and chunk (up to the engine's step), the plan of
    one prompt of 1-130 tokens falls in a listed bucket, and every listed
    bucket is some prompt's."""
    bs = 8
    listed = set(single_prompt_buckets(130, bs, max_chunk, lookahead))
    met = set()
    for n in range(1, 131):
        for chunk in {n, 1, min(n, max_chunk or n), max(1, n // 3)}:
            if max_chunk is not None and chunk > max_chunk:
                continue
            for cap in {0, (n - 1) // bs}:
                req = NewRequest("r", list(range(n)), num_tokens_to_compute=chunk, num_lookahead_tokens=lookahead)
                for dry in (True, False):
                    plan = plan_admission([req], [0], bs, [cap], dry=dry, max_chunk=max_chunk)
                    met.add((plan.bucket, dry))
    assert met == listed


def _primed() -> tuple[ReferenceManager, DeviceManager]:
    """A reference and a device manager after the same random steps: held,
    cached and freed blocks."""
    ref = ReferenceManager(40, 4, hash_key=KEY)
    dev = DeviceManager(40, 4, hash_key=KEY, max_model_len=80, max_num_batched_tokens=32)
    drive([ref, dev], seed=3, num_steps=6, check=check)
    return ref, dev


def _kept(dev: DeviceManager) -> dict:
    """The admission's and the releases' kept launches, by bucket and part
    (their identity)."""
    return {b: {part: id(kept) for part, kept in bufs.prepared.items()}
            for b, bufs in [*dev._admission.buffers.items(), *dev._releases.buffers.items()]}


def _state(dev: DeviceManager) -> tuple:
    """Every tensor of the pool and the rows, and what the host keeps and
    hands out, but the pool's admission stamp: each admission kernel run
    takes the next one (a dry lookup's too) to tell its own marks from
    earlier ones, so its value decides nothing."""
    pool = state_of(dev.pool)
    fields = {k: v for k, v in pool[1].items() if k != "stamp"}
    return (fields, state_of(dev._rows), dev.free_queue(), dev.read_num_free_blocks(), dev.stats,
            dict(dev.request_rows), dev.free_blocks_lower_bound)


def test_preparing_changes_nothing_a_call_reads_and_later_steps_match_the_reference():
    ref, dev = _primed()
    before = _state(dev)
    todo = [b for b in single_prompt_buckets(80, 4, 32) if not dev._admission.prepared(*b)]
    frees = [ep for ep in single_request_buckets(80, 4, 1) if not dev._releases.prepared(ep)]
    assert frees == [32]  # (a free of up to 20 blocks; the random steps freed smaller ones: bucket 16 kept)
    assert dev.prepare_admissions() == len(todo) + len(frees) > 1
    assert _state(dev) == before
    assert_same(ref, dev)
    assert dev.prepare_admissions() == 0  # (every bucket kept: nothing left to prepare)


def test_a_manager_prepared_at_start_decides_as_the_reference():
    ref = ReferenceManager(40, 4, hash_key=KEY)
    dev = DeviceManager(40, 4, hash_key=KEY, max_model_len=64)
    assert dev.prepare_admissions() == len(single_prompt_buckets(64, 4)) + len(single_request_buckets(64, 4, 1))
    drive([ref, dev], seed=4, num_steps=12, check=check)


def test_after_preparing_admissions_of_every_length_replay_kept_launches():
    ref = ReferenceManager(64, 4, hash_key=KEY)
    dev = DeviceManager(64, 4, hash_key=KEY, max_model_len=48, max_num_batched_tokens=16)
    assert dev.prepare_admissions() == len(single_prompt_buckets(48, 4, 16)) + len(single_request_buckets(48, 4, 1))
    kept = _kept(dev)
    for n in (1, 3, 4, 5, 16, 17, 21, 33, 47, 48):  # (prefixes of one sequence: the longer ones hit)
        req = NewRequest(f"r{n}", list(range(100, 100 + n)))
        for m in (ref, dev):  # vLLM's two calls: the lookup, then the allocation of the hit and a chunk
            computed = m.get_computed_blocks(req)
            chunk = min(16, len(req.token_ids) - computed.num_tokens)
            assert m.allocate_slots(req, computed=computed, num_tokens=chunk) is not None
        assert_same(ref, dev)
    assert _kept(dev) == kept  # no bucket made, no launch prepared anew


def test_after_preparing_frees_of_every_size_replay_kept_launches():
    # Block size 2, prompts up to 80 tokens: frees of up to 40 positions, in release buckets of 16, 32 and 64
    # entries (a power of two from 16). Requests of 10, 40 and 70 tokens hold 5, 20 and 35 blocks.
    ref = ReferenceManager(96, 2, hash_key=KEY)
    dev = DeviceManager(96, 2, hash_key=KEY, max_model_len=80)
    assert single_request_buckets(80, 2, 1) == [16, 32, 64]
    assert dev.prepare_admissions() == len(single_prompt_buckets(80, 2)) + 3
    kept = _kept(dev)
    for n in (10, 40, 70):
        req = NewRequest(f"r{n}", list(range(1000 * n, 1000 * n + n)))
        for m in (ref, dev):
            assert m.allocate_slots(req, computed=m.get_computed_blocks(req)) is not None
    assert dev.read_num_free_blocks() == ref.read_num_free_blocks() == 95 - 5 - 20 - 35
    for n in (70, 10, 40):
        for m in (ref, dev):
            m.free(f"r{n}")
        assert_same(ref, dev)
    assert dev.read_num_free_blocks() == 95 and dev.free_queue() == ref.free_queue()
    assert _kept(dev) == kept  # no bucket made, no launch prepared anew


def test_a_lookahead_prepares_the_buckets_it_adds():
    dev = DeviceManager(16, 4, hash_key=KEY, max_model_len=32)
    plain = dev.prepare_admissions(16)
    more = dev.prepare_admissions(16, num_lookahead_tokens=2)
    assert more == len(set(single_prompt_buckets(16, 4, None, 2)) - set(single_prompt_buckets(16, 4))) > 0
    req = dataclasses.replace(NewRequest("r", list(range(9))), num_lookahead_tokens=2)
    kept = _kept(dev)
    assert dev.allocate_slots(req, computed=dev.get_computed_blocks(req), num_lookahead_tokens=2) is not None
    assert _kept(dev) == kept and plain > 0
