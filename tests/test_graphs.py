"""CUDA-graph replay of the decode step (``gpukv.graphs``). On a GPU: captured,
replayed, and equal to the eager step and to the reference after every step.
Everywhere: refused with a clear error where there is no CUDA device."""

import random

import numpy as np
import pytest
import torch

from gpukv.errors import InvalidInputError
from gpukv.graphs import DecodeGraphs, buckets
from gpukv.manager import KVCacheManager as DeviceManager
from gpukv.reference import KVCacheManager as ReferenceManager
from gpukv.request import NewRequest

KEY = bytes(range(16))


def test_graphs_need_a_cuda_manager():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(InvalidInputError, match="CUDA graphs need a device manager on a CUDA device"):
        DecodeGraphs(DeviceManager(8, 2, hash_key=KEY, max_model_len=16))


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
    from gpukv.events import BlockStored

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
