"""``gpukv.reference``: the reference's parts on their own (digests, rows, and
admission, running and releases on a ``ReferenceState`` built without a manager)."""

import numpy as np

from gpukv.core import hashing
from gpukv.core.requests import NewRequest
from gpukv.core.windows import policies
from gpukv.reference.admission import ReferenceAdmission
from gpukv.reference.digests import Digests
from gpukv.reference.pool import BlockPool
from gpukv.reference.releases import ReferenceReleases
from gpukv.reference.rows import ReferenceRows
from gpukv.reference.running import ReferenceRunning
from gpukv.reference.state import ReferenceState

KEY = bytes(range(16))


def _new(rid, tokens):
    return NewRequest(rid, np.asarray(tokens, dtype=np.int64))


def test_digests_chain_full_blocks_from_the_root():
    d = Digests(KEY, 2, 1, memo_limit=100)
    st = d.new_state(_new("a", [1, 2, 3, 4, 5]))
    d.extend([st])
    assert len(st.block_hashes) == 2 and st.extras == [hashing.NO_EXTRA] * 2
    assert d.parent(st, 0) == hashing.root_digest(KEY) and d.parent(st, 1) == st.block_hashes[0]
    assert d.token_bytes(st, 1) == np.array([3, 4], dtype="<u4").tobytes()
    other = d.new_state(_new("b", [1, 2, 3, 4]))
    d.extend([other])
    assert other.block_hashes == st.block_hashes  # same tokens, same chain


def test_remembered_digests_come_back_only_for_the_same_tokens():
    d = Digests(KEY, 2, 1, memo_limit=100)
    st = d.new_state(_new("a", [1, 2, 3, 4]))
    d.extend([st])
    d.remember(st)
    again = d.new_state(_new("a", [1, 2, 3, 4, 9]))
    assert again.block_hashes == st.block_hashes and again.block_hashes is not st.block_hashes
    d.remember(st)
    changed = d.new_state(_new("a", [1, 2, 7, 4]))
    assert changed.block_hashes == []  # recalled entry dropped: the tokens differ


def test_the_memo_drops_the_oldest_past_its_limit():
    d = Digests(KEY, 2, 1, memo_limit=3)
    for rid in ("a", "b"):
        st = d.new_state(_new(rid, [1, 2, 3, 4]))
        d.extend([st])
        d.remember(st)
    assert d.new_state(_new("a", [1, 2, 3, 4])).block_hashes == []  # 4 digests > 3: "a" went first
    assert len(d.new_state(_new("b", [1, 2, 3, 4])).block_hashes) == 2


def test_rows_are_handed_out_in_order_and_grow():
    d = Digests(KEY, 2, 1, memo_limit=10)
    rows = ReferenceRows(1)
    a, b = d.new_state(_new("a", [1, 2, 3])), d.new_state(_new("b", [4]))
    assert (rows.take(a), rows.take(b)) == (0, 1)
    assert len(rows.state) >= 2 and rows.num_tokens[:2].tolist() == [3, 1]
    assert rows.ids == {0: "a", 1: "b"} and rows.in_use[:2].tolist() == [True, True]
    rows.check([a, b])
    rows.give_back(a)
    assert rows.ids == {1: "b"} and rows.state[0] is None and not rows.in_use[0]


def test_no_part_reads_the_pools_private_state():
    """The parts reach the pool through its public members only (what mypy
    checks), never an attribute of ``pool`` whose name starts with ``_``."""
    import ast
    from pathlib import Path

    folder = Path(__file__).resolve().parents[2] / "gpukv" / "reference"
    found = []
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                owner = node.value  # `pool` or `m.pool`
                name = getattr(owner, "id", None) or getattr(owner, "attr", None)
                if name == "pool":
                    found.append(f"{path.name}:{node.lineno}: pool.{node.attr}")
    assert found == []


def test_the_parts_run_on_a_state_without_a_manager():
    """Admission, running and releases take the state (and the admission the
    running part), nothing else: a request admitted, grown and freed."""
    state = ReferenceState(2, 1, True, policies([None], 2), BlockPool(8), Digests(KEY, 2, 1, memo_limit=100),
                           ReferenceRows(1))
    running = ReferenceRunning(state)
    admission, releases = ReferenceAdmission(state, running), ReferenceReleases(state)
    result = admission.admit_new([_new("a", [1, 2, 3, 4, 5])], None)
    assert (result.num_admitted, result.rows, result.num_new_tokens) == (1, [0], [5])
    st = state.requests["a"]
    assert st.blocks == [[1, 2, 3]] and st.num_cached_blocks == [2]
    assert sorted(b for blocks in state.pool.table().values() for b in blocks) == [1, 2]
    assert running.run_all([st], [[6]], [None], [0]) is None  # block 3 fills: nothing new to allocate
    running.cache_running([st])
    assert sorted(b for blocks in state.pool.table().values() for b in blocks) == [1, 2, 3]
    state.check_invariants()
    releases.request("a")
    assert state.requests == {} and state.rows.ids == {}
    assert state.pool.free_queue() == [4, 5, 6, 7, 3, 2, 1]  # all cached: each to the back, tail first
    state.check_invariants()


def test_no_part_reads_another_objects_private_attributes():
    """Each part reaches the state and its objects through public members
    only: no ``x._name`` where ``x`` is not ``self`` (what mypy checks)."""
    import ast
    from pathlib import Path

    folder = Path(__file__).resolve().parents[2] / "gpukv" / "reference"
    found = []
    for path in sorted(folder.glob("*.py")):
        if path.name == "manager.py":  # the manager owns what it reads
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            private = isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
            if private and not (isinstance(node.value, ast.Name) and node.value.id == "self"):
                found.append(f"{path.name}:{node.lineno}: .{node.attr}")
    assert found == []
