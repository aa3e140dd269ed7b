"""The slot-mapping kernel: hand-worked exact values, padding, strided and
grouped block tables, long requests (several tiles), bad inputs, and a real
compile for sm_80/sm_90 without a GPU."""

from __future__ import annotations

import pytest
import torch

from gpukv import _runtime
from gpukv.kernels.slot_mapping import PAD, slot_mapping

DEV = _runtime.default_device()


def i32(x):
    return torch.tensor(x, dtype=torch.int32, device=DEV)


def i64(x):
    return torch.tensor(x, dtype=torch.int64, device=DEV)


def reference(bt, lens, starts, block_size, num_tokens):
    """Slot mapping and positions in plain Python (vLLM's formula)."""
    slots, pos = [], []
    for b, (n, s) in enumerate(zip(lens, starts, strict=True)):
        for j in range(n):
            p = s + j
            slots.append(int(bt[b][p // block_size]) * block_size + p % block_size)
            pos.append(p)
    pad = num_tokens - len(slots)
    return slots + [PAD] * pad, pos + [0] * pad


# --------------------------------------------------------------- exact values


def test_hand_worked_two_requests_with_padding():
    # block_size 4. Request 0 holds blocks [3, 7] and computes positions 2, 3, 4:
    # 3*4+2 = 14, 3*4+3 = 15, 7*4+0 = 28. Request 1 holds [5, 0] (its second
    # entry unused) and computes positions 1, 2: 5*4+1 = 21, 22. Three padding
    # tokens (a batch padded to 8) get PAD.
    bt = i32([[3, 7], [5, 0]])
    slots, pos = slot_mapping(bt, i32([0, 3, 5]), i32([2, 1]), block_size=4, num_tokens=8, with_positions=True)
    assert slots.dtype == torch.int64 and pos.dtype == torch.int64
    assert slots.tolist() == [14, 15, 28, 21, 22, -1, -1, -1]
    assert pos.tolist() == [2, 3, 4, 1, 2, 0, 0, 0]
    assert PAD == -1


def test_prefill_from_zero_and_decode_of_one_token():
    # A prefill of 5 tokens from position 0 (blocks [2, 9], block_size 4) and a
    # decode of position 6 of a request holding [4, 1]: 1*4 + 2 = 6.
    bt = i32([[2, 9], [4, 1]])
    slots = slot_mapping(bt, i32([0, 5, 6]), i32([0, 6]), block_size=4, num_tokens=6)
    assert slots.tolist() == [8, 9, 10, 11, 36, 6]


def test_request_with_no_tokens_and_no_padding():
    bt = i32([[1, 2], [3, 4], [5, 6]])
    # request 1 schedules nothing this step
    slots = slot_mapping(bt, i32([0, 2, 2, 3]), i32([3, 0, 7]), block_size=4, num_tokens=3)
    assert slots.tolist() == [7, 8, 27]


def test_block_size_one_and_large_ids_do_not_overflow_int32():
    big = 2**31 - 5
    bt = i32([[big, 7]])
    slots = slot_mapping(bt, i32([0, 2]), i32([0]), block_size=1, num_tokens=2)
    assert slots.tolist() == [big, 7]
    slots = slot_mapping(bt, i32([0, 1]), i32([0]), block_size=16, num_tokens=1)
    assert slots.tolist() == [big * 16]  # > 2**31: computed in int64


def test_num_tokens_read_from_the_device_when_not_given():
    bt = i32([[3, 7]])
    assert slot_mapping(bt, i32([0, 2]), i32([3]), block_size=4).tolist() == [15, 28]


def test_empty_batch_is_all_padding():
    bt = torch.zeros((0, 4), dtype=torch.int32, device=DEV)
    slots, pos = slot_mapping(bt, i32([0]), i32([]), block_size=4, num_tokens=5, with_positions=True)
    assert slots.tolist() == [PAD] * 5 and pos.tolist() == [0] * 5
    assert slot_mapping(bt, i32([0]), i32([]), block_size=4, num_tokens=0).numel() == 0


def test_int64_inputs():
    bt = i64([[3, 7], [5, 0]])
    slots = slot_mapping(bt, i64([0, 3, 5]), i64([2, 1]), block_size=4, num_tokens=5)
    assert slots.tolist() == [14, 15, 28, 21, 22]


def test_position_outside_the_table_gets_pad_not_a_foreign_slot():
    # Request 0 has 2 block positions (8 tokens of block_size 4); positions
    # 7, 8, 9 are scheduled: 8 and 9 have no block position, so PAD.
    bt = i32([[3, 7], [5, 6]])
    slots = slot_mapping(bt, i32([0, 3, 4]), i32([7, 0]), block_size=4, num_tokens=4)
    assert slots.tolist() == [31, PAD, PAD, 20]


# ----------------------------------------------------- layouts the manager has


def test_group_of_a_three_dim_table_and_strided_views():
    # [G=2, B=2, M=3]: group 1 is the one mapped.
    bt = i32([[[1, 2, 3], [4, 5, 6]], [[7, 8, 9], [10, 11, 12]]])
    qsl, starts = i32([0, 2, 3]), i32([3, 8])
    want = reference(bt[1].tolist(), [2, 1], [3, 8], 4, 3)[0]
    assert slot_mapping(bt, qsl, starts, block_size=4, num_tokens=3, group=1).tolist() == want
    assert slot_mapping(bt[1], qsl, starts, block_size=4, num_tokens=3).tolist() == want
    # A transposed (column-major) copy: strides (1, B).
    t = bt[1].t().contiguous().t()
    assert t.stride() == (1, 2)
    assert slot_mapping(t, qsl, starts, block_size=4, num_tokens=3).tolist() == want
    # Every other block position: stride 2 along M.
    wide = i32([[7, 0, 8, 0, 9, 0], [10, 0, 11, 0, 12, 0]])[:, ::2]
    assert slot_mapping(wide, qsl, starts, block_size=4, num_tokens=3).tolist() == want


def test_block_table_for_of_the_device_manager():
    from gpukv.core.requests import NewRequest
    from gpukv.device.manager import DeviceManager

    m = DeviceManager(16, 4, hash_key=bytes(16), max_model_len=32, max_num_reqs=4, device=DEV)
    m.step(new=[NewRequest("a", list(range(6))), NewRequest("b", list(range(100, 109)))])
    ids = [m.get_block_ids(r)[0] for r in ("a", "b")]
    bt = m.block_table_for(["b", "a"])
    slots = slot_mapping(bt, i32([0, 9, 15]), i32([0, 0]), block_size=4, num_tokens=16, group=0, check=True)
    want = [ids[1][p // 4] * 4 + p % 4 for p in range(9)] + [ids[0][p // 4] * 4 + p % 4 for p in range(6)]
    assert slots.tolist() == want + [PAD]


def test_many_tiles_and_random_batches_match_the_formula():
    g = torch.Generator().manual_seed(0)
    for trial in range(6):
        B = int(torch.randint(1, 6, (1,), generator=g))
        bs = [1, 3, 4, 16][trial % 4]
        M = 40
        bt = torch.randint(1, 1000, (B, M), generator=g, dtype=torch.int32)
        lens = torch.randint(0, 300 if trial % 2 else 20, (B,), generator=g).tolist()
        starts = [int(torch.randint(0, M * bs - n + 1, (1,), generator=g)) if n <= M * bs else 0 for n in lens]
        lens = [min(n, M * bs) for n in lens]
        qsl = [0]
        for n in lens:
            qsl.append(qsl[-1] + n)
        T = qsl[-1] + trial
        slots, pos = slot_mapping(bt.to(DEV), i32(qsl), i32(starts), block_size=bs, num_tokens=T,
                                  with_positions=True, check=True)
        want_slots, want_pos = reference(bt.tolist(), lens, starts, bs, T)
        assert slots.tolist() == want_slots, trial
        assert pos.tolist() == want_pos, trial


def test_deterministic():
    bt = i32([[3, 7, 9], [5, 2, 8]])
    args = (bt, i32([0, 7, 10]), i32([2, 5]))
    a = slot_mapping(*args, block_size=4, num_tokens=16)
    b = slot_mapping(*args, block_size=4, num_tokens=16)
    assert torch.equal(a, b)


# ---------------------------------------------------------------- bad inputs


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(block_table=[[1, 2]]), TypeError, "block_table must be a torch.Tensor"),
    (dict(block_table=torch.ones((1, 2))), TypeError, "block_table must be int32 or int64"),
    (dict(block_table=torch.ones((2,), dtype=torch.int32)), ValueError, "block_table must be 2-D"),
    (dict(query_start_loc=torch.tensor([0.0, 2.0])), TypeError, "query_start_loc must be int32 or int64"),
    (dict(query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32)), ValueError, "B \\+ 1 = 2 entries"),
    (dict(start_positions=torch.tensor([[0]], dtype=torch.int32)), ValueError, "start_positions must be 1-D"),
    (dict(start_positions=torch.tensor([0, 0], dtype=torch.int32)), ValueError, "start_positions must have B = 1"),
    (dict(start_positions=torch.tensor([0], dtype=torch.int16)), TypeError, "int32 or int64"),
    (dict(block_size=0), ValueError, "block_size must be a positive int"),
    (dict(block_size=True), ValueError, "block_size must be a positive int"),
    (dict(block_size=4.0), ValueError, "block_size must be a positive int"),
    (dict(num_tokens=-1), ValueError, "num_tokens must be >= 0"),
    (dict(num_tokens=2.0), TypeError, "num_tokens must be an int"),
    (dict(group=0), ValueError, "group= goes with a \\[G, B, M\\] block_table"),
    (dict(block_table=torch.ones((2, 1, 2), dtype=torch.int32)), ValueError, "needs group="),
    (dict(block_table=torch.ones((2, 1, 2), dtype=torch.int32), group=2), ValueError, "group 2 is outside"),
    (dict(query_start_loc=torch.tensor([0, 2], dtype=torch.int32, device="meta")), ValueError,
     "put every input on one device"),
])
def test_bad_inputs_raise_clearly(kwargs, exc, match):
    args = dict(block_table=torch.tensor([[3, 7]], dtype=torch.int32), query_start_loc=i32([0, 2]).cpu(),
                start_positions=i32([1]).cpu(), block_size=4, num_tokens=2)
    args.update(kwargs)
    args = {k: (v.to(DEV) if isinstance(v, torch.Tensor) and v.device.type == "cpu" else v) for k, v in args.items()}
    with pytest.raises(exc, match=match):
        slot_mapping(args.pop("block_table"), args.pop("query_start_loc"), args.pop("start_positions"), **args)


@pytest.mark.parametrize("qsl, starts, bt, num_tokens, match", [
    ([1, 2], [0], [[3, 7]], 2, "query_start_loc\\[0\\] must be 0"),
    ([0, 3, 2], [0, 0], [[3, 7], [5, 6]], 3, "must be non-decreasing"),
    ([0, 3], [0], [[3, 7]], 2, "do not fit num_tokens = 2"),
    ([0, 2], [-1], [[3, 7]], 2, "start_positions\\[0\\] = -1 is negative"),
    ([0, 2], [7], [[3, 7]], 2, "past its block table of 2 blocks"),
    ([0, 2], [3], [[3, 0]], 2, "holds block id 0"),
])
def test_check_refuses_inconsistent_values(qsl, starts, bt, num_tokens, match):
    with pytest.raises(ValueError, match=match):
        slot_mapping(i32(bt), i32(qsl), i32(starts), block_size=4, num_tokens=num_tokens, check=True)


@pytest.mark.skipif(_runtime.INTERPRETED is False and torch.cuda.is_available(), reason="interpreter only")
def test_cpu_tensors_need_the_interpreter(monkeypatch):
    monkeypatch.setattr(_runtime, "INTERPRETED", False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET is off"):
        slot_mapping(torch.tensor([[3, 7]], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
                     torch.tensor([0], dtype=torch.int32), block_size=4, num_tokens=1)


# ------------------------------------------------------ real compile (no GPU)


def test_compiles_for_sm80_and_sm90_with_one_variant_per_layout():
    """The real Triton compiler (interpreter off, fresh cache), for the
    specialisations real launches get; batches of other sizes and token
    counts reuse them (per-step ints are not specialised)."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    from gpukv.kernels import slot_mapping as mod
    from tests.kernels import aot

    kernels = {"slot_mapping._slot_mapping_kernel": mod._slot_mapping_kernel}

    def launches(B: int, n: int):
        bt = torch.arange(1, 1 + B * 8, dtype=torch.int32, device=DEV).reshape(B, 8)
        qsl = torch.arange(0, (B + 1) * n, n, dtype=torch.int32, device=DEV)
        starts = torch.zeros(B, dtype=torch.int32, device=DEV)
        slot_mapping(bt, qsl, starts, block_size=16, num_tokens=B * n + 3, with_positions=True)
        slot_mapping(bt, qsl, starts, block_size=16, num_tokens=B * n)

    rec = aot.record(kernels, workloads=(("two batches", lambda: (launches(2, 5), launches(3, 7))),))
    sigs = rec.signatures()
    assert len(sigs) == 2, [s.describe() for s in sigs]  # WRITE_POS on and off, nothing per step
    again = aot.record(kernels, workloads=(("other counts", lambda: launches(5, 9)),))
    assert set(again.launches) <= set(rec.launches), [s.describe() for s in again.signatures()]
    results = aot.compile_all(sigs)
    failed = [f"{r.kernel} {r.target} {r.signature}\n{r.error}" for r in results if not r.ok]
    assert not failed, "\n\n".join(failed)
    assert len(results) == len(sigs) * len(aot.TARGETS)
