"""CUDA-graph replay of the batched decode step.

``DeviceManager.decode`` launches, for a batch bucket (rows padded to a
power of two, tokens per row, window releases per row), a fixed sequence of
kernels that read only the bucket's fixed device buffers and the pool: no
host-dependent branch, no allocation, no per-step scalar argument
(``tests/test_decode.py`` holds the sequence fixed on the CPU). So the
sequence can be captured once per bucket in a ``torch.cuda.CUDAGraph`` and
replayed every step, which turns about ten launches into one::

    graphs = DecodeGraphs(manager)
    res = graphs.decode(rows, sampled_tokens)   # = manager.decode(...), replayed

The host part of the step stays as it is: the plan is computed on the host
and uploaded (pinned, non-blocking) into the bucket's buffers before the
replay, and the result comes from the host's mirror (or the one status read,
when the host cannot prove the batch fits). The first step of a bucket runs
eagerly (it also compiles the kernels) and then captures the graph. A
reallocation of the request rows (more requests than ``max_num_reqs``)
drops every graph (they hold the old tensors' addresses).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from gpukv.errors import InvalidInputError
from gpukv.request import StepResult


class DecodeGraphs:
    """One captured decode graph per bucket of a device manager on CUDA."""

    def __init__(self, manager: Any) -> None:
        if getattr(manager, "device", torch.device("cpu")).type != "cuda":
            raise InvalidInputError("CUDA graphs need a device manager on a CUDA device", argument="manager",
                                    fix="call manager.decode(rows, tokens) directly on other devices")
        self.manager = manager
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._generation = manager.rows_generation
        self.replays = 0
        self.captures = 0

    def decode(self, rows, new_token_ids, *, num_tokens_to_compute=None, num_lookahead_tokens: int = 0) -> StepResult:
        """``manager.decode(rows, new_token_ids, ...)``, its kernels replayed
        (a chunk continuation or lookahead can need a bucket of its own: more
        new or cached blocks per row)."""
        return self.manager.decode(rows, new_token_ids, num_tokens_to_compute=num_tokens_to_compute,
                                   num_lookahead_tokens=num_lookahead_tokens, graphs=self)

    def launch(self, bucket: tuple, bufs: Any) -> None:
        """Called by ``manager.decode`` with the plan staged in ``bufs``."""
        m = self.manager
        if m.rows_generation != self._generation:
            self._graphs.clear()
            self._generation = m.rows_generation
        graph = self._graphs.get(bucket)
        if graph is not None:
            graph.replay()
            self.replays += 1
            return
        m.launch_decode(bucket, bufs)  # this step, eagerly (and every kernel compiled)
        # Capture records launches without running them, so the pool is not
        # changed a second time; the replays read the buffers the next steps stage.
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.cuda.graph(graph, stream=side):
            m.launch_decode(bucket, bufs)
        torch.cuda.current_stream().wait_stream(side)
        self._graphs[bucket] = graph
        self.captures += 1


def buckets(max_rows: int) -> list[int]:
    """The row buckets a batch of up to ``max_rows`` can fall in (powers of
    two from 8), e.g. to capture them all ahead of serving."""
    return [1 << p for p in range(3, max(3, int(np.ceil(np.log2(max(max_rows, 8))))) + 1)]
