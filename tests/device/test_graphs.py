"""CUDA-graph replay of the decode step and of the admission
(``gpukv.device.graphs``). On a GPU: captured, replayed, and equal to the eager
step and to the reference after every step. Everywhere: refused with a
clear error where there is no CUDA device, and the launches a graph
captures hold fixed per bucket (what makes one capture valid for every
replay)."""

import random

import numpy as np
import pytest
import torch

from gpukv.core.requests import NewRequest
from gpukv.device.graphs import AdmissionGraphs, DecodeGraphs, buckets
from gpukv.device.manager import DeviceManager
from gpukv.errors import InvalidInputError
from gpukv.kernels import capture
from gpukv.reference.manager import ReferenceManager

KEY = bytes(range(16))


@pytest.mark.parametrize("graphs", [DecodeGraphs, AdmissionGraphs])
def test_graphs_need_a_cuda_manager(graphs):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(InvalidInputError, match="CUDA graphs need a device manager on a CUDA device"):
        graphs(DeviceManager(8, 2, hash_key=KEY, max_model_len=16))


class AdmissionCapture:
    """What ``AdmissionGraphs`` captures, on the CPU: the manager hands it
    each part of the admission; it runs the launches eagerly every time and
    records them per key (bucket, part)."""

    def __init__(self) -> None:
        self.records: dict = {}

    def run(self, key, launch) -> None:
        with capture.recording() as rec:
            launch()
        self.records.setdefault(key, []).append(rec)


def test_an_admission_launches_the_same_sequence_per_bucket_whatever_it_admits():
    """Steps of one admission bucket admit different requests (hits, misses,
    pending hits, a refusal, a deferral round) with the same launches, so a
    graph captured once replays them all; and the results are the eager
    manager's and the reference's."""
    kw = dict(hash_key=KEY, max_model_len=64, uncached_first=False)
    graphed, eager = DeviceManager(14, 2, **kw), DeviceManager(14, 2, **kw)
    ref = ReferenceManager(14, 2, hash_key=KEY, uncached_first=False)
    capture = AdmissionCapture()
    rng = random.Random(5)
    docs = [[rng.randrange(20) for _ in range(8)] for _ in range(3)]
    live: list[str] = []
    for i in range(10):  # two 8-token requests a step (one bucket), sharing prefixes in a small pool
        new = [NewRequest(f"s{i}-{j}", (rng.choice(docs)[: rng.choice([4, 6, 8])]
                                        + [rng.randrange(20) for _ in range(8)])[:8]) for j in range(2)]
        finished = [r for r in live if rng.random() < 0.7]
        results = [graphed.step(finished, (), new, graphs=capture), eager.step(finished, (), new),
                   ref.step(finished, (), new)]
        assert results[0] == results[1] == results[2], i
        assert _state(graphed) == _state(eager) == _state(ref), i
        live = [r for r in live if r not in finished] + [r.request_id for r in new[: results[0].num_admitted]]
    assert {part for _, part in capture.records} == {"rows", "admit"}
    assert max(len(recs) for recs in capture.records.values()) >= 8  # a bucket, replayed
    for key, recs in capture.records.items():
        assert all(r == recs[0] for r in recs), key
        assert len(recs[0]) == (1 if key[1] == "rows" else 11), key  # 12 launches an admission, as eager
    graphed.check_invariants()


def test_buckets_are_powers_of_two_from_eight():
    assert buckets(1) == [8] and buckets(8) == [8] and buckets(9) == [8, 16] and buckets(100) == [8, 16, 32, 64, 128]


def _state(m):
    return (m.free_queue(), m.pool.table_entries() if hasattr(m.pool, "table_entries") else m.pool.table(),
            {r: (m.get_block_ids(r), m.num_computed_tokens(r)) for r in sorted(m.request_ids())})


