"""The batched decode entry (``decode(rows, new_token_ids)``) of both managers:
hand-worked, against ``step(running=...)`` and device against reference step
by step, bad input refused with nothing changed, and the device's launch
sequence fixed within a batch bucket (what a CUDA graph needs)."""

import random

import numpy as np
import pytest
import torch

from gpukv.core.requests import NewRequest, RunningUpdate
from gpukv.device.manager import DeviceManager
from gpukv.errors import CapacityError, InvalidInputError, InvalidTypeError, ManagerFailedError
from gpukv.kernels import capture
from gpukv.reference.manager import ReferenceManager

KEY = bytes(range(16))


def pair(num_blocks, block_size, windows=(None,), max_model_len=128, max_num_reqs=4):
    ref = ReferenceManager(num_blocks, block_size, sliding_windows=windows, hash_key=KEY,
                           max_model_len=max_model_len, max_num_reqs=max_num_reqs)
    dev = DeviceManager(num_blocks, block_size, sliding_windows=windows, hash_key=KEY,
                        max_model_len=max_model_len, max_num_reqs=max_num_reqs)
    return ref, dev


def state(m):
    return (m.free_queue(), list(m.pool.ref_counts() if hasattr(m.pool, "ref_counts") else m.pool.ref_cnt),
            m.pool.table_entries() if hasattr(m.pool, "table_entries") else m.pool.table(),
            {r: (m.get_block_ids(r), m.num_computed_tokens(r), m.row_of(r)) for r in sorted(m.request_ids())})


def test_hand_worked_decode_fills_a_block_caches_it_and_stops_at_the_first_misfit():
    # Pool of 5 blocks (4 usable), block size 2. "a" holds [1] with token 10,
    # "b" holds [2, 3] with tokens 20, 21, 22. Free queue: 4.
    for m in pair(5, 2):
        res = m.step(new=[NewRequest("a", [10]), NewRequest("b", [20, 21, 22])])
        assert res.rows == [0, 1] and res.num_computed_tokens == [0, 0]
        assert m.free_queue() == [4]
        # a: 1 -> 2 tokens (block 1 becomes full, no new block); b: 3 -> 4 (block 3 full).
        assert m.decode([0, 1], [11, 23]).ok
        assert m.get_block_ids("a") == [[1]] and m.get_block_ids("b") == [[2, 3]]
        assert len(m.pool.table_entries() if hasattr(m.pool, "table_entries") else m.pool.table()) == 3
        # Next decode: b (listed first) needs block 4, a needs one more: only b fits.
        res = m.decode([1, 0], np.array([[24], [12]]))
        assert res.running_failed_at == 1
        assert m.get_block_ids("b") == [[2, 3, 4]] and m.get_block_ids("a") == [[1]]
        assert m.num_computed_tokens("a") == 2 and m.num_computed_tokens("b") == 5
        assert m.free_queue() == []
        m.check_invariants()


def test_decode_equals_step_with_running_updates():
    one, two = pair(40, 4)[1], pair(40, 4)[1]
    for m in (one, two):
        m.step(new=[NewRequest(f"r{i}", list(range(i * 100, i * 100 + 5 + i))) for i in range(3)])
    for t in range(9):
        toks = [[1000 + t, 2000 + t], [3000 + t, 4000 + t], [5000 + t, 6000 + t]]
        a = one.decode([2, 0, 1], toks)
        b = two.step(running=[RunningUpdate("r2", toks[0]), RunningUpdate("r0", toks[1]),
                              RunningUpdate("r1", toks[2])])
        assert a == b
        assert state(one) == state(two)
        assert [one.block_hashes(f"r{i}") for i in range(3)] == [two.block_hashes(f"r{i}") for i in range(3)]


