"""vLLM 0.33's prefix caching and block-manager decisions, through its scheduler.

The behaviours vLLM 0.33's ``tests/v1/core/test_prefix_caching.py`` checks
that a gpukv manager must reproduce (written anew, exact values): hits and
their cap at ``num_tokens - 1``, ``max_cache_hit_length``, which blocks are
cached when, the free order (uncached blocks reused first, cached ones kept
longest, each request's tail first), eviction, caching off, reset, KV events
(``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` and their fields),
the block hashes (sha256 of pickle by default; NONE_HASH from a fixed seed),
what ``KVCacheBlocks`` / ``get_block_ids`` / ``get_num_common_prefix_blocks``
return, and the sliding-window and hybrid coordinators' null blocks and hit
rule.
"""

from __future__ import annotations

import pickle

import pytest

from .harness import (
    HAS_COMMON_PREFIX_BLOCKS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Engine,
    KVCacheBlocks,
    KVView,
    VllmScheduler,
    coordinator_name,
    is_async,
    is_gpukv,
    make_requests,
    make_scheduler,
    scheduler_params,
    stats_of,
)

SYNC = scheduler_params(async_=False)
BOTH = scheduler_params()
SHARED = list(range(32))  # two full blocks of 16


def run_one(engine, rid, tokens, max_tokens=1):
    """Admit one request with ``tokens`` and run the engine until it is done."""
    engine.add(make_requests(1, prompt=lambda i: tokens, first_id=rid, max_tokens=max_tokens,  # noqa: ARG005
                             ignore_eos=True))
    engine.run_until_idle()


def event_hash(block_hash):
    """A block hash as KV events carry it: VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES
    (default 1) makes it the low 64 bits of the big-endian digest, an int."""
    return int.from_bytes(block_hash, "big") & ((1 << 64) - 1)


def new_ids(out):
    return [(n.req_id, n.block_ids, n.num_computed_tokens) for n in out.scheduled_new_reqs]


# ---------------------------------------------------------------- hits

@pytest.mark.parametrize("cls", BOTH)
def test_shared_prefix_hits_the_cached_blocks(cls):
    scheduler = make_scheduler(cls)
    engine = Engine(scheduler)
    run_one(engine, 0, SHARED + [100] * 8)
    engine.add(make_requests(1, prompt=lambda i: SHARED + [200] * 8, first_id=1, max_tokens=1))  # noqa: ARG005
    out = engine.step()
    # blocks 1 and 2 hit; request 0's partial block 3 (uncached) was freed to the queue's front
    assert new_ids(out) == [("1", ([1, 2, 3],), 32)]
    assert out.num_scheduled_tokens == {"1": 8}
    if not is_async(cls):  # an AsyncScheduler's stats for this step come back one step later
        stats = stats_of(engine.results[-1]).prefix_cache_stats
        assert (stats.requests, stats.queries, stats.hits) == (1, 40, 32)


@pytest.mark.parametrize("cls", SYNC)
def test_a_whole_prompt_hit_recomputes_its_last_block(cls):
    """A 48-token prompt seen before: the hit is capped at num_tokens - 1 =
    47, so 2 blocks (32 tokens) hit and the last block is computed again in a
    new block (4, the queue's front), while the cached block 3 stays cached."""
    scheduler = make_scheduler(cls)
    engine = Engine(scheduler)
    run_one(engine, 0, [9] * 48)
    engine.add(make_requests(1, prompt=lambda i: [9] * 48, first_id=1, max_tokens=1))  # noqa: ARG005
    out = engine.step()
    assert new_ids(out) == [("1", ([1, 2, 4],), 32)]
    assert 3 in KVView(scheduler).cached_block_ids()
    assert out.num_scheduled_tokens == {"1": 16}


@pytest.mark.parametrize("cls", SYNC)
def test_max_cache_hit_length_caps_the_lookup(cls):
    """get_computed_blocks(request, max_cache_hit_length): the bound the
    scheduler passes (from an aux-output connector; None: num_tokens - 1)."""
    scheduler = make_scheduler(cls)
    run_one(Engine(scheduler), 0, [9] * 64)
    (request,) = make_requests(1, prompt=lambda i: [9] * 64, first_id=1)  # noqa: ARG005
    kvm = scheduler.kv_cache_manager
    blocks, num_tokens, boundary = kvm.get_computed_blocks(request, max_cache_hit_length=40)
    assert (blocks.get_block_ids(), num_tokens, boundary) == (([1, 2],), 32, 0)
    blocks, num_tokens, _ = kvm.get_computed_blocks(request)
    assert (blocks.get_block_ids(), num_tokens) == (([1, 2, 3],), 48)
    blocks, num_tokens, _ = kvm.get_computed_blocks(request, max_cache_hit_length=15)
    assert blocks is kvm.empty_kv_cache_blocks and num_tokens == 0  # the shared empty instance


