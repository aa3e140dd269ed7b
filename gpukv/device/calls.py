"""What every call of the device manager runs in: its stream ordering, its
one way to read the device, and its step accounting.

``CallContext`` is mixed into ``DeviceManager`` (not a part it holds): its
methods are the ``gpukv.failstop`` hooks every public call runs
(``_enter_stream`` / ``_leave_stream``), and they stay one attribute lookup
away, as they were, on the decode's host budget. Streams (the manager
module's docstring, "Streams"): a call made on another CUDA stream than the
manager's waits for the caller's work, runs on the manager's stream, and the
caller's stream then waits for the manager's; without CUDA nothing is done.
"""

from __future__ import annotations

from typing import Any

import torch

from gpukv.kernels import _common
from gpukv.staging import TorchOpCounter


class StepAccounting:
    """``CallContext._counting``'s context: a plain class, not a generator
    (it wraps every step, and a generator-based context manager costs a few
    microseconds of the decode's host budget)."""

    __slots__ = ("m", "base", "torch_ops")

    def __init__(self, manager: Any) -> None:
        self.m = manager

    def __enter__(self) -> None:
        m = self.m
        m._counting_depth += 1
        if m._counting_depth > 1:
            return
        c = m.counters
        c.h2d = c.d2h = c.torch_ops = 0
        self.base = _common.launches()
        m._staging.begin_step()
        self.torch_ops = TorchOpCounter(c) if c.count_torch_ops else None
        if self.torch_ops is not None:
            self.torch_ops.__enter__()

    def __exit__(self, *exc: Any) -> None:
        m = self.m
        m._counting_depth -= 1
        if m._counting_depth > 0:
            return
        if self.torch_ops is not None:
            self.torch_ops.__exit__(*exc)
        c = m.counters
        c.launches = _common.launches() - self.base
        c.steps += 1
        m._staging.end_step()


class CallContext:
    """Mixin of ``DeviceManager``: ``_stream`` (None without CUDA),
    ``device``, ``counters``, ``_staging`` and ``_counting_depth`` are the
    manager's."""

    _stream: Any
    device: torch.device
    counters: Any

    def _counting(self) -> StepAccounting:
        """One step's accounting (``counters``) and staging buffer; nested
        calls (a lookup inside an admission) count in the outer step."""
        return StepAccounting(self)

    def _read(self, t: torch.Tensor) -> list:
        """A device-to-host read (counted): the host waits for the GPU (on the
        manager's stream: ``read_num_free_blocks`` and the like are not
        wrapped calls). Every read of the parts comes here."""
        self.counters.d2h += 1
        entered = self._enter_stream()
        try:
            return t.cpu().tolist()
        finally:
            if entered is not None:
                self._leave_stream(entered, None)

    def _enter_stream(self) -> tuple | None:
        """Order a call made on another stream than the manager's: the
        manager's stream waits for the caller's, and the call runs on the
        manager's. None (nothing to undo) without CUDA, or when the caller is
        on the manager's stream (a nested call always is)."""
        own = self._stream
        if own is None:
            return None
        caller = torch.cuda.current_stream(self.device)
        if caller == own:
            return None
        own.wait_stream(caller)
        switch = torch.cuda.stream(own)
        switch.__enter__()
        return caller, switch

    def _leave_stream(self, entered: tuple, out: Any) -> None:
        """Back on the caller's stream, which waits for the manager's; a
        device tensor the call returns is marked used there (the allocator
        then does not hand its memory to the manager's stream while the
        caller's kernels may still read it)."""
        caller, switch = entered
        switch.__exit__(None, None, None)
        caller.wait_stream(self._stream)
        if isinstance(out, torch.Tensor) and out.device.type == "cuda":
            out.record_stream(caller)