@pytest.mark.parametrize("windows", [(None,), (None, 5)])
@pytest.mark.parametrize("seed", [0, 1])
def test_device_decode_matches_the_reference_step_by_step(windows, seed):
    rng = random.Random(seed)
    ref, dev = pair(24 * len(windows), 2, windows=windows, max_model_len=64)
    next_id = 0
    for step in range(14):
        held = sorted(ref.request_ids())
        if len(held) < 3 or rng.random() < 0.3:
            new = [NewRequest(f"q{next_id + i}", [rng.randrange(4) for _ in range(rng.randint(1, 9))])
                   for i in range(rng.randint(1, 2))]
            next_id += len(new)
            results = [m.step(new=new) for m in (ref, dev)]
        else:
            rows = [ref.row_of(r) for r in held]
            rng.shuffle(rows)
            rows = rows[: rng.randint(1, len(rows))]
            k = rng.choice([1, 1, 3])
            if max(ref.num_computed_tokens(r) for r in held) + k > 64:
                results = [m.step(finished=held) for m in (ref, dev)]
            else:
                toks = np.array([[rng.randrange(4) for _ in range(k)] for _ in rows])
                results = [m.decode(rows, toks) for m in (ref, dev)]
                if not results[0].ok:  # the loop preempts the first that did not fit
                    victim = [r for r in held if ref.row_of(r) == rows[results[0].running_failed_at]]
                    assert [m.step(finished=victim) for m in (ref, dev)]
        assert results[0] == results[1], f"step {step}"
        assert state(ref) == state(dev), f"step {step}"
        dev.check_invariants()


