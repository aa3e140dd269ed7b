"""What every call of the device manager runs in: its stream ordering, its
one way to read the device, and its step accounting.

``CallContext`` is mixed into ``DeviceManager`` (not a part it holds): its
methods are the ``gpukv.core.failstop`` hooks every public call runs
(``_enter_stream`` / ``_leave_stream``), and they stay one attribute lookup
away, as they were, on the decode's host budget. Streams (the manager
module's docstring, "Streams"): a call made on another CUDA stream than the
manager's own runs on the manager's stream without waiting for the caller's
work, except for device tensors the caller hands over (``_wait_for_caller``);
the caller's stream then waits for the manager's (the tables it reads);
without CUDA nothing is done.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from gpukv.device.staging import StepCounters, TorchOpCounter
from gpukv.device.state import DeviceCalls, DeviceState
from gpukv.kernels import capture

if TYPE_CHECKING:
    from gpukv.device.reads import DeviceReads


def on_device(values: list) -> list[torch.Tensor]:
    """The CUDA tensors among ``values`` (tokens a caller left on its device)."""
    return [v for v in values if isinstance(v, torch.Tensor) and v.device.type == "cuda"]


class StepAccounting:
    """``CallContext._counting``'s context: a plain class, not a generator
    (it wraps every step, and a generator-based context manager costs a few
    microseconds of the decode's host budget). ``lookup``: a call that
    changes no block (a lookup): the free count stays as the host's mirror
    of it has it, so the mirror is not copied again (a torch operation)."""

    __slots__ = ("s", "base", "torch_ops", "lookup")

    def __init__(self, state: DeviceState, lookup: bool = False) -> None:
        self.s = state
        self.lookup = lookup

    def __enter__(self) -> None:
        s = self.s
        s.counting_depth += 1
        if s.counting_depth > 1:
            return
        c = s.counters
        c.h2d = c.d2h = c.torch_ops = 0
        if not self.lookup:
            s.mirror.fresh = False  # the step may change the free count
        self.base = capture.launches()
        s.staging.begin_step()
        self.torch_ops = TorchOpCounter(c) if c.count_torch_ops else None
        if self.torch_ops is not None:
            self.torch_ops.__enter__()

    def __exit__(self, *exc: Any) -> None:
        s = self.s
        s.counting_depth -= 1
        if s.counting_depth > 0:
            return
        if self.torch_ops is not None:
            self.torch_ops.__exit__(*exc)
        c = s.counters
        c.launches = capture.launches() - self.base
        c.steps += 1
        refresh = exc[0] is None and not self.lookup
        if refresh:
            s.mirror.refresh()  # (before end_step: the step's event covers the copy)
        s.staging.end_step()
        if refresh:
            s.mirror.event = s.staging.last_event


class OwnStream:
    """The manager's construction on its own stream (``stream``; None
    without CUDA: nothing is done): its state is allocated and zeroed there,
    and the constructing stream then waits for that work (on the device), as
    it may read the tables before any call."""

    __slots__ = ("stream", "device", "switch")

    def __init__(self, stream: Any, device: torch.device) -> None:
        self.stream, self.device = stream, device

    def __enter__(self) -> None:
        if self.stream is not None:
            self.switch = torch.cuda.stream(self.stream)
            self.switch.__enter__()

    def __exit__(self, *exc: Any) -> None:
        if self.stream is not None:
            self.switch.__exit__(*exc)
            torch.cuda.current_stream(self.device).wait_stream(self.stream)


class CallContext:
    """Mixin of ``DeviceManager``: ``_stream`` (None without CUDA),
    ``device``, ``counters``, ``_shared``, ``_calls`` and ``_reads`` are the
    manager's."""

    _stream: Any
    device: torch.device
    counters: StepCounters
    _shared: DeviceState
    _calls: DeviceCalls
    _reads: DeviceReads
    #: The stream of the call under way when it came from another stream than the manager's (else None).
    _caller_stream: Any = None

    def _counting(self, lookup: bool = False) -> StepAccounting:
        """One step's accounting (``counters``) and staging buffer; nested
        calls (a lookup inside an admission) count in the outer step.
        ``lookup``: the call changes no block (``StepAccounting``)."""
        return StepAccounting(self._shared, lookup)

    @property
    def _read(self) -> Callable[[torch.Tensor], list]:
        """The read every part runs (``DeviceCalls.read``, ``_read_device``
        unless replaced): one slot, so a wrapper set here (a test's count of
        reads, a benchmark's record of them) reaches every part's read."""
        return self._calls.read

    @_read.setter
    def _read(self, read: Callable[[torch.Tensor], list]) -> None:
        self._calls.read = read

    def _read_device(self, t: torch.Tensor) -> list:
        """A device-to-host read (counted: ``counters.d2h`` in the step,
        ``counters.reads`` since construction), on the manager's stream: the
        host waits for the manager's own work, never for the caller's
        (``read_num_free_blocks`` and the like are not wrapped calls). Every
        read of the parts comes here (``_read``)."""
        counters = self.counters
        counters.d2h += 1
        counters.reads += 1
        entered = self._enter_stream()
        try:
            return t.cpu().tolist()
        finally:
            if entered is not None:
                self._leave_stream(entered, None)

    def _num_unheld(self, block_ids: list[int]) -> int:
        """``read_num_unheld``'s one read (``gpukv.core.manager_base``'s hook)."""
        return self._reads.num_unheld(block_ids)

    def _enter_stream(self) -> tuple | None:
        """Run a call made on another stream than the manager's on the
        manager's, without waiting for the caller's work (its model's
        forward): only the device tensors the call takes from the caller are
        waited for (``_wait_for_caller``). None (nothing to undo) without
        CUDA, or when the caller is on the manager's stream (a nested call
        always is)."""
        own = self._stream
        if own is None:
            return None
        caller = torch.cuda.current_stream(self.device)
        if caller == own:
            return None
        switch = torch.cuda.stream(own)
        switch.__enter__()
        self._caller_stream = caller
        return caller, switch

    def _wait_for_caller(self, values: list) -> None:
        """The CUDA tensors among ``values``, token containers a call takes
        from its caller (tokens a model runner sampled): the manager's stream
        waits on an event recorded on the caller's stream now (its work
        queued so far, not what it queues later), and each tensor is marked
        used on the manager's stream (the allocator then keeps its memory
        until the manager's kernels read it). Nothing when the call runs on
        the manager's own stream, or takes no such tensor."""
        caller = self._caller_stream
        tensors = on_device(values) if caller is not None else ()
        if not tensors:
            return
        own = self._stream
        own.wait_stream(caller)
        for t in tensors:
            t.record_stream(own)

    def _ordered(self, step: Any) -> Any:
        """A normalised ``Step`` whose tokens, when left on the caller's
        device, are ordered after the caller's stream (``_wait_for_caller``)."""
        if self._caller_stream is not None:
            self._wait_for_caller([r.token_ids for r in step.new] + [u.new_token_ids for u in step.running])
        return step

    def _normalize_running(self, batch: Any, finished_rows: Any = ()) -> Any:
        """A ``RunningBatch`` checked (``SharedManagerAPI``'s); its tokens,
        when left on the caller's device, ordered after the caller's stream."""
        run = super()._normalize_running(batch, finished_rows)  # type: ignore[misc]
        if self._caller_stream is not None:
            self._wait_for_caller([run.tokens])
        return run

    def _leave_stream(self, entered: tuple, out: Any) -> None:
        """Back on the caller's stream, which waits for the manager's work (a
        wait on the device, not on the host: the caller's next kernels read
        the block tables the call wrote); a device tensor the call returns is
        marked used there (the allocator then does not hand its memory to
        the manager's stream while the caller's kernels may still read it)."""
        caller, switch = entered
        switch.__exit__(None, None, None)
        self._caller_stream = None
        caller.wait_stream(self._stream)
        if isinstance(out, torch.Tensor) and out.device.type == "cuda":
            out.record_stream(caller)
