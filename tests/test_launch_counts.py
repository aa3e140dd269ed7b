"""How many kernels, uploads and reads each kind of device step costs (issue 20).

On a GPU every Triton launch costs host time in Triton's launcher (argument
binding, the specialisation key, the driver call), whatever the kernel does,
so the launch count of a step is part of its host cost. These are the counts
``docs/performance.md`` states, per workload; a change that raises one fails
here (and one that lowers one updates the table and this file together).
"""

from __future__ import annotations

import pytest

from gpukv.manager import DeviceManager
from gpukv.request import NewRequest, RunningUpdate

SHARED = list(range(128))

# (launches, uploads, reads) per step, for full attention and for full
# attention beside a sliding window (the decode releases behind the window).
EXPECTED = {
    "full": {"admit": (19, 1, 1), "decode": (10, 2, 0), "append": (0, 3, 0), "finish": (3, 1, 0)},
    "window": {"admit": (19, 1, 1), "decode": (13, 2, 0), "append": (0, 3, 0), "finish": (3, 1, 0)},
}
WINDOWS = {"full": [None], "window": [None, 32]}


def counts(m: DeviceManager) -> tuple[int, int, int]:
    c = m.counters
    return c.launches, c.h2d, c.d2h


@pytest.mark.parametrize("layout", list(EXPECTED))
def test_launches_per_step_do_not_grow_with_the_batch(layout):
    m = DeviceManager(4096, 16, sliding_windows=WINDOWS[layout], hash_key=bytes(16), max_model_len=4096)
    want = EXPECTED[layout]
    for k in (1, 16):  # an admission of 1 and of 16 requests sharing a prefix: the same launches
        new = [NewRequest(f"p{k}-{i}", SHARED + list(range(1000 + 300 * i, 1128 + 300 * i))) for i in range(k)]
        assert m.step(new=new).num_admitted == k
        assert counts(m) == want["admit"], ("admit", k)
    rows = [m.row_of(r) for r in m.request_ids()]
    for _ in range(2):  # the first decode of a bucket prepares its launches, later ones replay them
        assert m.decode(rows, [[5]] * len(rows)).ok
        assert counts(m) == want["decode"], "decode"
    # One token that needs no new block: its row is written, nothing is launched or read.
    assert m.step(running=[RunningUpdate(m.request_ids()[0], [7])]).ok
    assert counts(m) == want["append"], "append"
    m.step(finished=[m.request_ids()[0]])
    assert counts(m) == want["finish"], "finish"
