"""How many kernels, uploads and reads each kind of device step costs.

On a GPU every Triton launch costs host time in Triton's launcher (argument
binding, the specialisation key, the driver call), whatever the kernel does,
so the launch count of a step is part of its host cost. These are the counts
``docs/performance.md`` states, per workload; a change that raises one fails
here (and one that lowers one updates the table and this file together).
"""

from __future__ import annotations

import pytest

from gpukv.core.requests import NewRequest, RunningUpdate
from gpukv.device.manager import DeviceManager
from gpukv.kernels import capture

SHARED = list(range(128))

# (launches, uploads, reads) per step, for full attention and for full
# attention beside a sliding window (the decode releases behind the window).
# "decode": rows of staggered lengths, so that in every step some need a new
# block and some fill one (every phase runs: a serving batch's steady state).
EXPECTED = {
    "full": {"admit": (12, 1, 1), "decode": (7, 1, 0), "append": (1, 1, 0), "finish": (3, 1, 0)},
    "window": {"admit": (12, 1, 1), "decode": (10, 1, 0), "append": (1, 1, 0), "finish": (3, 1, 0)},
}
# An eager decode launches only the phases with work (the host knows from its
# plan): rows of equal length (16 a block) decoding 17 steps in lockstep.
# (launches per step: the first step, steps 2-15, step 16, step 17)
LOCKSTEP = {
    "full": (3, 1, 5, 3),  # a block each (fit, pop, place+erase); tokens only (fit); each fills one (fit, hash, 3)
    "window": (3, 1, 8, 3),  # the same, and the window's release (3) in the step its window passes a block
}
WINDOWS = {"full": [None], "window": [None, 32]}


def counts(m: DeviceManager) -> tuple[int, int, int]:
    c = m.counters
    return c.launches, c.h2d, c.d2h


@pytest.mark.parametrize("layout", list(EXPECTED))
def test_launches_per_step_do_not_grow_with_the_batch(layout):
    m = DeviceManager(4096, 16, sliding_windows=WINDOWS[layout], hash_key=bytes(16), max_model_len=4096)
    want = EXPECTED[layout]
    for k in (1, 16):  # an admission of 1 and of 16 requests sharing a prefix: the same launches
        new = [NewRequest(f"p{k}-{i}", SHARED + list(range(1000 + 300 * i, 1128 + 300 * i + i))) for i in range(k)]
        assert m.step(new=new).num_admitted == k
        assert counts(m) == want["admit"], ("admit", k)
    rows = [m.row_of(r) for r in m.request_ids()]
    for _ in range(2):  # the first decode of a bucket prepares its launches, later ones replay them
        assert m.decode(rows, [[5]] * len(rows)).ok
        assert counts(m) == want["decode"], "decode"
    # One token that needs no new block: running updates run as the batched
    # decode does: the plan and the token go up, decode_fit writes
    # the token into the row, nothing else is launched, nothing is read.
    assert m.step(running=[RunningUpdate(m.request_ids()[0], [7])]).ok
    assert counts(m) == want["append"], "append"
    m.step(finished=[m.request_ids()[0]])
    assert counts(m) == want["finish"], "finish"


@pytest.mark.parametrize("layout", list(LOCKSTEP))
def test_an_eager_decode_launches_only_the_phases_with_work(layout):
    m = DeviceManager(256, 16, sliding_windows=WINDOWS[layout], hash_key=bytes(16), max_model_len=512)
    rows = m.step(new=[NewRequest(f"r{i}", list(range(100 * i, 100 * i + 32))) for i in range(4)]).rows
    launches = []
    for _ in range(17):
        assert m.decode(rows, [[5]] * len(rows)).ok
        launches.append(counts(m)[0])
    first, middle, fill, after = LOCKSTEP[layout]
    assert launches == [first] + [middle] * 14 + [fill, after]


def test_the_table_is_rebuilt_when_the_hosts_bound_on_its_tombstones_passes_a_quarter_of_its_slots():
    # 64 blocks: 128 slots, so a rebuild is due once the step's pops bound more than 32 tombstones.
    m = DeviceManager(64, 16, hash_key=bytes(16), max_model_len=1024)
    launches = []
    for i in range(6):  # each request pops 10 blocks (160 tokens), cached ones evicted once the pool cycles
        res = m.step(finished=m.request_ids(), new=[NewRequest(f"r{i}", list(range(1000 * i, 1000 * i + 160)))])
        assert res.num_admitted == 1
        launches.append(counts(m)[0])
        assert m.pool.tombstone_bound == (10 * (i + 1)) % 40  # 10, 20, 30, then 40 > 32: rebuilt, 0
        m.check_invariants()
    admit, finish = EXPECTED["full"]["admit"][0], EXPECTED["full"]["finish"][0]
    assert launches == [admit, admit + finish, admit + finish, admit + finish + 2, admit + finish, admit + finish]
    assert m.pool.table.read_counters()["tombstones"] <= m.pool.tombstone_bound


