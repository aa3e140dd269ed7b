"""What vLLM's Model Runner V2 block-table code needs to run on CPU tensors
under Triton's interpreter (``TRITON_INTERPRET=1``, gpukv's CPU mode), each
shim the smallest that lets vLLM's own code and kernels run unchanged:

* vLLM's ``triton_utils`` hands out placeholders when Triton has no active
  GPU driver: the real ``triton`` and ``triton.language`` (the interpreter)
  in their place, before vLLM's worker modules define their kernels;
* no UVA and no pinned memory on a CPU: vLLM's own fallback for that
  (``NonUvaBuffer``: explicit copies, pinning off), on the platform's device
  type ``cpu`` (the unspecified platform has none).

``shimmed()`` applies them for the span of a ``with`` and gives back vLLM's
``BlockTables`` class, imported under them; with CUDA it applies none.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterator
from typing import Any

import pytest


@contextlib.contextmanager
def shimmed() -> Iterator[Any]:
    import torch

    if torch.cuda.is_available():  # (vLLM's own path: the real driver, UVA; nothing to shim)
        from vllm.v1.worker.gpu.block_table import BlockTables

        yield BlockTables
        return
    import triton
    import triton.language as tl
    import vllm.triton_utils as triton_utils
    import vllm.utils.torch_utils as torch_utils
    from vllm.platforms import current_platform

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(triton_utils, "triton", triton)
        mp.setattr(triton_utils, "tl", tl)
        mp.setattr(current_platform, "device_type", "cpu", raising=False)
        mp.setattr(torch_utils, "PIN_MEMORY", False)
        for name in ("vllm.v1.worker.gpu.buffer_utils", "vllm.v1.worker.gpu.block_table"):
            module = sys.modules.get(name)
            if module is not None and getattr(module, "triton", None) is not triton:
                importlib.reload(module)  # (imported before the shim, with placeholder kernels)
        from vllm.v1.worker.gpu import block_table, buffer_utils

        mp.setattr(buffer_utils, "is_uva_available", lambda: False)
        mp.setattr(buffer_utils, "is_pin_memory_available", lambda: False, raising=False)  # (0.34 reads it here)
        yield block_table.BlockTables
