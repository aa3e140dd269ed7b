"""Memory probing: what a device (or the host) can still allocate, and the
refusal of an allocation that would not fit, before it is tried.
"""

from __future__ import annotations

import contextlib
import os

import torch

from gpukv.errors import CapacityError


def available_memory(device: torch.device | None) -> int | None:
    """Bytes that can still be allocated on ``device`` (host memory for the
    CPU or None), or None when it cannot be told."""
    if device is not None and device.type == "cuda":
        try:
            return int(torch.cuda.mem_get_info(device)[0])
        except Exception:  # noqa: BLE001 - no answer is not an error here
            return None
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:  # (no /proc: sysconf below)
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_memory(needed: dict[str, int], device: torch.device | None, what: str, also: str = "") -> None:
    """Raise a ``CapacityError`` before allocating when the parts of
    ``needed`` (argument name -> bytes it costs) add up to more than
    ``device`` (None: host memory) has free. Names the largest part."""
    total = sum(needed.values())
    free = available_memory(device)
    if free is None or total <= free:
        return
    biggest = max(needed, key=lambda k: needed[k])
    parts = ", ".join(f"{k}: {v / 2**30:.2f} GiB" for k, v in needed.items())
    raise CapacityError(f"{what} needs about {total / 2**30:.2f} GiB on {device or 'the host'} ({parts}), but only "
                        f"{free / 2**30:.2f} GiB are available", argument=biggest,
                        fix=f"lower {', '.join([*needed, also] if also else needed)} (the largest part is {biggest})")
