"""One API for both managers (``gpukv.core.protocol.BlockManager``): the same members
and signatures, and the calls added for it answered alike."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch

from gpukv.core.protocol import BlockManager
from gpukv.core.requests import NewRequest, RunningUpdate
from gpukv.device.manager import DeviceManager
from gpukv.reference.manager import ReferenceManager

KEY = bytes(range(16))
MANAGERS = [ReferenceManager, DeviceManager]
# Members only the device manager has: the row tensors' generation, which
# tells gpukv.device.graphs when to capture anew (the decode's parts are private:
# one decode call runs them, under its call lock), and what a model runner
# reads of its rows (gpukv.vllm.v0_33.binding).
DEVICE_ONLY = {"rows_generation", "block_table", "request_rows", "blocks_held_per_row", "stream"}


def public(cls) -> set[str]:
    return {n for n in dir(cls) if not n.startswith("_")}


def protocol_members() -> set[str]:
    names = {n for n in vars(BlockManager) if not n.startswith("_")}
    return names | set(BlockManager.__annotations__)


def test_both_managers_have_the_same_public_surface():
    assert public(ReferenceManager) == public(DeviceManager) - DEVICE_ONLY


@pytest.mark.parametrize("cls", MANAGERS, ids=["reference", "device"])
def test_each_manager_has_every_protocol_member(cls):
    m = cls(8, 2, hash_key=KEY, max_model_len=16)
    assert isinstance(m, BlockManager)
    missing = {n for n in protocol_members() if not hasattr(m, n)}
    assert not missing


def _params(fn) -> list[tuple[str, object]]:
    return [(p.name, p.kind) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("name", sorted(n for n in vars(BlockManager) if not n.startswith("_")
                                        and callable(getattr(BlockManager, n))))
def test_methods_take_the_same_arguments(name):
    ref, dev = getattr(ReferenceManager, name), getattr(DeviceManager, name)
    want = _params(getattr(BlockManager, name))
    # Extra trailing keyword-only arguments are allowed (the device decode's graphs=).
    assert _params(ref)[: len(want)] == want, name
    assert _params(dev)[: len(want)] == want, name
    extra = [p for p in _params(ref)[len(want):] + _params(dev)[len(want):]]
    assert all(kind is inspect.Parameter.KEYWORD_ONLY for _, kind in extra), (name, extra)


def test_constructors_take_the_same_arguments():
    assert _params(ReferenceManager.__init__) == _params(DeviceManager.__init__)


def test_every_public_method_has_a_docstring():
    for cls in MANAGERS:
        for name in public(cls):
            member = inspect.getattr_static(cls, name)
            if isinstance(member, (staticmethod, classmethod)):
                member = member.__func__
            if isinstance(member, property):
                member = member.fget
            if callable(member):
                assert inspect.getdoc(member), f"{cls.__module__}.{name} has no docstring"


# ------------------------------------------------------------ the calls

@pytest.mark.parametrize("cls", MANAGERS, ids=["reference", "device"])
def test_from_config_builds_one_group_per_config_group(cls):
    from gpukv import FullAttentionSpec, SlidingWindowSpec, get_kv_cache_config

    spec = {"full.0": FullAttentionSpec(4, 1, 8, torch.float16),
            "swa.0": SlidingWindowSpec(4, 1, 8, torch.float16, sliding_window=8)}
    cfg = get_kv_cache_config(spec, available_memory=64 * 4 * 1 * 8 * 2 * 2 * 2, max_model_len=32)
    m = cls.from_config(cfg, hash_key=KEY, max_model_len=32)
    assert m.num_blocks == cfg.num_blocks
    assert m.block_size == 4
    assert sorted(m.sliding_windows, key=str) == sorted([None, 8], key=str)


def _pair(**kw):
    return [cls(12, 2, hash_key=KEY, max_model_len=16, **kw) for cls in MANAGERS]


def test_usage_block_tables_and_common_prefix_blocks_agree():
    managers = _pair()
    for m in managers:
        m.step(new=[NewRequest("a", [1, 2, 3, 4, 5]), NewRequest("b", [1, 2, 3, 4, 9])])
    ref, dev = managers
    # a: blocks 1, 2, 3; b hits a's two full blocks and takes 4 of its own.
    assert ref.get_block_ids("b") == dev.get_block_ids("b") == [[1, 2, 4]]
    assert ref.usage == ref.read_usage() == dev.read_usage() == pytest.approx(4 / 11)
    with pytest.warns(DeprecationWarning, match="read_usage"):  # a property must not wait for the GPU
        assert dev.usage == pytest.approx(4 / 11)
    with pytest.warns(DeprecationWarning, match="read_num_free_blocks"):
        assert dev.num_free_blocks == 7
    for m in managers:
        assert m.read_num_free_blocks() == 7
        assert m.get_num_common_prefix_blocks("a", 2) == [2]
        assert m.get_num_common_prefix_blocks("a", 1) == [0]
        assert m.get_num_common_prefix_blocks("b", 2) == [2]
    table = [m.block_table_for(["b", "a"]).cpu() for m in managers]
    assert table[0].shape == table[1].shape == (1, 2, 8)
    assert table[0][:, :, :3].tolist() == table[1][:, :, :3].tolist() == [[[1, 2, 4], [1, 2, 3]]]


def test_a_window_group_has_no_common_prefix():
    for cls in MANAGERS:
        m = cls(12, 2, sliding_windows=[None, 2], hash_key=KEY, max_model_len=16)
        m.step(new=[NewRequest("a", [1, 2, 3, 4, 5])])
        assert m.get_num_common_prefix_blocks("a", 1) == [3, 0]


def test_without_caching_nothing_hits_and_both_agree():
    managers = _pair(enable_caching=False)
    for m in managers:
        res = m.step(new=[NewRequest("a", [1, 2, 3, 4, 5])])
        assert res.num_computed_tokens == [0]
        m.step(running=[RunningUpdate("a", [6, 7])])
        res = m.step(new=[NewRequest("b", [1, 2, 3, 4, 5])])
        assert res.num_computed_tokens == [0]  # a's full blocks were never cached
        assert m.get_computed_blocks(NewRequest("c", [1, 2, 3])).num_tokens == 0
        m.check_invariants()
    ref, dev = managers
    for rid in ("a", "b"):
        assert dev.get_block_ids(rid) == ref.get_block_ids(rid)
    assert dev.free_queue() == ref.free_queue()
    assert dev.make_prefix_cache_stats() == ref.make_prefix_cache_stats()


def test_the_reference_lives_on_the_host():
    from gpukv.errors import InvalidInputError

    assert ReferenceManager(4, 2, device="cpu").device == torch.device("cpu")
    with pytest.raises(InvalidInputError, match="device: the reference manager lives on the host"):
        ReferenceManager(4, 2, device="meta")


# ------------------------------------------------------------ what the docs name

ROOT = Path(__file__).resolve().parents[2]


def _api_md_names() -> tuple[set[str], set[str]]:
    """Manager members docs/api.md names: the gpukv column of its tables
    (both managers), and its "Device only:" paragraph."""
    shared: set[str] = set()
    text = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    in_table = False
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if not cells:
            in_table = False
            continue
        if cells[0] == "gpukv":
            in_table = True
            continue
        if not in_table:
            continue
        for span in re.findall(r"`([^`]+)`", cells[0]):
            name = re.match(r"[A-Za-z_][\w.]*", span)
            if name is None or span[name.end():].startswith("="):  # a keyword argument
                continue
            parts = name[0].split(".")
            if parts[0] in ("DeviceManager", "ReferenceManager"):
                parts = parts[1:]
            if parts and not parts[0][0].isupper():  # NewRequest(...), StepResult.rows: not the manager's
                shared.add(parts[0])
    device_only = text[text.index("Device only:"):]
    device = set(re.findall(r"`(\w+)`", device_only.split("\n\n")[0]))
    return shared, device


def _readme_names() -> set[str]:
    """Members README.md calls on a manager (``m.x``, ``manager.x``)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return set(re.findall(r"(?<![\w./])(?:m|manager)\.([A-Za-z_]\w*)", text))