@pytest.mark.parametrize("cls", SYNC)
def test_only_full_computed_blocks_are_cached(cls):
    """Caching follows the computed tokens (allocate_slots caches up to
    min(computed + scheduled, num_tokens)): after a 24-token chunk one block
    is cached, after the prompt's last 16 tokens two; the partial third never."""
    scheduler = make_scheduler(cls, max_num_batched_tokens=24, max_num_seqs=4, max_model_len=256)
    engine = Engine(scheduler)
    engine.add(make_requests(1, 40, max_tokens=1))
    view = KVView(scheduler)
    engine.schedule()
    assert view.cached_block_ids() == {1}  # cached when scheduled, before the model runs
    engine.complete()
    engine.step()
    assert view.cached_block_ids() == {1, 2}


@pytest.mark.parametrize("cls", SYNC)
def test_decoded_tokens_fill_and_cache_blocks(cls):
    """A block filled by sampled tokens is cached once computed: the 16th
    output of a 16-token prompt fills block 2 when it is scheduled back."""
    scheduler = make_scheduler(cls)
    engine = Engine(scheduler)
    engine.add(make_requests(1, 16, max_tokens=20, ignore_eos=True))
    view = KVView(scheduler)
    for _ in range(16):
        engine.step()
    assert view.block_ids("0") == ([1, 2],)
    assert view.cached_block_ids() == {1}
    engine.step()  # computes token 32 (the 16th output): block 2 is full and computed
    assert view.cached_block_ids() == {1, 2}


# ---------------------------------------------------------------- free order and eviction

@pytest.mark.parametrize("cls", SYNC)
def test_free_order_reuses_uncached_blocks_first_and_keeps_cached_ones_longest(cls):
    scheduler = make_scheduler(cls, num_blocks=10)
    run_one(Engine(scheduler), 0, [5] * 40)
    # freed last block first: 3 (uncached) to the front; 2 then 1 (cached) to the tail
    assert KVView(scheduler).free_queue() == [3, 4, 5, 6, 7, 8, 9, 2, 1]


@pytest.mark.parametrize("cls", SYNC)
def test_without_prefix_caching_freed_blocks_are_reused_last_first(cls):
    """Caching off: every freed block goes to the front, the tail first, so
    the next request gets the same blocks in reverse."""
    scheduler = make_scheduler(cls, num_blocks=10, enable_prefix_caching=False)
    assert coordinator_name(scheduler) == "KVCacheCoordinatorNoPrefixCache"
    engine = Engine(scheduler)
    run_one(engine, 0, [5] * 40)
    assert KVView(scheduler).free_queue()[:4] == [3, 2, 1, 4]
    assert KVView(scheduler).cached_block_ids() == set()
    engine.add(make_requests(1, prompt=lambda i: [5] * 40, first_id=1))  # noqa: ARG005
    assert new_ids(engine.step()) == [("1", ([3, 2, 1],), 0)]


@pytest.mark.parametrize("cls", SYNC)
def test_eviction_takes_the_least_recently_freed_cached_blocks(cls):
    """9 usable blocks. Requests 0 and 1 (32 tokens, max_tokens 1: two cached
    blocks each, no third) finish in turn; a 96-token request then needs 6
    blocks: the 5 never used, then request 0's tail block 2 (freed before
    request 1's), whose hash a BlockRemoved event reports."""
    scheduler = make_scheduler(cls, num_blocks=10, enable_kv_cache_events=True)
    engine = Engine(scheduler)
    run_one(engine, 0, [1] * 32)
    run_one(engine, 1, [2] * 32)
    view = KVView(scheduler)
    assert view.free_queue() == [5, 6, 7, 8, 9, 2, 1, 4, 3]
    recorder = scheduler.kv_event_publisher
    recorder.take()
    engine.add(make_requests(1, prompt=lambda i: [3] * 96, first_id=2, max_tokens=1))  # noqa: ARG005
    out = engine.step()
    assert new_ids(out) == [("2", ([5, 6, 7, 8, 9, 2],), 0)]
    (removed,) = [e for e in recorder.take() if isinstance(e, BlockRemoved)]
    (survivor,) = make_requests(1, prompt=lambda i: [1] * 32, first_id=3)  # noqa: ARG005
    assert (removed.block_hashes, removed.medium, removed.group_idx) == (
        [event_hash(survivor.block_hashes[1])], "GPU", 0)
    blocks, num_tokens, _ = scheduler.kv_cache_manager.get_computed_blocks(survivor)
    assert (blocks.get_block_ids(), num_tokens) == (([1],), 16)


