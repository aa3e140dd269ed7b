"""The order between gpukv's writes to its block tables and the model
runner's reads of them, under async scheduling (``gpukv.vllm.Worker``).

The runner reads gpukv's tables in two kernels only, ``prepare_attn``'s
gather (into vLLM's own ``input_block_tables``) and slot mapping (into its
``slot_mappings``); the forward then reads those copies, never gpukv's
tables. With async scheduling, step N+1's ``schedule()`` (and step N's
``update_from_output``, which frees finished requests' rows and blocks) run
on the host while forward N is queued on the GPU, and gpukv writes the
tables on its own stream. Hence the rule, per step:

* before the gather of step N, the runner's stream waits on an event
  recorded on gpukv's stream (``before_read``): the tables schedule N wrote
  are complete;
* right after the slot mapping of step N, the runner records an event on its
  stream and gpukv's stream waits on it (``after_read``): every write gpukv
  enqueues later (a row or block freed at update N and handed out again at
  schedule N+1) runs after step N's reads of the tables.

A freed block's KV contents are written only by a later forward, queued
after forward N on the runner's stream, so the tables are all that needs the
rule. Without CUDA (``stream`` None) there are no streams and nothing is
done. The stream calls go through ``StreamOps`` so a test can record them.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["StreamOps", "TableOrdering"]


class StreamOps:
    """CUDA's stream calls, as the ordering makes them."""

    def current_stream(self) -> Any:
        return torch.cuda.current_stream()

    def new_event(self) -> Any:
        return torch.cuda.Event()


class TableOrdering:
    """The module docstring's rule between gpukv's stream and the runner's
    (the stream current when ``prepare_attn`` runs)."""

    def __init__(self, gpukv_stream: Any, ops: StreamOps | None = None) -> None:
        self.gpukv_stream = gpukv_stream
        self.ops = ops or StreamOps()

    def before_read(self) -> None:
        """The runner's stream waits for the tables gpukv has written so far."""
        if self.gpukv_stream is None:
            return
        written = self.ops.new_event()
        written.record(self.gpukv_stream)
        self.ops.current_stream().wait_event(written)

    def after_read(self) -> None:
        """gpukv's later writes wait for the runner's reads of this step."""
        if self.gpukv_stream is None:
            return
        read = self.ops.new_event()
        read.record(self.ops.current_stream())
        self.gpukv_stream.wait_event(read)
