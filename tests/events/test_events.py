"""KV-cache events (``gpukv.events.schema``) on both managers: the hand-worked
schema, an independent index kept from the events that always equals the
manager's table (as a KV-aware router would keep it), the device's events
equal to the reference's, no extra read, and overflow reported."""

from __future__ import annotations

import random

import pytest

from gpukv.core import hashing
from gpukv.core.requests import NewRequest, RunningUpdate
from gpukv.device.manager import DeviceManager
from gpukv.events.router import RouterIndex
from gpukv.events.schema import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, merge_runs
from gpukv.reference.manager import ReferenceManager
from workload import event_atoms

KEY = bytes(range(16))
BOTH = pytest.mark.parametrize("kind", ["reference", "device"])


def make(kind: str, num_blocks: int = 8, block_size: int = 2, windows=(None,), **kw):
    cls = ReferenceManager if kind == "reference" else DeviceManager
    return cls(num_blocks, block_size, sliding_windows=list(windows), hash_key=KEY, max_model_len=64,
               enable_kv_cache_events=True, **kw)


def table_of(m) -> dict:
    entries = m.pool.table() if isinstance(m, ReferenceManager) else m.pool.table_entries()
    return {key: len(blocks) for key, blocks in entries.items()}


@BOTH
def test_hand_worked_events(kind):
    m = make(kind, num_blocks=5)
    chain = hashing.hash_block_chain(KEY, [1, 2, 3, 4], 2, extras=hashing.extra_key_digests(KEY, 2, 2, lora_id=7),
                                     parent=hashing.root_digest(KEY))
    m.step(new=[NewRequest("a", [1, 2, 3, 4, 5], lora_id=7)])  # blocks 1, 2 full and cached; 3 holds token 5
    m.step(finished=["a"])
    # "b" needs 4 blocks: the free one (4), then the least recently used cached ones.
    m.step(new=[NewRequest("b", [9, 9, 9, 9, 9, 9, 9])])
    m.step(finished=["b"])
    assert m.reset_prefix_cache()
    batches = m.take_events()
    assert [b.seq for b in batches] == list(range(len(batches)))
    assert all(b.dropped == 0 for b in batches)
    events = merge_runs([e for b in batches for e in b.events])
    stored_b = [e for e in events if isinstance(e, BlockStored) and e.lora_id is None]
    assert events[0] == BlockStored(chain, None, [1, 2, 3, 4], 2, 7, 0)  # a run of two, parents first
    assert BlockRemoved([chain[0]], 0) in events and BlockRemoved([chain[1]], 0) in events
    assert len(stored_b) == 1 and len(stored_b[0].block_hashes) == 3 and stored_b[0].token_ids == [9] * 6
    assert events[-1] == AllBlocksCleared()
    assert m.take_events() == []


def _session(m, rng: random.Random, steps: int, index: RouterIndex, log: list) -> None:
    next_id = 0
    for step in range(steps):
        ids = m.request_ids()
        finished = [r for r in ids if rng.random() < 0.3]
        running = [RunningUpdate(r, [rng.randint(0, 2)]) for r in ids if r not in finished and rng.random() < 0.5]
        new = [NewRequest(f"r{next_id + i}", [rng.randint(0, 2) for _ in range(rng.randint(1, 7))],
                          lora_id=rng.choice([None, 3])) for i in range(rng.randint(0, 2))]
        next_id += len(new)
        m.step(finished, running, new)
        if rng.random() < 0.3 and m.request_ids():
            rows = [m.row_of(r) for r in m.request_ids()]
            m.decode(rows, [[rng.randint(0, 2)] for _ in rows])
        if step % 13 == 12:
            m.step(finished=m.request_ids())
            assert m.reset_prefix_cache()
        if rng.random() < 0.5 or step == steps - 1:
            batches = m.take_events()
            for batch in batches:
                index.apply(batch)
            log += batches
            assert index.blocks == table_of(m), step


@pytest.mark.parametrize("seed, windows", [(0, (None,)), (1, (None, 4)), (2, (None,))])
def test_an_index_kept_from_the_events_equals_the_table_and_the_device_says_what_the_reference_says(seed, windows):
    logs = []
    for kind in ("reference", "device"):
        m, index, log = make(kind, num_blocks=14, windows=windows), RouterIndex(), []
        _session(m, random.Random(seed), 40, index, log)
        assert len(event_atoms(log)) > 50 and any(isinstance(e, BlockRemoved) for b in log for e in b.events)
        logs.append(event_atoms(log))
    assert logs[0] == logs[1]


def test_a_step_that_reads_anyway_brings_its_events_without_another_read():
    m = make("device")
    m.step(new=[NewRequest("a", [1, 2, 3, 4, 5])])
    assert m.counters.d2h == 1  # the step's status read carried the events
    batches = m.take_events()
    assert m.counters.d2h == 1 and len(batches) == 1 and event_atoms(batches)[0][0] == "stored"
    # A decode the host proves fits reads nothing; take_events then reads once.
    row = m.row_of("a")
    m.decode([row], [6])
    assert m.counters.d2h == 0
    assert event_atoms(m.take_events())[0][0] == "stored"  # block 3 (tokens 5, 6) became full
    assert m.counters.d2h == 1