@pytest.mark.parametrize("cls", SYNC)
def test_a_hit_on_a_free_cached_block_takes_it_out_of_the_free_queue(cls):
    scheduler = make_scheduler(cls, num_blocks=10)
    engine = Engine(scheduler)
    run_one(engine, 0, SHARED)
    engine.add(make_requests(1, prompt=lambda i: SHARED + [7] * 8, first_id=1, max_tokens=3))  # noqa: ARG005
    engine.step()
    view = KVView(scheduler)
    assert view.block_ids("1") == ([1, 2, 3],)
    assert view.ref_counts() == {1: 1, 2: 1, 3: 1}
    assert view.free_queue() == [4, 5, 6, 7, 8, 9]


@pytest.mark.parametrize("cls", SYNC)
def test_reset_prefix_cache_needs_every_block_free(cls):
    scheduler = make_scheduler(cls, enable_kv_cache_events=True)
    engine = Engine(scheduler)
    engine.add(make_requests(1, 32, max_tokens=3, ignore_eos=True))
    engine.step()
    assert scheduler.reset_prefix_cache() is False
    engine.run_until_idle()
    scheduler.kv_event_publisher.take()
    assert scheduler.reset_prefix_cache() is True
    assert KVView(scheduler).cached_block_ids() == set()
    assert scheduler.kv_cache_manager.prefix_cache_stats.reset is True
    engine.add(make_requests(1, 32, first_id=0, max_tokens=1))
    out = engine.step()
    assert new_ids(out)[0][2] == 0  # no hit after the reset
    assert isinstance(scheduler.kv_event_publisher.take()[0], AllBlocksCleared)


# ---------------------------------------------------------------- events and hashes

@pytest.mark.parametrize("cls", BOTH)
def test_block_stored_events_carry_the_chain_tokens_and_metadata(cls):
    scheduler = make_scheduler(cls, enable_kv_cache_events=True, max_num_batched_tokens=24, max_num_seqs=4,
                               max_model_len=256)
    engine = Engine(scheduler)
    tokens = list(range(40))
    engine.add(make_requests(1, prompt=lambda i: tokens, max_tokens=1))  # noqa: ARG005
    engine.run_until_idle()
    hashes = make_requests(1, prompt=lambda i: tokens)[0].block_hashes  # noqa: ARG005
    stored = [e for e in scheduler.kv_event_publisher.take() if isinstance(e, BlockStored)]
    # one event per allocate_slots that cached something: chunk 1 (tokens 0..23) then chunk 2 (24..39)
    first_hash, second_hash = (event_hash(h) for h in hashes)
    assert [(e.block_hashes, e.parent_block_hash, e.token_ids) for e in stored] == [
        ([first_hash], None, tokens[0:16]), ([second_hash], first_hash, tokens[16:32])]
    first = stored[0]
    assert (first.block_size, first.medium, first.lora_id, first.lora_name, first.group_idx) == (
        16, "GPU", None, None, 0)
    assert (first.kv_cache_spec_kind, first.kv_cache_spec_sliding_window) == ("full_attention", None)
    assert first.extra_keys == [None]