def test_the_docs_name_members_both_managers_have():
    shared, device_only = _api_md_names()
    readme = _readme_names()
    # (the extraction finds what it should)
    assert {"step", "decode", "from_config", "read_usage", "usage", "check_invariants", "hash_key"} <= shared
    assert {"counters", "failed", "row_of", "take_events"} <= readme
    assert device_only == DEVICE_ONLY - {"rows_generation"}
    managers = [cls(8, 2, hash_key=KEY, max_model_len=16) for cls in MANAGERS]
    missing = [f"{type(m).__name__}.{name}" for m in managers for name in sorted(shared | readme)
               if not _has(m, name)]
    assert not missing, missing
    assert all(_has(managers[1], name) for name in device_only)


def _has(obj, name: str) -> bool:
    """``hasattr`` without running a property (the device's read the GPU and warn)."""
    try:
        inspect.getattr_static(obj, name)
    except AttributeError:
        return False
    return True


def test_counters_are_the_same_type_on_both_managers():
    from gpukv.core.metrics import StepCounters

    ref, dev = _pair()
    for m in (ref, dev):
        m.step(new=[NewRequest("a", [1, 2, 3, 4, 5])])
        assert type(m.counters) is StepCounters
    assert dev.counters.launches > 0 and dev.counters.steps == 1
    assert ref.counters == StepCounters()  # the host reference launches, uploads and reads nothing


# ------------------------------------------------------------ the public API

PUBLIC = {
    "BlockManager", "DeviceManager", "ReferenceManager",  # the managers and their protocol
    "NewRequest", "RunningUpdate", "RunningBatch", "MMItem",  # what a step takes
    "ComputedBlocks", "PrefixHit", "StepResult", "PrefixCacheStats",  # what the calls return
    "GpukvError",  # the base error (the others: gpukv.errors)
    "get_kv_cache_config", "reconcile_kv_cache_config", "KVCacheConfig", "FullAttentionSpec",
    "SlidingWindowSpec",  # sizing
    "slot_mapping", "DecodeGraphs", "RouterIndex",  # a serving loop's and a router's tools
}


def test_the_package_exports_what_a_user_needs_and_no_error_but_the_base():
    import gpukv
    from gpukv.kernels.slot_mapping import slot_mapping

    assert set(gpukv.__all__) == PUBLIC
    assert (gpukv.DeviceManager, gpukv.ReferenceManager, gpukv.BlockManager) == (
        DeviceManager, ReferenceManager, BlockManager)
    assert gpukv.slot_mapping is slot_mapping


@pytest.mark.parametrize("module", ["gpukv.device.manager", "gpukv.reference.manager"])
def test_the_managers_have_one_name_each(module):
    import importlib

    mod = importlib.import_module(module)
    assert not hasattr(mod, "KVCacheManager")
    assert "KVCacheManager" not in mod.__all__
