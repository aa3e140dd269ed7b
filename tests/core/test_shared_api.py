"""``gpukv.core.manager_base``: the calls both managers make alike, written once."""

import warnings

import pytest

from gpukv import NewRequest, PrefixHit
from gpukv.core.manager_base import SharedManagerAPI
from gpukv.device.manager import DeviceManager
from gpukv.errors import (
    CapacityError,
    InvalidInputError,
    InvalidTypeError,
    StaleComputedBlocksError,
    UnknownRequestError,
)
from gpukv.reference.manager import ReferenceManager

KEY = bytes(range(16))


def _both():
    return [cls(8, 2, hash_key=KEY, max_model_len=32, max_num_reqs=2, device="cpu")
            for cls in (ReferenceManager, DeviceManager)]


def test_both_managers_take_it_from_one_place():
    for cls in (ReferenceManager, DeviceManager):
        assert issubclass(cls, SharedManagerAPI)
        for name in ("allocate_slots", "read_usage", "row_token_counts", "from_config", "_normalize_step",
                     "prepare_admissions"):
            assert name not in vars(cls), f"{cls.__name__} writes {name} again"


def test_usage_and_the_waiting_properties():
    ref, dev = _both()
    for m in (ref, dev):
        m.step(new=[NewRequest("a", [1, 2, 3])])  # 2 blocks of the 7 usable
        assert m.read_usage() == pytest.approx(2 / 7)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert (ref.num_free_blocks, ref.num_evictions, ref.usage) == (5, 0, pytest.approx(2 / 7))
    for name, value in (("num_free_blocks", 5), ("num_evictions", 0), ("usage", pytest.approx(2 / 7))):
        with pytest.warns(DeprecationWarning, match=f"DeviceManager.{name} waits for the GPU.*read_{name}"):
            assert getattr(dev, name) == value


def test_allocate_slots_two_forms_refuse_alike():
    for m in _both():
        with pytest.raises(InvalidInputError, match="new_token_ids"):
            m.allocate_slots(NewRequest("n", [1, 2]), [3])
        with pytest.raises(InvalidTypeError, match="request"):
            m.allocate_slots(5)
        m.step(new=[NewRequest("a", [1, 2, 3])])
        with pytest.raises(InvalidInputError, match="computed"):
            m.allocate_slots("a", [4], computed=m.get_computed_blocks(NewRequest("p", [1, 2, 3])))
        with pytest.raises(UnknownRequestError):
            m.allocate_slots("nobody", [4])
        assert m.allocate_slots("a", [4, 5]) == [[3]]  # 5 tokens: a third block
        assert m.row_token_counts([m.row_of("a")])[0].tolist() == [5]
        m.check_invariants()


def _state(m):
    return (m.read_num_free_blocks(), sorted(m.request_ids()), m.free_queue())


def test_prefix_hit_by_its_size_then_admitted_with_it():
    """``read_prefix_hit`` gives a hit's size and its unheld blocks, ``admit``
    admits with exactly that hit: the ids stay with the manager, and both
    managers give the same blocks as ``allocate_slots`` with the ids would."""
    for m in (cls(8, 2, hash_key=KEY, max_model_len=32, max_num_reqs=4, device="cpu")
              for cls in (ReferenceManager, DeviceManager)):
        m.step(new=[NewRequest("a", [1, 2, 3, 4, 5])])  # blocks 1, 2 cached (full), 3 partial
        held = m.get_block_ids("a")[0]
        m.free("a")
        assert m.read_prefix_hit(NewRequest("b", [1, 2, 3, 4, 9])) == PrefixHit(4, 2)
        assert m.admit(NewRequest("c", [1, 2, 7]), PrefixHit(2, 1)) is True  # c holds the first cached block
        assert m.get_block_ids("c")[0][0] == held[0] and m.num_computed_tokens("c") == 3
        assert m.read_prefix_hit(NewRequest("b", [1, 2, 3, 4, 9])) == PrefixHit(4, 1)  # one hit block unheld now
        assert m.admit(NewRequest("b", [1, 2, 3, 4, 9]), PrefixHit(4, 1), num_lookahead_tokens=1) is True
        assert m.get_block_ids("b")[0][:2] == held[:2] and m.num_blocks_held("b") == 3
        assert m.read_prefix_hit(NewRequest("d", [5, 6, 7])) == PrefixHit(0, 0)
        before = _state(m)
        assert m.admit(NewRequest("e", list(range(100, 112)))) is False  # 6 blocks, 3 free
        assert _state(m) == before
        m.check_invariants()