def test_a_free_replays_the_launches_its_size_buckets_first_free_kept():
    m = DeviceManager(256, 16, hash_key=bytes(16), max_model_len=1024)
    m.step(new=[NewRequest(f"r{i}", list(range(100 * i, 100 * i + 40 + 16 * i))) for i in range(4)])
    kept = []
    for i in range(3):  # 3, 4 and 5 blocks: one bucket of 16 entries
        with capture.recording() as rec:
            m.free(f"r{i}")
        assert len(rec) == EXPECTED["full"]["finish"][0]
        kept.append(m._releases.buffers[16].prepared["release"][1])
        m.check_invariants()
    assert kept[0] is kept[1] is kept[2]  # prepared once, replayed since
    assert m.read_num_free_blocks() == 255 - 6  # only r3's 6 blocks are held


def replay_marks(monkeypatch) -> list[bool]:
    """Per launch from now on, whether it was a kept launch replayed."""
    marks: list[bool] = []
    note = capture.note_launch

    def noted(name, *args):
        marks.append(capture.replaying())
        note(name, *args)

    monkeypatch.setattr(capture, "note_launch", noted)
    return marks


def test_a_dry_lookup_replays_the_launches_its_buckets_first_lookup_kept(monkeypatch):
    from gpukv.reference.manager import ReferenceManager
    from workload import assert_same

    ms = (ReferenceManager(64, 4, hash_key=bytes(16)), DeviceManager(64, 4, hash_key=bytes(16), max_model_len=256))
    for m in ms:  # 5 blocks cached, free
        m.step(new=[NewRequest("c", list(range(21)))])
        m.free("c")
    ref, dev = ms
    marks = replay_marks(monkeypatch)
    # 21 tokens: one bucket (a hit of at most 5 blocks: 8 positions, 32 tokens) for all these lookups.
    first = NewRequest("a", [*range(12), 7, 7, 7, 7, 7, 7, 7, 7, 7])
    assert dev.get_computed_blocks(first) == ref.get_computed_blocks(first)
    assert dev.get_computed_blocks(first).num_tokens == 12
    # The first lookup of the bucket launches write_rows, hash, lookup, chains and admit, keeping them.
    assert marks == [False] * 5 + [True] * 5
    bufs = dev._admission.buffers[(8, 8, 32, 1, 1)]  # (a dry lookup takes and caches no block: A = C = 1)
    kept = bufs.prepared["lookup"][1]
    for i, tokens in enumerate(([*range(20), 9], [*range(8), 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5])):
        marks.clear()
        req = NewRequest(f"b{i}", tokens)
        assert dev.get_computed_blocks(req) == ref.get_computed_blocks(req)
        assert counts(dev) == (5, 1, 2)  # the plan's upload; the hit, its ids
        assert dev.read_prefix_hit(req) == ref.read_prefix_hit(req)
        assert counts(dev) == (5, 1, 1)  # the hit with its unheld blocks
        assert marks == [True] * 10  # both lookups: every launch a replay
    assert dev.get_computed_blocks(NewRequest("d", [*range(20), 9])).num_tokens == 20
    assert bufs.prepared["lookup"][1] is kept and len(dev._admission.buffers) == 2  # the step's and this
    assert_same(ref, dev)


