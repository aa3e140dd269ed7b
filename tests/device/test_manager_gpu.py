"""The device manager on CUDA: far larger differential cases, contention
(thousands of requests in one step inserting the same hashes and touching the
same blocks), and no host synchronisation in a decode-only step.

Marked ``gpu``: deselected by default; ``pytest -m gpu`` on a CUDA machine."""

import random
import warnings

import pytest
import torch

from gpukv.core.requests import NewRequest, RunningUpdate
from gpukv.device.manager import DeviceManager
from gpukv.reference.manager import ReferenceManager
from workload import assert_same, check, drive

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

KEY = bytes(range(16))


def pair(num_blocks, block_size, max_model_len=4096):
    ref = ReferenceManager(num_blocks, block_size, hash_key=KEY)
    dev = DeviceManager(num_blocks, block_size, hash_key=KEY, max_model_len=max_model_len, device="cuda")
    return ref, dev


@pytest.mark.parametrize("seed", range(4))
def test_random_workloads_match_the_reference_on_cuda(seed):
    ref, dev = pair(400, 4)
    drive([ref, dev], seed, 40, check, max_new=12)
    assert dev.make_prefix_cache_stats() == ref.make_prefix_cache_stats()


def test_thousands_of_requests_sharing_prefixes_in_one_step():
    rng = random.Random(0)
    prompts = [[rng.randrange(1000) for _ in range(64)] for _ in range(3)]
    ref, dev = pair(40_000, 16)
    new = [NewRequest(f"r{i}", rng.choice(prompts) + [rng.randrange(1000) for _ in range(rng.randint(1, 40))])
           for i in range(2000)]
    results = [m.step(new=new) for m in (ref, dev)]
    assert results[0] == results[1] and results[0].num_admitted == 2000
    assert_same(ref, dev)
    # Free half, then the same prefixes hit free cached blocks from thousands of requests at once.
    finished = [r.request_id for r in new[::2]]
    again = [NewRequest(f"s{i}", rng.choice(prompts) + [7] * rng.randint(1, 20)) for i in range(2000)]
    results = [m.step(finished=finished, new=again) for m in (ref, dev)]
    assert results[0] == results[1]
    assert_same(ref, dev)
    assert dev.make_prefix_cache_stats() == ref.make_prefix_cache_stats()


def test_decode_only_step_does_not_synchronise():
    _, dev = pair(4096, 16)
    dev.step(new=[NewRequest(f"r{i}", list(range(i, i + 100))) for i in range(64)])
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            # Sampled tokens already on the GPU, as a serving loop has them.
            sampled = torch.full((20,), 5, dtype=torch.int64, device="cuda")
            res = dev.step(running=[RunningUpdate(f"r{i}", sampled) for i in range(64)])
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert res.ok and dev.counters.syncs == 0
    assert not [w for w in caught if "synchroniz" in str(w.message).lower()], [str(w.message) for w in caught]


def test_a_call_from_another_stream_is_ordered_both_ways():
    """A manager built on the default stream, called from a side stream
    (``gpukv.device.manager``, "Streams"): the step waits for the tokens the side
    stream writes after a long busy wait (else it would read the zeros
    there), and the side stream's next kernel sees the block table the
    manager gathered on its own stream."""
    ref, dev = pair(256, 4)
    prompt = list(range(10))
    for m in (ref, dev):
        m.step(new=[NewRequest("a", prompt)])
    default = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    side.wait_stream(default)
    with torch.cuda.stream(side):
        tokens = torch.zeros(8, dtype=torch.int64, device="cuda")
        torch.cuda._sleep(200_000_000)  # about 0.1 s of the side stream
        tokens.fill_(7)
        res = dev.step(running=[RunningUpdate("a", tokens)])
        assert torch.cuda.current_stream() == side  # back on the caller's stream
        table = dev.block_table_for(["a"])
        torch.cuda._sleep(50_000_000)
        seen = table.clone()  # a kernel of the caller's, after the gather
    assert res == ref.step(running=[RunningUpdate("a", [7] * 8)])
    side.synchronize()
    want = ref.get_block_ids("a")[0]
    assert seen[0, 0, : len(want)].tolist() == want
    assert dev.block_hashes("a") == ref.block_hashes("a")  # the digests of the 7s, not of zeros
    assert_same(ref, dev)