BAD = {
    "a row no request holds": ([3], [1], InvalidInputError, "rows[0] = 3 is not the row of a running request"),
    "a negative row": ([-1], [1], InvalidInputError, "rows[0] = -1"),
    "a row past the last": ([0, 9], [1, 2], InvalidInputError, "rows[1] = 9 is not the row of a running request"),
    "a row twice": ([0, 0], [1, 2], InvalidInputError, "a row appears twice"),
    "rows as a str": ("0", [1], InvalidTypeError, "rows"),
    "float rows": (np.array([0.0]), [1], InvalidTypeError, "1-D integer array"),
    "too few tokens": ([0, 1], [1], InvalidInputError, "want [2] or [2, k]"),
    "a negative token": ([0], [-1], InvalidInputError, "outside [0, 2**32)"),
    # A 1-D CPU tensor takes the one-reduction check (the interpreter's device tensor).
    "a negative token in a tensor": ([0, 1], torch.tensor([4, -1]), InvalidInputError,
                                     "position 1 is -1, outside [0, 2**32)"),
    "a token 2**32 in a tensor": ([0, 1], torch.tensor([2**32, 4]), InvalidInputError,
                                  "position 0 is 4294967296, outside"),
    "a negative int32 token in a tensor": ([0], torch.tensor([-7], dtype=torch.int32), InvalidInputError,
                                           "position 0 is -7, outside"),
    "float tokens": ([0], [1.5], InvalidTypeError, "must be ints"),
    "past max_model_len": ([0], np.ones((1, 7), dtype=np.int64), CapacityError, "over max_model_len 8"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_decode_input_is_refused_alike_and_changes_nothing(case):
    rows, toks, cls, text = BAD[case]
    for m in pair(8, 2, max_model_len=8):
        m.step(new=[NewRequest("a", [1, 2]), NewRequest("b", [3])])
        before = state(m)
        with pytest.raises(cls) as info:
            m.decode(rows, toks)
        assert text in str(info.value), str(info.value)
        assert state(m) == before and not m.failed
        assert m.decode([0], [5]).ok  # and the manager still works


class GraphLaunches:
    """What ``gpukv.device.graphs.DecodeGraphs`` captures, on the CPU: ``decode``
    hands ``run`` the staged bucket and its launch, every phase, which it
    runs, recording the launches."""

    def __init__(self, manager) -> None:
        self.manager, self.records = manager, []

    def run(self, bucket, launch) -> None:
        with capture.recording() as rec:
            launch()
        self.records.append((bucket, rec))


def test_a_decode_step_is_a_fixed_launch_sequence_within_its_bucket():
    """Steps of one bucket (5 rows pad to 8) launch, as a graph captures
    them, the same kernels with the same shapes and scalar arguments
    whatever fills or needs a block, so a CUDA graph captured once replays
    every step of the bucket."""
    for windows in [(None,), (None, 3)]:
        _, dev = pair(64, 2, windows=windows, max_model_len=64, max_num_reqs=8)
        res = dev.step(new=[NewRequest(f"r{i}", list(range(10 * i, 10 * i + 2 + i))) for i in range(5)])
        rows = res.rows
        dev.decode(rows, torch.zeros(5, dtype=torch.int64))  # the window catches up with the prompts
        graph = GraphLaunches(dev)
        for t in range(1, 6):
            assert dev.decode(rows, torch.tensor([t] * 5, dtype=torch.int64), graphs=graph).ok
            assert dev.counters.d2h == 0 and dev.counters.h2d == 1  # the plan; the tokens were on the device
        assert all(r == graph.records[0] for r in graph.records), windows
        # fit, pop, erase, place, hash, record, insert (2); windows: release (3) first (the table's
        # rebuild is decided on the host, outside the graph)
        assert len(graph.records[0][1]) == (10 if windows[1:] else 7)


def test_a_steady_decode_keeps_one_bucket_and_launches_only_the_phases_with_work():
    """Rows of equal length need a block every other step (block size 2) and
    fill one on the others: one bucket (so one graph) for all the steps,
    while an eager step launches only what it needs: the fit and the pops
    (3 launches: the place erases their hashes too), or the fit, the digests and the
    caching (5)."""
    _, dev = pair(64, 2, max_model_len=64, max_num_reqs=8)
    rows = dev.step(new=[NewRequest(f"r{i}", [i, i]) for i in range(3)]).rows
    eager, graph = [], GraphLaunches(dev)
    for t in range(4):  # 3, 4, 5, 6 tokens: new blocks at 3 and 5, full blocks at 4 and 6
        with capture.recording() as rec:
            assert dev.decode(rows, [t] * 3).ok
        eager.append(len(rec))
    assert eager == [3, 5, 3, 5]
    for t in range(4):  # 7, 8, 9, 10 tokens, the graph's way
        assert dev.decode(rows, [t] * 3, graphs=graph).ok
    assert all(r == graph.records[0] for r in graph.records) and len(graph.records[0][1]) == 7


def test_an_eager_decode_that_needs_nothing_launches_only_the_fit():
    _, dev = pair(64, 4, max_model_len=64)
    rows = dev.step(new=[NewRequest("a", [1, 2])]).rows  # 2 of its block's 4 slots
    with capture.recording() as rec:
        assert dev.decode(rows, [3]).ok
    assert len(rec) == 1 and dev.get_block_ids("a") == [[1]]


def test_counters_of_a_decode_that_the_host_cannot_prove_fits():
    _, dev = pair(6, 2, max_model_len=16)
    res = dev.step(new=[NewRequest("a", [1, 2]), NewRequest("b", [3, 4])])
    assert dev.decode(res.rows, [5, 6]).ok  # needs 2 of 3 free: known
    assert dev.counters.d2h == 0
    assert dev.decode(res.rows, [[7, 8], [9, 10]]).running_failed_at == 1  # needs 2 of 1
    assert dev.counters.d2h == 1  # one status read


# --------------------------------------------- token ids already on the device
# A host int64 tensor's 2**32 + 5 must not be stored and hashed as 5, or a
# later request with token 5 would hit that block (the host tensors are in
# tests/differential/test_catalogue.py). A tensor on the manager's CUDA device is never
# read by the host: ``decode_fit`` checks its ids on the device. Under the
# interpreter the device is the CPU and a CPU tensor is checked on the host
# (it is there), so these tests hand the decode a CPU tensor unchecked, as it
# hands on a CUDA one, and the kernel's check is what runs.


@pytest.fixture
def tokens_on_the_device(monkeypatch):
    import gpukv.core.running_batch

    real = gpukv.core.running_batch.normalize_decode_tokens

    def kept_unread(value, num_rows, device):
        if device is None:  # the reference's: it reads and checks them on the host
            return real(value, num_rows, device)
        assert isinstance(value, torch.Tensor) and value.device == device
        return value if value.dim() == 2 else value.reshape(num_rows, -1)

    monkeypatch.setattr(gpukv.core.running_batch, "normalize_decode_tokens", kept_unread)


def _hit_tokens(m, tokens):
    return m.get_computed_blocks(NewRequest("probe", tokens)).num_tokens


@pytest.mark.usefixtures("tokens_on_the_device")
@pytest.mark.parametrize("bad, dtype", [(2**32 + 5, torch.int64), (2**40, torch.int64), (-1, torch.int64),
                                        (-(2**32) + 5, torch.int64), (-1, torch.int32), (-(2**31), torch.int32)])
def test_a_device_token_out_of_range_is_never_cached_and_stops_the_manager(bad, dtype):
    wrapped = bad & 0xFFFFFFFF  # what the row stores: its low 32 bits
    # Block size 2, "a" holds [1, 2, 3]. Either the bad id fills block 1 and
    # two more tokens fill block 2 (which chains from it), or a clean token
    # fills block 1 and the bad one starts block 2, which a later decode fills.
    for decodes, probe, hit in (([[bad], [7, 8]], [1, 2, 3, wrapped, 7, 8, 9], 2),
                                ([[4, bad], [6]], [1, 2, 3, 4, wrapped, 6, 9], 4)):
        for ids_in_range in (False, True):
            dev = pair(16, 2, max_model_len=32)[1]
            dev.step(new=[NewRequest("a", [1, 2, 3])])
            for toks in decodes:
                toks = [wrapped if t == bad and ids_in_range else t for t in toks]
                assert dev.decode([0], torch.tensor([toks], dtype=torch.int64 if ids_in_range else dtype)).ok
            assert dev.counters.d2h == 0 and not dev.failed  # each fit the host's bound: nothing was read
            if ids_in_range:  # every full block cached: the lookup hits all of them
                assert _hit_tokens(dev, probe) == len(probe) - 1
                assert dev.step(new=[NewRequest("b", [5])]).ok
                dev.check_invariants()
                continue
            # No hit on the block the wrapped id landed in, nor on any later block of the row.
            assert _hit_tokens(dev, probe) == hit
            # The next read (a step with a new request reads) finds it: a fault.
            with pytest.raises(InvalidInputError, match=r"outside \[0, 2\*\*32\)") as info:
                dev.step(new=[NewRequest("b", [5])])
            assert info.value.argument == "token_ids" and dev.failed
            with pytest.raises(ManagerFailedError):
                dev.decode([0], [5])


@pytest.mark.usefixtures("tokens_on_the_device")
def test_a_device_token_out_of_range_fails_the_decode_that_reads():
    # Pool of 3 usable blocks: a and b hold one each; both need one more, one
    # is free: the host cannot prove the batch fits, so the decode reads. b's
    # id is out of range (b does not even fit): the read raises, a fault.
    dev = pair(4, 2, max_model_len=16)[1]
    rows = dev.step(new=[NewRequest("a", [1, 2]), NewRequest("b", [3, 4])]).rows
    with pytest.raises(InvalidInputError) as info:
        dev.decode(rows, torch.tensor([[7], [2**32 + 1]]))
    assert info.value.argument == "new_token_ids" and dev.failed


@pytest.mark.usefixtures("tokens_on_the_device")
def test_device_tokens_in_range_pass_alike():
    # The ids the kernel must take: 0, 2**31 (negative as int32 storage) and 2**32 - 1.
    ref, dev = pair(16, 2, max_model_len=32)
    for m in (ref, dev):
        m.step(new=[NewRequest("a", [1, 2, 3])])
    toks = torch.tensor([[0, 2**31, 2**32 - 1]])
    assert ref.decode([0], toks.numpy()) == dev.decode([0], toks)
    assert state(ref) == state(dev) and not dev.failed
    assert _hit_tokens(dev, [1, 2, 3, 0, 2**31, 2**32 - 1, 9]) == _hit_tokens(ref, [1, 2, 3, 0, 2**31, 2**32 - 1, 9])
    dev.check_invariants()


def _step_tokens_on_the_device(monkeypatch, bad):
    """step()'s token ids as a CUDA tensor would reach the device manager:
    its normalisation keeps them as the tensor, unread."""
    from gpukv.core.requests import Step
    from gpukv.device.manager import DeviceManager

    real = DeviceManager._normalize

    def on_device(self, finished, running, new, **kw):
        step = real(self, finished, running, new, **kw)
        return Step(step.finished,
                    tuple(RunningUpdate(u.request_id, torch.tensor(bad), u.num_tokens_to_compute,
                                        u.num_lookahead_tokens) for u in step.running),
                    tuple(type(r)(r.request_id, torch.tensor([1, *bad])) for r in step.new))

    monkeypatch.setattr(DeviceManager, "_normalize", on_device)


@pytest.mark.parametrize("where", ["running", "new"])
def test_a_step_with_device_tokens_out_of_range_reads_and_stops(monkeypatch, where):
    dev = pair(16, 2, max_model_len=32)[1]
    dev.step(new=[NewRequest("a", [1, 2, 3])])
    _step_tokens_on_the_device(monkeypatch, [4, -7])
    with pytest.raises(InvalidInputError) as info:
        if where == "running":  # fits the host's bound: without device tokens this step reads nothing
            dev.step(running=[RunningUpdate("a", [0, 0])])
        else:
            dev.step(new=[NewRequest("b", [0, 0, 0])])
    assert info.value.argument == "token_ids" and dev.failed


def test_a_lookup_with_device_tokens_out_of_range_is_a_refusal(monkeypatch):
    dev = pair(16, 2, max_model_len=32)[1]
    dev.step(new=[NewRequest("a", [1, 2, 3])])
    _step_tokens_on_the_device(monkeypatch, [2, 2**33])
    with pytest.raises(InvalidInputError) as info:
        dev.get_computed_blocks(NewRequest("q", [0, 0, 0]))
    assert info.value.argument == "request.token_ids" and not dev.failed
    monkeypatch.undo()
    assert dev.get_computed_blocks(NewRequest("q", [1, 2, 3])).num_tokens == 2
    assert dev.step(new=[NewRequest("b", [1, 2, 3])]).ok
    dev.check_invariants()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tokens_out_of_range_on_both_managers():
    """The same on a GPU, with real CUDA tensors: the reference reads and
    refuses them (nothing changed); the device manager never reads them,
    gives no hit on them and stops at the next read."""
    ref = ReferenceManager(16, 2, hash_key=KEY, max_model_len=32)
    dev = DeviceManager(16, 2, hash_key=KEY, max_model_len=32, device="cuda")
    for m in (ref, dev):
        m.step(new=[NewRequest("a", [1, 2, 3])])
    bad = torch.tensor([[2**32 + 5]], device="cuda")
    with pytest.raises(InvalidInputError):
        ref.decode([0], bad)
    with pytest.raises(InvalidInputError):
        ref.step(running=[RunningUpdate("a", bad[0])])
    assert not ref.failed and ref.decode([0], [5]).ok
    assert dev.decode([0], bad).ok and dev.counters.d2h == 0 and not dev.failed
    assert _hit_tokens(dev, [1, 2, 3, 5, 9]) == 2 and _hit_tokens(ref, [1, 2, 3, 5, 9]) == 4
    with pytest.raises(InvalidInputError):
        dev.step(new=[NewRequest("b", [7])])
    assert dev.failed
    # In range, the device's tokens give the reference's result and state.
    ref = pair(16, 2, max_model_len=32)[0]
    dev = DeviceManager(16, 2, hash_key=KEY, max_model_len=32, device="cuda")
    for m in (ref, dev):
        m.step(new=[NewRequest("a", [1, 2, 3])])
    good = torch.tensor([[0, 2**31, 2**32 - 1]], device="cuda")
    assert ref.decode([0], good) == dev.decode([0], good)
    assert state(ref) == state(dev)
    dev_step = dev.step(running=[RunningUpdate("a", torch.tensor([7, 8], device="cuda", dtype=torch.int32))])
    assert dev_step == ref.step(running=[RunningUpdate("a", torch.tensor([7, 8], device="cuda", dtype=torch.int32))])
    assert state(ref) == state(dev) and not dev.failed


@pytest.mark.parametrize("no_tokens", [None, [[], []], np.zeros((2, 0), dtype=np.int64)])
def test_rows_that_only_continue_a_chunked_prefill_take_no_tokens_in_any_form(no_tokens):
    """``[[], []]`` is two rows of no token (numpy calls an empty list float,
    which is not a reason to refuse it), the same as None."""
    for m in pair(40, 4):
        m.step(new=[NewRequest("a", list(range(10)), num_tokens_to_compute=3),
                    NewRequest("b", list(range(20, 30)), num_tokens_to_compute=3)])
        res = m.decode([m.row_of("a"), m.row_of("b")], no_tokens, num_tokens_to_compute=[4, 4])
        assert res.ok and [m.num_computed_tokens(r) for r in "ab"] == [7, 7]
