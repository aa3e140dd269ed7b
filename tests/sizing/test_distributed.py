"""Reconciling configs across real processes (gloo on CPU; NCCL on a GPU).

The multi-process test starts 3 ranks once and runs every scenario in them,
so the cost of starting Python + torch is paid once; each rank reports back
through a queue. No mocks: the collectives are torch.distributed's own.

In the attacks, rank 2 is hostile: it speaks the wire protocol by hand (as
``gpukv.sizing.reconcile``'s docstring describes it) and sends a pickle that
would create a file when unpickled, garbage, lengths that would make the
others allocate 10 GB, configs of the wrong shape; ranks 0 and 1 run the
real ``reconcile_kv_cache_config``. Each must raise the same
``ReconcileError`` naming rank 2, at once (the group's timeout is 30 s; each
attack must be over in 10), and the group must stay usable.
"""

from __future__ import annotations

import datetime
import json
import pickle
import queue as queue_module
import resource
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gpukv.errors import InvalidTypeError, ReconcileError
from gpukv.sizing.config import get_kv_cache_config
from gpukv.sizing.reconcile import PROTOCOL, reconcile_kv_cache_config
from gpukv.sizing.spec import FullAttentionSpec, SlidingWindowSpec

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


FIX = "run the same gpukv on every rank and pass each one's KVCacheConfig (from get_kv_cache_config)"
FROM_DICT_FIX = "pass what to_dict() returns (its JSON, parsed)"
HUGE = 10 * 2**30


class Exploit:
    """Unpickled, it creates the file ``path`` (any code could run instead)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _honest_dict() -> dict:
    return _config_with_blocks(100).to_dict()


def _with(change) -> bytes:
    """The honest config's JSON after ``change(dict)``."""
    data = _honest_dict()
    change(data)
    return json.dumps(data).encode()


def _attacks(pwned: str) -> dict[str, tuple[list[int], bytes | None]]:
    """Rank 2's attacks: name -> (its header, its payload or None to stop
    after the header, as the honest ranks do when a header is bad)."""
    def ok(payload: bytes) -> tuple[list[int], bytes]:
        return [PROTOCOL, 0, len(payload)], payload

    def group_spec(key, value):
        return lambda d: d["kv_cache_groups"][0]["kv_cache_spec"].__setitem__(key, value)

    return {
        "pickle0": ok(pickle.dumps(Exploit(pwned), protocol=0)),  # ASCII: gets past UTF-8 to the JSON parser
        "pickle5": ok(pickle.dumps(Exploit(pwned), protocol=5)),
        "garbage": ok(bytes(range(256)) * 4),
        "huge": ([PROTOCOL, 0, HUGE], None),
        "negative": ([PROTOCOL, 0, -5], None),
        "empty": ([PROTOCOL, 0, 0], None),
        "protocol": ([0x1234, 0, 10], None),
        "status": ([PROTOCOL, 7, 10], None),
        "num_blocks_str": ok(_with(lambda d: d.__setitem__("num_blocks", "many"))),
        "unknown_key": ok(_with(lambda d: d.__setitem__("__reduce__", "os.system"))),
        "kind_list": ok(_with(group_spec("kind", ["full_attention"]))),
        "dtype_attr": ok(_with(group_spec("dtype", "_dynamo"))),  # a torch attribute, not a dtype
        "shared_by_str": ok(_with(lambda d: d["tensors"][0].__setitem__("shared_by", "layers.0"))),
        "not_a_dict": ok(b"[1, 2, 3]"),
        "nan": ok(_with(lambda d: d.__setitem__("num_blocks", float("nan")))),
        "deep": ok(b"[" * 100_000),
        "long_key": ok(_with(lambda d: d.__setitem__("k" * 10_000, 1))),
    }


