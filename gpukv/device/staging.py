"""Host-to-device uploads without hidden synchronisation, and the counting
of what a step really cost (``gpukv.core.metrics.StepCounters``).

A copy from pageable host memory to the GPU makes the host wait until the copy
is done (the CUDA driver stages it through a pinned bounce buffer), so a step
that uploads its plan with ``torch.as_tensor(array, device="cuda")`` stalls
the host on the GPU each time. ``Staging`` copies host arrays into a pinned
buffer allocated once and issues ``non_blocking`` copies from it: the host
goes on at once. Two pinned buffers alternate between steps; before a buffer
is reused, the host waits on the event recorded after the step that last
used it (two steps ago, normally long finished), so a pending copy never
reads bytes the host has overwritten.

The rule that makes this hold: every upload belongs to a step with its event.
Steps are ``begin_step()`` ... ``end_step()`` (the manager's ``_counting``);
an upload made outside one (``DeviceManager.block_table_for`` between steps)
is a step of its own: it switches buffers, waiting on that buffer's event
first, and records an event after its copy. (Were such an upload to go into
the current buffer after the event of its step was recorded, two steps later
the host could overwrite bytes a lagging GPU had not copied yet, and the
attention kernels would read other requests' block tables.)

Without CUDA (Triton's interpreter on CPU tensors) an upload is a plain
tensor view of the array; it is counted all the same, so counts measured on
a CPU say what a GPU step would upload.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gpukv.core.metrics import StepCounters
from gpukv.kernels import capture

#: numpy's dtypes of the uploads the manager makes, as torch's (a dict look-up,
#: where asking torch builds a tensor every upload).
_TORCH_DTYPES = {np.dtype(np.int32): torch.int32, np.dtype(np.int64): torch.int64}


class Staging:
    """Uploads of int arrays through two alternating pinned buffers."""

    def __init__(self, device: torch.device, counters: StepCounters, nbytes: int = 1 << 16) -> None:
        self.device = device
        self.counters = counters
        self._pinned = device.type == "cuda"
        self._bufs = [self._alloc(nbytes), self._alloc(nbytes)]
        self._events: list = [None, None]
        self._cur = 0
        self._off = 0
        self._want = 0  # bytes a step needed that a buffer did not hold
        self._keep: list[torch.Tensor] = []  # one-off pinned tensors of this step
        self._open = False  # inside a step (``begin_step`` .. ``end_step``)
        # ``host_array``'s arrays: key -> (two host tensors, their numpy views)
        self._fixed: dict = {}
        self._sent: set = set()  # the keys ``upload_host`` sent in this step
        self._again: dict = {}  # key -> this step's second (or later) array of it: a staging region

    def _alloc(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._pinned)

    def begin_step(self) -> None:
        """Switch to the other buffer, once the step that last used it is done."""
        self._cur ^= 1
        event = self._events[self._cur]
        if event is not None:
            event.synchronize()
        if self._want > len(self._bufs[self._cur]):
            self._bufs[self._cur] = self._alloc(self._want)
        self._off = 0
        self._keep = []
        self._sent.clear()
        self._again.clear()
        self._open = True

    def end_step(self) -> None:
        """Record the event that frees this step's buffer (after every copy
        the step issued from it, on the current stream: the manager's)."""
        self._open = False
        if self._pinned:
            event = torch.cuda.Event()
            event.record()
            self._events[self._cur] = event

    @property
    def last_event(self) -> torch.cuda.Event | None:
        """The event recorded after the last step's copies (None without CUDA)."""
        return self._events[self._cur]

    def upload(self, array: np.ndarray, out: torch.Tensor | None = None) -> torch.Tensor:
        """``array`` on the device (into ``out`` when given: a fixed buffer
        of the same dtype and at least as many elements). Outside a step, the
        upload is a step of its own (the module docstring)."""
        if not self._open:
            self.begin_step()
            try:
                return self.upload(array, out)
            finally:
                self.end_step()
        self.counters.h2d += 1
        array = np.ascontiguousarray(array)
        if not self._pinned:
            src = torch.from_numpy(array)
            if out is None:
                return src.to(self.device)
            out.view(-1)[: src.numel()].copy_(src.view(-1))
            return out
        host = self._host_view(array)
        if out is None:
            out = torch.empty(host.shape, dtype=host.dtype, device=self.device)
            out.copy_(host, non_blocking=True)
            return out
        out.view(-1)[: host.numel()].copy_(host.view(-1), non_blocking=True)
        return out

    @property
    def parity(self) -> int:
        """Which of the two buffers (and ``host_array``'s arrays) this step uses."""
        return self._cur

    def host_array(self, key: object, size: int) -> np.ndarray:
        """This step's int32 host array for ``key`` (``size`` elements), to
        fill and then send with ``upload_host``. Two per key, kept between
        steps, alternate with the steps as the staging buffers do (pinned on
        CUDA, and the same step events guard them), so a pending copy never
        reads what the host writes: a plan written in place this way is sent
        with one copy, where ``upload`` would copy it into a staging buffer
        and build tensor views of it first, every step.

        A key this step sent already (an admission's or a gather's second
        round in one step) gets a region of this step's staging buffer
        instead, zeroed: its kept array may still be the source of that
        pending copy."""
        if not self._open:
            raise RuntimeError("Staging.host_array is for use inside a step (begin_step ... end_step)")
        if key in self._sent:
            again = self._again[key] = self._region(4 * size).view(torch.int32)
            array = again.numpy()
            array[:] = 0
            return array
        pair = self._fixed.get(key)
        if pair is None:
            tensors = tuple(self._alloc(4 * size).view(torch.int32).zero_() for _ in range(2))
            pair = self._fixed[key] = (tensors, tuple(t.numpy() for t in tensors))
        return pair[1][self._cur]

    def upload_host(self, key: object, out: torch.Tensor, count: int | None = None) -> None:
        """Copy this step's ``host_array(key)`` into ``out`` (a device buffer
        of its size), or only its first ``count`` elements (into ``out``'s
        first; ``out`` one-dimensional), without waiting. A key sent again in
        a step must have been asked of ``host_array`` again since (its
        caller wrote the new array, not the one a copy may still read)."""
        src = self._again.pop(key, None)
        if src is None:
            if key in self._sent:
                raise RuntimeError(f"Staging.upload_host: {key!r} was sent in this step already, and its array "
                                   "may still be the source of that copy: ask host_array for it again and write "
                                   "that one")
            src = self._fixed[key][0][self._cur]
        self.counters.h2d += 1
        self._sent.add(key)
        if count is None:
            out.copy_(src, non_blocking=True)
        else:
            out[:count].copy_(src[:count], non_blocking=True)

    def _region(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of this step's staging buffer (8-byte aligned; a one-off
        buffer, kept to the step's end, when the step outgrew it)."""
        start = -(-self._off // 8) * 8
        buf = self._bufs[self._cur]
        if start + nbytes > len(buf):  # this step outgrew the buffer: a one-off one now, a bigger one later
            self._want = max(self._want, 2 * (start + nbytes))
            region = self._alloc(nbytes)
            self._keep.append(region)
            return region
        self._off = start + nbytes
        return buf[start: start + nbytes]

    def _host_view(self, array: np.ndarray) -> torch.Tensor:
        dtype = _TORCH_DTYPES.get(array.dtype)
        if dtype is None:  # (any other dtype: torch names it)
            dtype = torch.from_numpy(array[:0].reshape(-1)).dtype
        if array.size == 0:
            return torch.empty(array.shape, dtype=dtype)
        region = self._region(array.nbytes)
        host = region.view(dtype).view(array.shape)
        host.numpy()[...] = array
        return host


#: The aten operations that launch no kernel on a GPU (views, reshapes,
#: aliases, detaching, and the scalar read of a host tensor), by their exact
#: names (a part of a name would take ``cat``, ``sort`` or ``sqrt`` for
#: ``t``, and ``index_select`` for ``select``).
_METADATA_OPS = frozenset({"view", "_unsafe_view", "slice", "select", "expand", "as_strided", "unsqueeze", "squeeze",
                           "reshape", "alias", "permute", "transpose", "t", "detach", "split", "split_with_sizes",
                           "unbind", "lift_fresh", "_local_scalar_dense"})


class TorchOpCounter(TorchDispatchMode):
    """Counts the torch kernels a step runs (``StepCounters.torch_ops``):
    every dispatched aten op but metadata-only ones (views, reshapes), and
    none inside a Triton kernel (``gpukv.kernels.capture.kernel_running``:
    the interpreter runs kernels through torch on the host)."""

    def __init__(self, counters: StepCounters) -> None:
        super().__init__()
        self.counters = counters

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not capture.in_kernel() and func.overloadpacket.__name__ not in _METADATA_OPS:
            self.counters.torch_ops += 1
        return func(*args, **(kwargs or {}))