def test_admissions_of_one_prompt_length_replay_one_bucket_whatever_their_hits_and_chunks(monkeypatch):
    """A step's bucket follows its prompts' lengths alone: admissions of
    50-token prompts with hits of 0 to 9 blocks and chunks of 5 to 50 tokens
    all replay the launches the priming step (40 tokens, the same power-of-two
    sizes) kept, and give the reference's hits and blocks."""
    from gpukv.reference.manager import ReferenceManager
    from workload import assert_same

    ms = (ReferenceManager(128, 4, hash_key=bytes(16)), DeviceManager(128, 4, hash_key=bytes(16), max_model_len=256))
    for m in ms:  # 10 blocks cached, free
        m.step(new=[NewRequest("c", list(range(40)))])
        m.free("c")
    ref, dev = ms
    primed = set(dev._admission.buffers)
    assert primed == {(8, 16, 64, 16, 16)}
    marks = replay_marks(monkeypatch)
    hits = []
    for i, (shared, chunk) in enumerate(((0, None), (8, 5), (20, None), (36, 13), (39, 7))):
        req = NewRequest(f"r{i}", list(range(shared)) + [1000 + i] * (50 - shared))
        got, want = dev.get_computed_blocks(req), ref.get_computed_blocks(req)
        assert got == want
        hits.append(got.num_tokens)
        marks.clear()
        rest = 50 - got.num_tokens if chunk is None else chunk
        assert dev.allocate_slots(req, computed=got, num_tokens=rest) == ref.allocate_slots(
            req, computed=want, num_tokens=rest)
        assert marks and all(marks), (i, marks)  # every launch of the admission a replay
    assert hits == [0, 8, 20, 36, 36]
    # The lookups' one bucket (A = C = 1) beside the primed one; no bucket per hit or chunk.
    assert set(dev._admission.buffers) - primed == {(8, 16, 64, 1, 1)}
    assert_same(ref, dev)


def test_a_lookup_and_an_admission_run_only_their_uploads_and_the_free_counts_copy():
    """Torch operations per call, all of them (each a kernel launch on a
    GPU, beside Triton's): a sized lookup runs only its plan's upload (its
    hit and unheld blocks are read from its status words as they are, and
    the host's mirror of the free count is left as it is: a lookup changes
    no block); an admission its upload and the mirror's copy; a step with
    no running phase zeroes the flag a running update that did not fit sets
    (the admission reads it) only when one did not fit since: a running
    phase in which every update fit wrote it 0."""
    from gpukv.core.metrics import StepCounters
    from gpukv.device.staging import TorchOpCounter
    from gpukv.reference.manager import ReferenceManager
    from workload import assert_same

    def ops(call):
        counted = StepCounters()
        with TorchOpCounter(counted):
            out = call()
        return out, counted.torch_ops

    ms = (ReferenceManager(16, 4, hash_key=bytes(16)), DeviceManager(16, 4, hash_key=bytes(16), max_model_len=64))
    for m in ms:  # 5 blocks cached, free
        m.step(new=[NewRequest("c", list(range(21)))])
        m.free("c")
    ref, dev = ms
    dev.prepare_admissions()  # (every bucket's buffers made: none is made in a counted call)
    assert dev.read_num_free_blocks() == 15  # (the host's bound of free blocks: the admission's fit is known)
    req = NewRequest("a", [*range(12), *[7] * 28])  # 40 tokens: a hit of 3 blocks, 10 blocks held
    hit, n = ops(lambda: dev.read_prefix_hit(req))
    assert hit == ref.read_prefix_hit(req) and hit.num_tokens == 12
    assert n == 1 and counts(dev)[1:] == (1, 1)  # the upload; one read
    admitted, n = ops(lambda: dev.admit(req, hit))
    assert admitted and ref.admit(req, ref.read_prefix_hit(req))
    assert n == 2 and counts(dev)[1:] == (1, 0)  # the upload, the mirror's copy; no read
    # A running update that does not fit (6 blocks more, 5 free) sets the flag; the admission-only step
    # after it zeroes it (one operation more) and admits; the next one has nothing to zero.
    for m in ms:
        assert m.step(running=[RunningUpdate("a", [1] * 24)]).running_failed_at == 0
    got = []
    for i in range(2):
        new = [NewRequest(f"n{i}", [100 + i] * 5)]
        res, n = ops(lambda new=new: dev.step(new=new))
        assert res.num_admitted == ref.step(new=new).num_admitted == 1
        got.append(n)
    # the upload, the read's two casts (hits, computed tokens) and its concatenation, the mirror's copy
    assert got == [6, 5]
    # A running update that fits (a sixth token in n0's two blocks) writes the flag 0: the admission-only
    # step after it has nothing to zero.
    for m in ms:
        assert m.step(running=[RunningUpdate("n0", [1])]).running_failed_at is None
    new = [NewRequest("n2", [102] * 2)]  # one block: the last free one
    res, n = ops(lambda: dev.step(new=new))
    assert res.num_admitted == ref.step(new=new).num_admitted == 1
    assert n == 5
    assert_same(ref, dev)