def test_block_hashes_are_sha256_of_the_pickled_parent_tokens_and_extra_keys():
    """vLLM 0.33's default (prefix_caching_hash_algo "sha256"): each block's hash
    is sha256(pickle((parent hash, token tuple, extra keys))); the first
    block's parent is NONE_HASH = sha256(pickle(seed)), the seed being
    PYTHONHASHSEED if set, else the fixed "vllm-none-hash" for a
    cryptographic hash."""
    import hashlib
    import os

    from vllm.v1.core import kv_cache_utils

    (request,) = make_requests(1, prompt=lambda i: list(range(32)))  # noqa: ARG005

    def digest(obj):
        return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()

    seed = os.environ.get("PYTHONHASHSEED", "vllm-none-hash")
    assert digest(seed) == kv_cache_utils.NONE_HASH
    first = digest((kv_cache_utils.NONE_HASH, tuple(range(16)), None))
    assert request.block_hashes == [first, digest((first, tuple(range(16, 32)), None))]


def test_sha256_cbor_hashes_differ_from_the_pickled_ones_and_are_set_per_scheduler():
    import hashlib
    import os

    import cbor2  # vLLM's sha256_cbor: canonical CBOR then SHA-256
    from vllm.v1.core import kv_cache_utils

    scheduler = make_scheduler(VllmScheduler, hash_algo="sha256_cbor")
    (request,) = make_requests(1, prompt=lambda i: list(range(16)), scheduler=scheduler)  # noqa: ARG005
    def digest(obj):
        return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()

    assert digest(os.environ.get("PYTHONHASHSEED", "vllm-none-hash")) == kv_cache_utils.NONE_HASH
    assert request.block_hashes == [digest((kv_cache_utils.NONE_HASH, tuple(range(16)), None))]


# ---------------------------------------------------------------- KVCacheBlocks and the block-id queries

@pytest.mark.parametrize("cls", SYNC)
def test_kv_cache_blocks_and_block_id_queries(cls):
    scheduler = make_scheduler(cls)
    engine = Engine(scheduler)
    engine.add(make_requests(1, 40, max_tokens=5, ignore_eos=True))
    engine.step()
    kvm = scheduler.kv_cache_manager
    blocks = kvm.get_blocks("0")
    assert isinstance(blocks, KVCacheBlocks)
    assert blocks.get_block_ids() == ([1, 2, 3],)
    assert kvm.get_block_ids("0") == ([1, 2, 3],)
    assert blocks.get_unhashed_block_ids() == [3]  # block 3 is not full: no hash
    assert blocks.new_empty().get_block_ids() == ([],)
    assert blocks.new_empty().get_block_ids(allow_none=True) is None
    assert (blocks + blocks).get_block_ids() == ([1, 2, 3, 1, 2, 3],)
    assert kvm.get_block_ids("nobody") == ([],)
    assert kvm.get_blocks("nobody") is kvm.empty_kv_cache_blocks
    if HAS_COMMON_PREFIX_BLOCKS:
        assert kvm.get_num_common_prefix_blocks("0") == [0]  # deprecated in 0.33 (cascade attention is gone)
    assert kvm.get_block_ids_for_computed_tokens("0", 17) == ([1, 2],)
    assert kvm.estimate_cached_tokens(scheduler.requests["0"]) == 32


@pytest.mark.parametrize("cls", SYNC)
def test_new_block_ids_are_drained_every_step(cls):
    """take_new_block_ids: the manager records new attention blocks only when
    the KV cache needs zeroing (here it does not); the scheduler drains them
    each step and sends None."""
    scheduler = make_scheduler(cls)
    engine = Engine(scheduler)
    engine.add(make_requests(1, 40))
    out = engine.step()
    assert out.new_block_ids_to_zero is None
    assert scheduler.kv_cache_manager.take_new_block_ids() == []


# ---------------------------------------------------------------- sliding window and hybrid

@pytest.mark.parametrize("cls", SYNC)
def test_sliding_window_hit_needs_only_the_window_and_pads_with_null_blocks(cls):
    """One 32-token sliding-window group (unitary): a hit needs the last
    cdiv(32 - 1, 16) = 2 blocks before its end cached, contiguous; the
    blocks before them are returned as the null block (0). Request 0's
    64-token prompt released its first block behind the window while
    decoding; request 1 shares 48 tokens and hits them (3 blocks, null first)."""
    scheduler = make_scheduler(cls, sliding_window=32)
    engine = Engine(scheduler)
    tokens = list(range(64))
    run_one(engine, 0, tokens, max_tokens=3)
    (request,) = make_requests(1, prompt=lambda i: tokens[:48] + [999] * 8, first_id=1)  # noqa: ARG005
    blocks, num_tokens, _ = scheduler.kv_cache_manager.get_computed_blocks(request)
    assert (blocks.get_block_ids(), num_tokens) == (([0, 2, 3],), 48)