def test_admit_refuses_a_stale_or_malformed_hit_and_changes_nothing():
    for m in (cls(8, 2, hash_key=KEY, max_model_len=32, max_num_reqs=4, device="cpu")
              for cls in (ReferenceManager, DeviceManager)):
        m.step(new=[NewRequest("a", [1, 2, 3, 4, 5])])
        before = _state(m)
        request = NewRequest("b", [1, 2, 8, 8, 9])  # only its first block is cached
        with pytest.raises(StaleComputedBlocksError, match="not what a lookup of this request finds now"):
            m.admit(request, PrefixHit(4, 0))
        with pytest.raises(InvalidInputError, match="whole blocks of 2 tokens, at most 4"):
            m.admit(request, PrefixHit(3, 0))
        with pytest.raises(InvalidInputError, match="at most 4"):
            m.admit(request, PrefixHit(6, 0))
        with pytest.raises(InvalidTypeError, match="PrefixHit or None"):
            m.admit(request, m.get_computed_blocks(request))  # (the ids form is allocate_slots')
        with pytest.raises(InvalidTypeError, match="NewRequest"):
            m.admit("b")
        with pytest.raises(InvalidInputError, match="a lookup of this"):
            m.admit(NewRequest("s", [1, 2, 3], skip_prefix_cache=True), PrefixHit(2, 0))
        assert _state(m) == before and "b" not in m.request_ids()
        assert m.admit(request, PrefixHit(2, 0)) is True
        m.check_invariants()


def test_prepare_admissions_refuses_alike_and_the_reference_prepares_nothing():
    ref, dev = _both()
    for m in (ref, dev):
        for bad, error in ((0, InvalidInputError), (33, CapacityError), (True, InvalidTypeError),
                           (8.0, InvalidTypeError)):
            with pytest.raises(error, match="max_prompt_len"):
                m.prepare_admissions(bad)
        for bad, error in ((-1, InvalidInputError), ("2", InvalidTypeError)):
            with pytest.raises(error, match="num_lookahead_tokens"):
                m.prepare_admissions(8, num_lookahead_tokens=bad)
    assert dev._admission.buffers == dev._releases.buffers == {}  # (refused before anything was made)
    assert ref.prepare_admissions() == ref.prepare_admissions(8, num_lookahead_tokens=3) == 0
    unbounded = ReferenceManager(8, 2, hash_key=KEY)  # (no max_model_len: the longest prompt must be given)
    with pytest.raises(InvalidInputError, match="max_prompt_len.*pass the longest prompt"):
        unbounded.prepare_admissions()
    assert unbounded.prepare_admissions(1000) == 0
    # Block size 2, prompts of 1-8 tokens. Steps (hit positions, token slots, new blocks, cached blocks):
    # 1 token (1, 1, 1, 1), 2 (1, 2, 1, 1), 3 (1, 4, 2, 1), 4 (1, 4, 2, 2), 5 (2, 8, 4, 2), 6 (2, 8, 4, 4),
    # 7-8 (4, 8, 4, 4); lookups (hit positions, token slots): (1, 1), (1, 2), (1, 4), (2, 8), (4, 8). A free
    # of up to 8 tokens: 4 positions of one group, padded to the smallest release bucket (16 entries).
    assert dev.prepare_admissions(8) == 7 + 5 + 1
    assert list(dev._releases.buffers) == [16]