def _hostile(header: list[int], payload: bytes | None) -> None:
    """Rank 2's side of the protocol, by hand: a header, then a payload
    padded to the longest length every header announced."""
    mine = torch.tensor(header, dtype=torch.int64)
    headers = [torch.empty_like(mine) for _ in range(WORLD_SIZE)]
    dist.all_gather(headers, mine)
    if payload is None:
        return
    width = max(int(h[2]) for h in headers)
    data = torch.zeros(width, dtype=torch.uint8)
    data[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    dist.all_gather([torch.empty_like(data) for _ in range(WORLD_SIZE)], data)


def _refusal(call) -> tuple:
    """What ``call`` raised: (class, message, rank at fault, cause's class, seconds)."""
    start = time.monotonic()
    try:
        call()
    except ReconcileError as err:
        return (type(err).__name__, str(err), err.rank, type(err.__cause__).__name__, time.monotonic() - start)
    return (None, None, None, None, time.monotonic() - start)


def _address_space_capped(headroom: int):
    """Cap this process's address space at what it uses now plus
    ``headroom`` bytes (so that allocating 10 GB fails); returns the undo."""
    with open("/proc/self/status") as f:
        size_kb = next(int(line.split()[1]) for line in f if line.startswith("VmSize:"))
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (size_kb * 1024 + headroom, hard))
    return lambda: resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _run_attacks(rank: int, pwned: str, outcome: dict) -> None:
    for name, (header, payload) in _attacks(pwned).items():
        if rank == 2:
            _hostile(header, payload)
            continue
        undo = _address_space_capped(2 * 2**30) if name == "huge" else (lambda: None)
        try:
            outcome[f"attack:{name}"] = _refusal(lambda: reconcile_kv_cache_config(_config_with_blocks(100)))
        finally:
            undo()
    # An honest rank 1 whose caller passed a dict: every rank raises, rank 1 included.
    config = _config_with_blocks(100)
    outcome["not_a_config"] = _refusal(
        lambda: reconcile_kv_cache_config(config.to_dict() if rank == 1 else config))
    # The group still works: every rank ran the same collectives.
    outcome["after_attacks"] = reconcile_kv_cache_config(_config_with_blocks([30, 20, 25][rank])).num_blocks


def _rank_main(rank: int, init_file: str, results, pwned: str) -> None:
    """One rank: run every scenario, put (rank, {scenario: outcome}) on ``results``."""
    outcome: dict = {}
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=WORLD_SIZE,
            timeout=datetime.timedelta(seconds=30),
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
            outcome["mismatch_error"] = (type(err).__name__, err.rank)

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
        _run_attacks(rank, pwned, outcome)
        dist.barrier()
    except BaseException:  # noqa: BLE001 - report everything to the test
        outcome["crash"] = traceback.format_exc()
    finally:
        results.put((rank, outcome))
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.fixture(scope="module")
def dist_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("dist")