@pytest.mark.parametrize("cls", SYNC)
def test_hybrid_hit_is_the_longest_every_group_agrees_on(cls):
    """Full attention (group 0) + a 32-token window (group 1) in one pool: a
    request sharing 48 tokens hits 48 in both groups; the window group's
    first block comes back as the null block, and allocate_slots keeps that
    null block in the request's table (no block is taken for it)."""
    scheduler = make_scheduler(cls, sliding_window=32, hybrid=True)
    engine = Engine(scheduler)
    tokens = list(range(64))
    run_one(engine, 0, tokens, max_tokens=1)
    assert KVView(scheduler).cached_block_ids() == {1, 2, 3, 4, 5, 6, 7, 8}
    engine.add(make_requests(1, prompt=lambda i: tokens[:48] + [999] * 8, first_id=1,  # noqa: ARG005
                             max_tokens=1))
    out = engine.step()
    assert new_ids(out) == [("1", ([1, 2, 3, 9], [0, 6, 7, 10]), 48)]
    assert out.num_scheduled_tokens == {"1": 8}


@pytest.mark.parametrize("cls", SYNC)
def test_hybrid_hit_shrinks_to_what_the_window_group_still_holds(cls):
    """The window group's cached block 7 (tokens 32..47) is evicted, the full
    group's are not: the hybrid hit falls to the longest length at which the
    window group has its 2 blocks cached before it (32: blocks 5 and 6)."""
    if is_gpukv(cls):
        pytest.skip("evict_blocks is vLLM's KV-connector path (invalid external blocks), refused by gpukv: "
                    "test_hybrid_hit_shrinks_when_eviction_takes_a_window_block evicts by pool pressure instead")
    scheduler = make_scheduler(cls, sliding_window=32, hybrid=True)
    tokens = list(range(64))
    run_one(Engine(scheduler), 0, tokens, max_tokens=1)
    scheduler.kv_cache_manager.evict_blocks({7})
    (request,) = make_requests(1, prompt=lambda i: tokens[:48] + [999] * 8, first_id=1)  # noqa: ARG005
    blocks, num_tokens, _ = scheduler.kv_cache_manager.get_computed_blocks(request)
    assert (blocks.get_block_ids(), num_tokens) == (([1, 2], [5, 6]), 32)


@pytest.mark.parametrize("cls", SYNC)
def test_hybrid_hit_shrinks_when_eviction_takes_a_window_block(cls):
    """Request 0 (64 tokens, 20 decoded, 20-block pool) releases its window
    blocks 6, 5 and 7 (positions 0..2) while decoding: they reach the free
    queue before the blocks freed when it ends. 80 new tokens then take the
    9 never-used blocks and block 6. A request sharing 48 tokens finds 3
    blocks in the full group, but in the window group only position 0 (5)
    before a gap: the hit is that leading run, 16 tokens ([1], [5]), and the
    shared-prefix boundary the full group's lone hit, 48."""
    scheduler = make_scheduler(cls, sliding_window=32, hybrid=True, num_blocks=20)
    engine = Engine(scheduler)
    tokens = list(range(64))
    run_one(engine, 0, tokens, max_tokens=20)
    run_one(engine, 5, [7000 + i for i in range(80)])
    assert {5, 7} <= KVView(scheduler).cached_block_ids()
    (request,) = make_requests(1, prompt=lambda i: tokens[:48] + [999] * 8, first_id=1)  # noqa: ARG005
    blocks, num_tokens, boundary = scheduler.kv_cache_manager.get_computed_blocks(request)
    assert (blocks.get_block_ids(), num_tokens, boundary) == (([1], [5]), 16, 48)


@pytest.mark.parametrize("cls", SYNC)
def test_finished_requests_with_null_blocks_free_only_real_blocks(cls):
    scheduler = make_scheduler(cls, sliding_window=32, hybrid=True, num_blocks=30)
    engine = Engine(scheduler)
    engine.add(make_requests(1, 64, max_tokens=20, ignore_eos=True))
    engine.run_until_idle()
    assert scheduler.requests == {}
    KVView(scheduler).assert_empty()
    assert engine.finished()["0"].finish_reason.name == "LENGTH"
