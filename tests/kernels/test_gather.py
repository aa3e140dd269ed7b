"""The step-output gather (``gpukv.kernels.gather``): hand-worked exact
values, padding, several programs against plain indexing, and bad inputs."""

from __future__ import annotations

import pytest
import torch

from gpukv import _runtime
from gpukv.kernels.gather import gather_blocks

DEV = _runtime.default_device()


def i32(x):
    return torch.tensor(x, dtype=torch.int32, device=DEV)


def test_hand_worked_entries_and_padding():
    # Two groups, two rows, three positions; block b has b + 10 references.
    table = i32([[[4, 5, 6], [7, 8, 0]],
                 [[1, 2, 3], [9, 0, 0]]])
    ref_cnt = i32([b + 10 for b in range(10)])
    entries = i32([[0, 1, 0, 1, 0, 0],     # group
                   [1, 0, 0, 1, -1, -1],   # row (-1: padding)
                   [1, 2, 0, 0, 0, 2]])    # position
    out = torch.full((2, 6), -7, dtype=torch.int64, device=DEV)
    gather_blocks(entries, table, ref_cnt, out)
    assert out.tolist() == [[8, 3, 4, 9, 0, 0], [18, 13, 14, 19, 0, 0]]


def test_several_programs_match_plain_indexing():
    g = torch.Generator().manual_seed(3)
    table = torch.randint(0, 500, (2, 9, 40), generator=g, dtype=torch.int32).to(DEV)
    view = table[:, :, :33]  # a strided view: the row stride is 40, not 33
    ref_cnt = torch.randint(0, 50, (500,), generator=g, dtype=torch.int32).to(DEV)
    E = 600  # three programs of 256
    grp = torch.randint(0, 2, (E,), generator=g)
    row = torch.randint(0, 9, (E,), generator=g)
    pos = torch.randint(0, 33, (E,), generator=g)
    row[::7] = -1
    entries = torch.stack([grp, row, pos]).to(torch.int32).to(DEV)
    out = torch.empty((2, E), dtype=torch.int64, device=DEV)
    gather_blocks(entries, view, ref_cnt, out)
    real = row >= 0
    want = torch.zeros(E, dtype=torch.int64)
    want[real] = view.cpu()[grp[real], row[real], pos[real]].long()
    assert out[0].tolist() == want.tolist()
    counts = torch.where(real, ref_cnt.cpu().long()[want], torch.zeros_like(want))
    assert out[1].tolist() == counts.tolist()


@pytest.mark.parametrize("bad, message", [
    (dict(entries=torch.zeros((2, 4), dtype=torch.int32)), "entries must have shape"),
    (dict(entries=torch.zeros((3, 4), dtype=torch.int64)), "entries must be torch.int32"),
    (dict(out=torch.zeros((2, 5), dtype=torch.int64)), "out must have shape"),
    (dict(table=torch.zeros((1, 2, 4), dtype=torch.int32)[:, :, ::2]), "positions must be contiguous"),
])
def test_bad_inputs_are_refused(bad, message):
    args = dict(entries=torch.zeros((3, 4), dtype=torch.int32), table=torch.zeros((1, 2, 4), dtype=torch.int32),
                ref_cnt=torch.zeros(4, dtype=torch.int32), out=torch.zeros((2, 4), dtype=torch.int64))
    args.update(bad)
    with pytest.raises(ValueError, match=message):
        gather_blocks(*(args[k].to(DEV) for k in ("entries", "table", "ref_cnt", "out")))
