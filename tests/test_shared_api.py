"""``gpukv.shared_api``: the calls both managers make alike, written once."""

import warnings

import pytest

from gpukv import NewRequest
from gpukv.errors import InvalidInputError, InvalidTypeError, UnknownRequestError
from gpukv.manager import DeviceManager
from gpukv.reference import ReferenceManager
from gpukv.shared_api import SharedManagerAPI

KEY = bytes(range(16))


def _both():
    return [cls(8, 2, hash_key=KEY, max_model_len=32, max_num_reqs=2, device="cpu")
            for cls in (ReferenceManager, DeviceManager)]


def test_both_managers_take_it_from_one_place():
    for cls in (ReferenceManager, DeviceManager):
        assert issubclass(cls, SharedManagerAPI)
        for name in ("allocate_slots", "read_usage", "row_token_counts", "from_config", "_normalize_step"):
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