@pytest.fixture(scope="module")
def rank_outcomes(dist_dir) -> dict[int, dict]:
    init_file, pwned = dist_dir / "store", dist_dir / "pwned"
    results = mp.get_context("spawn").Queue()
    context = mp.spawn(
        _rank_main, args=(str(init_file), results, str(pwned)), nprocs=WORLD_SIZE, join=False
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
        assert rank_outcomes[rank]["mismatch_error"] == ("ReconcileError", 1)


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
    with pytest.raises(InvalidTypeError) as info:
        reconcile_kv_cache_config(_config_with_blocks(10).to_dict())
    assert str(info.value) == f"config: must be a KVCacheConfig, got dict; {FIX}"
    assert isinstance(info.value, TypeError)


def _expected_attacks(pwned: str) -> dict[str, str]:
    """Each attack's message on ranks 0 and 1 (hand-worked from the payloads)."""
    n = {name: len(payload) for name, (_, payload) in _attacks(pwned).items() if payload is not None}

    def sent(name: str, reason: str) -> str:
        return f"rank 2 sent {n[name]} bytes that are {reason}; {FIX}"

    def schema(name: str, problem: str) -> str:
        return sent(name, f"not a KV cache config (data: {problem}; {FROM_DICT_FIX})")

    long_reason = "not a KV cache config (data: a KV cache config dict has unknown key(s) '" + "k" * 10_000
    return {
        "pickle0": sent("pickle0", "not JSON (Expecting value: line 1 column 1 (char 0))"),
        "pickle5": sent("pickle5", "not UTF-8 (invalid start byte at byte 0)"),
        "garbage": sent("garbage", "not UTF-8 (invalid start byte at byte 128)"),
        "huge": f"rank 2 announced a config of 10737418240 bytes (the limit is 1 to 4194304); {FIX}",
        "negative": f"rank 2 announced a config of -5 bytes (the limit is 1 to 4194304); {FIX}",
        "empty": f"rank 2 announced a config of 0 bytes (the limit is 1 to 4194304); {FIX}",
        "protocol": f"rank 2 speaks another reconciliation protocol (header 0x1234, expected 0x67706b760001); {FIX}",
        "status": f"rank 2 sent an unknown status 7; {FIX}",
        "num_blocks_str": schema("num_blocks_str", "KVCacheConfig.num_blocks must be an int, got str 'many'; "
                                 "pass a positive whole number"),
        "unknown_key": schema("unknown_key", "a KV cache config dict has unknown key(s) '__reduce__'; its keys are "
                              "['kv_cache_groups', 'num_blocks', 'tensors']"),
        "kind_list": schema("kind_list", "unknown KV cache spec kind ['full_attention']; expected one of "
                            "['full_attention', 'sliding_window']"),
        "dtype_attr": schema("dtype_attr", "unknown torch dtype '_dynamo'; use a name like 'float16'"),
        "shared_by_str": schema("shared_by_str", "shared_by must be a list, got str"),
        "not_a_dict": schema("not_a_dict", "a KV cache config dict must be a dict, got list"),
        "nan": sent("nan", "not JSON (NaN is not a number JSON allows)"),
        "deep": sent("deep", "not JSON of a config (nested too deep)"),
        "long_key": sent("long_key", long_reason[:300] + "..."),
    }


def test_every_honest_rank_refuses_each_attack_alike_at_once(rank_outcomes, dist_dir):
    expected = _expected_attacks(str(dist_dir / "pwned"))
    assert len(expected) == 17
    for name, message in expected.items():
        for rank in (0, 1):
            kind, text, at_fault, cause, seconds = rank_outcomes[rank][f"attack:{name}"]
            assert (kind, text, at_fault, cause) == ("ReconcileError", message, 2, "NoneType"), (name, rank)
            assert seconds < 10, f"{name}: rank {rank} took {seconds:.1f} s"


def test_a_pickle_from_a_peer_is_never_unpickled(rank_outcomes, dist_dir):
    assert rank_outcomes[0]["attack:pickle0"][0] == "ReconcileError"
    assert not (dist_dir / "pwned").exists()
    # The payload is live: unpickled (as all_gather_object would), it creates its file.
    control = dist_dir / "control"
    pickle.loads(pickle.dumps(Exploit(str(control)), protocol=0))
    assert control.exists()


def test_a_rank_passed_a_non_config_still_joins_and_every_rank_raises(rank_outcomes):
    for rank in range(WORLD_SIZE):
        kind, text, at_fault, cause, seconds = rank_outcomes[rank]["not_a_config"]
        assert (kind, text, at_fault) == ("ReconcileError", f"rank 1 did not pass a KVCacheConfig; {FIX}", 1)
        assert cause == ("InvalidTypeError" if rank == 1 else "NoneType")  # rank 1 says what it got
        assert seconds < 10


def test_the_group_still_agrees_after_the_attacks(rank_outcomes):
    assert [rank_outcomes[r]["after_attacks"] for r in range(WORLD_SIZE)] == [20, 20, 20]


def test_a_reconcile_error_pickles_with_its_rank():
    err = pickle.loads(pickle.dumps(ReconcileError("rank 3 did not pass a KVCacheConfig", fix=FIX, rank=3)))
    assert (type(err), str(err), err.rank) == (ReconcileError, f"rank 3 did not pass a KVCacheConfig; {FIX}", 3)
    assert isinstance(err, ValueError)


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