def test_an_overflow_is_reported_never_silent(monkeypatch):
    import gpukv.device.manager as manager_module

    monkeypatch.setattr(manager_module, "KV_EVENTS_CAPACITY", 2)
    m = make("device", num_blocks=16)
    with pytest.warns(RuntimeWarning, match="KV-cache events were dropped"):
        m.step(new=[NewRequest("a", list(range(9)))])  # four blocks cached, room for two
    (batch,) = m.take_events()
    assert batch.dropped == 2 and len(event_atoms([batch])) == 2
    with pytest.raises(ValueError, match="dropped"):
        RouterIndex().apply(batch)


@BOTH
def test_without_events_nothing_is_kept(kind):
    cls = ReferenceManager if kind == "reference" else DeviceManager
    m = cls(8, 2, hash_key=KEY, max_model_len=64)
    m.step(new=[NewRequest("a", [1, 2, 3, 4, 5])])
    assert m.take_events() == []


# ------------------------------------------------- RouterIndex: workers and match
def _random_request(rng: random.Random, rid: str) -> NewRequest:
    base = [rng.choice([[1, 2, 3, 4], [1, 2, 5, 6], [7, 7, 7, 7]])[i % 4] for i in range(rng.randint(2, 11))]
    return NewRequest(rid, base, lora_id=rng.choice([None, None, 5]), cache_salt=rng.choice([None, None, "s"]))


def test_match_finds_what_the_manager_would_hit_on_each_worker():
    """Two workers with different histories: for any request, ``match`` on
    the index kept from their events is, capped as a lookup caps it, the hit
    each manager's own lookup finds (LoRA and salt included). The reference
    only: the device's events are the reference's (above)."""
    rng = random.Random(5)
    workers = {"w0": make("reference", num_blocks=14), "w1": make("reference", num_blocks=14)}
    index = RouterIndex.for_manager(workers["w0"])
    seen = set()
    for step in range(12):
        for name, m in workers.items():
            m.step(finished=[r for r in m.request_ids() if rng.random() < 0.6],
                   new=[_random_request(rng, f"{name}-{step}")] if rng.random() < 0.8 else [])
            for batch in m.take_events():
                index.apply(batch, worker=name)
        probe = _random_request(rng, "probe")
        matched = index.match(probe.token_ids, lora_id=probe.lora_id, cache_salt=probe.cache_salt,
                              workers=list(workers))
        for name, m in workers.items():
            cap = (len(probe.token_ids) - 1) // m.block_size
            hit = m.get_computed_blocks(probe).num_tokens // m.block_size
            assert min(matched[name], cap) == hit, (step, name)
            seen.add((matched[name] > 0, matched["w0"] == matched["w1"]))
            assert index.blocks_of(name) == table_of(m)
    assert seen == {(True, True), (True, False), (False, True), (False, False)}  # hits, misses, workers apart
    assert index.blocks == {} and set(index.workers) == {"w0", "w1"}  # worker 0 never reported


@BOTH
def test_match_by_hand(kind):
    m = make(kind, num_blocks=10)
    index = RouterIndex(KEY, 2)
    m.step(new=[NewRequest("a", [1, 2, 3, 4, 5]), NewRequest("b", [1, 2, 3, 4, 5], lora_id=9)])
    for batch in m.take_events():
        index.apply(batch, worker="gpu0")
    assert index.match([1, 2, 3, 4, 5, 6]) == {"gpu0": 2}
    assert index.match([1, 2, 3, 4, 5, 6], lora_id=9) == {"gpu0": 2}
    assert index.match([1, 2, 9, 9], workers=["gpu0", "gpu1"]) == {"gpu0": 1, "gpu1": 0}
    assert index.match([1, 2], lora_id=8) == {"gpu0": 0}   # another adapter's blocks are not these
    assert index.match([1, 2], cache_salt="x") == {"gpu0": 0}
    assert index.match([1]) == {"gpu0": 0}                # no full block
    assert RouterIndex(bytes(16), 2).match([1, 2]) == {}  # no worker yet
    with pytest.raises(ValueError, match="hash_key and block_size"):
        RouterIndex().match([1, 2])
    with pytest.raises(ValueError, match="block_size"):
        RouterIndex(KEY, 0)


def test_the_index_checks_order_and_hash_form_per_worker():
    index = RouterIndex(KEY, 2)
    stored = BlockStored([b"\x01" * 16], None, [1, 2], 2, None)
    index.apply(KVEventBatch(0, [stored]), worker="a")
    index.apply(KVEventBatch(0, [stored]), worker="b")  # each worker has its own sequence
    with pytest.raises(ValueError, match="worker 'a': batch 2 out of order"):
        index.apply(KVEventBatch(2, []), worker="a")
    with pytest.raises(ValueError, match="int_block_hashes=False"):
        index.apply(KVEventBatch(1, [BlockRemoved([7])]), worker="a")
    assert index.next_seq_of("a") == 1 and index.blocks_of("a") == {(b"\x01" * 16, 0): 1}  # nothing applied
    index.remove_worker("a")
    assert index.workers == ["b"] and index.next_seq_of("a") == 0