@pytest.mark.gpu
@pytest.mark.parametrize("windows", [(None,), (None, 24)])
def test_graph_replays_equal_the_eager_step_and_the_reference(windows):
    rng = random.Random(0)
    kw = dict(sliding_windows=windows, hash_key=KEY, max_model_len=512, max_num_reqs=16)
    eager, graphed = DeviceManager(400, 4, **kw), DeviceManager(400, 4, **kw)
    ref = ReferenceManager(400, 4, **kw)
    graphs = DecodeGraphs(graphed)
    prompts = [[rng.randrange(50) for _ in range(rng.randint(3, 40))] for _ in range(11)]
    for m in (eager, graphed, ref):
        res = m.step(new=[NewRequest(f"r{i}", p) for i, p in enumerate(prompts)])
    rows = np.array(res.rows)
    for step in range(40):
        toks = torch.randint(0, 50, (len(rows),), device="cuda")
        a = eager.decode(rows, toks)
        b = graphs.decode(rows, toks)
        c = ref.decode(rows, toks.cpu().numpy())
        assert a == b == c, step
        torch.cuda.synchronize()
        assert _state(eager) == _state(graphed) == _state(ref), step
    assert graphs.replays >= 30 and graphs.captures <= 3
    graphed.check_invariants()


@pytest.mark.gpu
def test_graph_replays_write_the_same_kv_events_as_the_reference():
    """KV-cache events are torch operations around the kernels: a captured
    decode must replay them too (the step counts them in finish_decode,
    however the kernels ran)."""
    from gpukv.events.schema import BlockStored

    rng = random.Random(1)
    kw = dict(hash_key=KEY, max_model_len=512, max_num_reqs=16, enable_kv_cache_events=True)
    graphed, ref = DeviceManager(120, 4, **kw), ReferenceManager(120, 4, **kw)
    graphs = DecodeGraphs(graphed)
    prompts = [[rng.randrange(50) for _ in range(rng.randint(3, 40))] for _ in range(11)]
    for m in (graphed, ref):
        res = m.step(new=[NewRequest(f"r{i}", p) for i, p in enumerate(prompts)])
    rows = np.array(res.rows)
    for _step in range(40):
        toks = torch.randint(0, 50, (len(rows),), device="cuda")
        if not graphs.decode(rows, toks).ok or not ref.decode(rows, toks.cpu().numpy()).ok:
            break

    def flat(batches):
        out = []
        for b in batches:
            for e in b.events:
                hashes = e.block_hashes if hasattr(e, "block_hashes") else [None]
                out += [(type(e).__name__, d, getattr(e, "group", None)) for d in hashes]
        return out

    got, want = flat(graphed.take_events()), flat(ref.take_events())
    assert got == want and any(kind == BlockStored.__name__ for kind, _, _ in got)
    assert graphs.replays > 0


@pytest.mark.gpu
def test_admission_graph_replays_equal_the_eager_step_and_the_reference():
    rng = random.Random(2)
    kw = dict(hash_key=KEY, max_model_len=512, max_num_reqs=32, uncached_first=False)
    eager, graphed = DeviceManager(120, 4, **kw), DeviceManager(120, 4, **kw)
    ref = ReferenceManager(120, 4, hash_key=KEY, uncached_first=False)
    graphs = AdmissionGraphs(graphed)
    docs = [[rng.randrange(50) for _ in range(24)] for _ in range(3)]
    live: list[str] = []
    for step in range(30):
        new = [NewRequest(f"s{step}-{i}", rng.choice(docs)[: rng.randint(4, 24)] + [rng.randrange(50)])
               for i in range(rng.randint(1, 6))]
        finished = [r for r in live if rng.random() < 0.5]
        a = eager.step(finished, (), new, token_budget=64)
        b = graphs.step(finished, (), new, token_budget=64)
        c = ref.step(finished, (), new, token_budget=64)
        assert a == b == c, step
        torch.cuda.synchronize()
        assert _state(eager) == _state(graphed) == _state(ref), step
        live = [r for r in live if r not in finished] + [r.request_id for r in new[: a.num_admitted]]
    assert graphs.replays > 0
    graphed.check_invariants()
