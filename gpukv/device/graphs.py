"""CUDA-graph replay of the batched decode step and of the admission.

``DeviceManager.decode`` launches, for a batch bucket (rows padded to a
power of two, tokens per row, window releases per row), a fixed sequence of
kernels that read only the bucket's fixed device buffers and the pool: no
host-dependent branch, no allocation, no per-step scalar argument
(``tests/device/test_decode.py`` holds the sequence fixed on the CPU). So the
sequence can be captured once per bucket in a ``torch.cuda.CUDAGraph`` and
replayed every step, which turns seven launches into one (ten beside a
sliding window)::

    graphs = DecodeGraphs(manager)
    res = graphs.decode(rows, sampled_tokens)   # = manager.decode(...), replayed

The host part of the step stays as it is: the plan is computed on the host
and uploaded (pinned, non-blocking) into the bucket's buffers before the
replay, and the result comes from the host's mirror (or the one status read,
when the host cannot prove the batch fits). The first step of a bucket runs
eagerly (it also compiles the kernels) and then captures the graph. A
reallocation of the request rows (more requests than ``max_num_reqs``)
drops every graph (they hold the old tensors' addresses).

``AdmissionGraphs`` does the same for a step's admission (its launches also
read only the bucket's fixed buffers: the request count, token budget and
admission stamp are on the device), ``graphs.step(new=...)`` for
``manager.step(new=...)``. Neither has run on a GPU yet (no GPU was lent
to the sessions that wrote them); on the CPU the tests hold the launch
sequences a graph captures fixed per bucket.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from gpukv.core.requests import StepResult
from gpukv.errors import InvalidInputError

if TYPE_CHECKING:  # (the manager imports this module's users, not this module: typing only)
    from gpukv.device.manager import DeviceManager


class _BucketGraphs:
    """One captured CUDA graph per key (a bucket, and a part of the step) of
    a device manager on CUDA: the first launch of a key runs eagerly (and
    compiles every kernel), then is captured; later launches replay it.
    ``manager``: the device manager whose calls it wraps; the manager's
    ``decode`` or ``step`` hands ``run`` each launch, from inside that call."""

    def __init__(self, manager: DeviceManager) -> None:
        if getattr(manager, "device", torch.device("cpu")).type != "cuda":
            raise InvalidInputError("CUDA graphs need a device manager on a CUDA device", argument="manager",
                                    fix="call the manager directly on other devices")
        self.manager = manager
        self._graphs: dict[Any, torch.cuda.CUDAGraph] = {}
        self._generation = manager.rows_generation
        self.replays = 0
        self.captures = 0

    def run(self, key: Any, launch: Callable[[], None]) -> None:
        """Replay ``key``'s graph, or run ``launch`` (a fixed sequence of
        launches on fixed buffers: a decode bucket's every phase, on the
        buffers the running ``decode`` staged; an admission bucket's part)
        eagerly and capture it."""
        m = self.manager
        if m.rows_generation != self._generation:
            self._graphs.clear()
            self._generation = m.rows_generation
        graph = self._graphs.get(key)
        if graph is not None:
            graph.replay()
            self.replays += 1
            return
        launch()  # this step, eagerly (and every kernel compiled)
        # Capture records launches without running them, so the pool is not
        # changed a second time; the replays read the buffers the next steps stage.
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.cuda.graph(graph, stream=side):
            launch()
        torch.cuda.current_stream().wait_stream(side)
        self._graphs[key] = graph
        self.captures += 1


class DecodeGraphs(_BucketGraphs):
    """One captured decode graph per bucket of a device manager on CUDA."""

    def decode(self, rows, new_token_ids, *, num_tokens_to_compute=None, num_lookahead_tokens: int = 0) -> StepResult:
        """``manager.decode(rows, new_token_ids, ...)``, its kernels replayed
        (a chunk continuation or lookahead can need a bucket of its own: more
        new or cached blocks per row)."""
        return self.manager.decode(rows, new_token_ids, num_tokens_to_compute=num_tokens_to_compute,
                                   num_lookahead_tokens=num_lookahead_tokens, graphs=self)


class AdmissionGraphs(_BucketGraphs):
    """The admission's launches replayed as CUDA graphs: per
    admission bucket, two graphs, the rows' write and the lookup and
    admission (the host's extra-key digests go between them). Each
    admission round of a step (``DeviceManager._step``) replays them.
    Without KV-cache events only (their launches are not all Triton's):
    with events the step runs eagerly."""

    def step(self, finished=(), running=(), new=(), *, token_budget: int | None = None) -> StepResult:
        """``manager.step(...)``, its admission's kernels replayed."""
        return self.manager.step(finished, running, new, token_budget=token_budget, graphs=self)


def buckets(max_rows: int) -> list[int]:
    """The row buckets a batch of up to ``max_rows`` can fall in (powers of
    two from 8), e.g. to capture them all ahead of serving."""
    return [1 << p for p in range(3, max(3, int(np.ceil(np.log2(max(max_rows, 8))))) + 1)]
