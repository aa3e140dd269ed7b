"""Where the kernels run.

Triton compiles kernels for CUDA devices. On a machine without CUDA the same
kernels run on CPU tensors under Triton's interpreter, which must be switched on
(``TRITON_INTERPRET=1``) before ``triton`` is first imported. Importing this
module does that, so gpukv works the same on a laptop, in CI and on a GPU box:
every gpukv module that imports triton imports this one first, and so does
each public name of ``gpukv`` whose module imports torch (``import gpukv``
alone imports neither). Code that imports triton itself before any
of gpukv's kernels imports this module first. A caller that has set
``TRITON_INTERPRET`` itself keeps its choice.
"""

from __future__ import annotations

import os
import sys

import torch

CUDA_AVAILABLE: bool = torch.cuda.is_available()

if not CUDA_AVAILABLE and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRETED: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"


def default_device() -> torch.device:
    """The device a pool lives on when the caller names none: CUDA if present."""
    return torch.device("cuda") if CUDA_AVAILABLE else torch.device("cpu")
