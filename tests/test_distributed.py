"""Reconciling configs across real processes (gloo on CPU; NCCL on a GPU).

The multi-process test starts 3 ranks once and runs every scenario in them,
so the cost of starting Python + torch is paid once; each rank reports back
through a queue. No mocks: the collectives are torch.distributed's own.
"""

from __future__ import annotations

import datetime
import queue as queue_module
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gpukv.config import get_kv_cache_config
from gpukv.distributed import reconcile_kv_cache_config
from gpukv.spec import FullAttentionSpec, SlidingWindowSpec

WORLD_SIZE = 3
PAGE = 65536  # 2 * 16 * 8 * 128 * 2 bytes
FULL = FullAttentionSpec(16, 8, 128, torch.float16)


def _model(num_layers: int = 4, window: int | None = None) -> dict:
    spec = FULL if window is None else SlidingWindowSpec(16, 8, 128, torch.float16, window)
    return {f"layers.{i}": spec for i in range(num_layers)}


def _config_with_blocks(num_blocks: int, **model):
    """A 4-layer model given exactly ``num_blocks`` blocks' worth of memory."""
    specs = _model(**model)
    return get_kv_cache_config(specs, num_blocks * len(specs) * PAGE, max_model_len=64)


def _rank_main(rank: int, init_file: str, results) -> None:
    """One rank: run every scenario, put (rank, {scenario: outcome}) on ``results``."""
    outcome: dict = {}
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=WORLD_SIZE,
            timeout=datetime.timedelta(seconds=60),
        )
        # 1. Each rank measured different memory: 300, 200, 250 blocks.
        mine = _config_with_blocks([300, 200, 250][rank])
        outcome["min"] = reconcile_kv_cache_config(mine).to_dict()

        # 2. Rank 1 loaded a 5-layer model and rank 2 another window: every
        # rank must raise, naming rank 1 (the first that differs).
        model = [{}, {"num_layers": 5}, {"window": 64}][rank]
        try:
            reconcile_kv_cache_config(_config_with_blocks(100, **model))
            outcome["mismatch"] = None
        except ValueError as err:
            outcome["mismatch"] = str(err)

        # 3. A subgroup of ranks 1 and 2, where rank 2 differs: error names
        # global ranks. new_group must be called by every rank.
        sub = dist.new_group([1, 2])
        if rank in (1, 2):
            model = {"window": 64} if rank == 2 else {}
            try:
                reconcile_kv_cache_config(_config_with_blocks(100, **model), group=sub)
                outcome["subgroup"] = None
            except ValueError as err:
                outcome["subgroup"] = str(err)
            # The same subgroup agreeing: smallest of 40 and 30 blocks.
            outcome["subgroup_min"] = reconcile_kv_cache_config(
                _config_with_blocks([0, 40, 30][rank]), group=sub
            ).num_blocks
        dist.barrier()
    except BaseException:  # noqa: BLE001 - report everything to the test
        outcome["crash"] = traceback.format_exc()
    finally:
        results.put((rank, outcome))
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.fixture(scope="module")
def rank_outcomes(tmp_path_factory) -> dict[int, dict]:
    init_file = tmp_path_factory.mktemp("dist") / "store"
    results = mp.get_context("spawn").Queue()
    context = mp.spawn(
        _rank_main, args=(str(init_file), results), nprocs=WORLD_SIZE, join=False
    )
    outcomes: dict[int, dict] = {}
    try:
        # Drain the queue before joining: a child cannot exit while its
        # queued data is still unread.
        for _ in range(WORLD_SIZE):
            rank, outcome = results.get(timeout=120)
            outcomes[rank] = outcome
    except queue_module.Empty:
        pytest.fail(f"ranks {set(range(WORLD_SIZE)) - set(outcomes)} never reported")
    finally:
        while not context.join(timeout=60):
            pass
    for rank, outcome in outcomes.items():
        assert "crash" not in outcome, f"rank {rank} crashed:\n{outcome['crash']}"
    return outcomes


def test_every_rank_takes_the_smallest_num_blocks(rank_outcomes):
    # Ranks measured 300, 200 and 250 blocks; all use 200, and each of the 4
    # tensors shrinks to 65536 * 200 = 13107200 bytes.
    expected = _config_with_blocks(200).to_dict()
    for rank in range(WORLD_SIZE):
        assert rank_outcomes[rank]["min"] == expected
    assert expected["tensors"][0]["size"] == 13107200


def test_every_rank_raises_naming_the_first_rank_that_differs(rank_outcomes):
    for rank in range(WORLD_SIZE):
        message = rank_outcomes[rank]["mismatch"]
        assert message is not None, f"rank {rank} did not raise"
        assert message.startswith("rank 1 has different KV cache groups from rank 0: ")
        assert "'layers.4'" in message  # what differs: rank 1's fifth layer


def test_subgroup_names_global_ranks(rank_outcomes):
    for rank in (1, 2):
        message = rank_outcomes[rank]["subgroup"]
        assert message is not None and message.startswith(
            "rank 2 has different KV cache groups from rank 1: group 0 has spec SlidingWindowSpec"
        )
        assert rank_outcomes[rank]["subgroup_min"] == 30
    assert "subgroup" not in rank_outcomes[0]


def test_single_process_returns_config_unchanged():
    assert not dist.is_initialized()
    config = _config_with_blocks(10)
    assert reconcile_kv_cache_config(config) is config


def test_reconcile_rejects_non_config():
    with pytest.raises(TypeError, match="must be a KVCacheConfig"):
        reconcile_kv_cache_config(_config_with_blocks(10).to_dict())


@pytest.mark.gpu
def test_nccl_single_rank(tmp_path):
    torch.cuda.set_device(0)
    dist.init_process_group(
        "nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        config = _config_with_blocks(123)
        assert reconcile_kv_cache_config(config) == config
    finally:
        dist.destroy_process_group()
