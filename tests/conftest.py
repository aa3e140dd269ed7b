import os
import pathlib
import sys

import pytest

# Tests import the package from the checkout, installed or not.
ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import gpukv._runtime  # noqa: E402,F401  (Triton's interpreter on machines without CUDA)

SHARED = ROOT.parent / "shared"

#: ``GPUKV_PROGRAM_ORDER=reverse`` (or ``shuffle``, ``shuffle:SEED``) runs every
#: test with each launch's programs out of the interpreter's order and small
#: tiles (``tests/program_order.py``; docs/fuzzing.md). A test module that sets
#: ``OWN_PROGRAM_ORDER = True`` chooses its orders itself.
PROGRAM_ORDER = os.environ.get("GPUKV_PROGRAM_ORDER", "")


@pytest.fixture(autouse=True)
def _program_order_from_env(request):
    if not PROGRAM_ORDER or getattr(request.module, "OWN_PROGRAM_ORDER", False):
        yield
        return
    from program_order import from_env, program_order

    order, seed = from_env(PROGRAM_ORDER)
    with program_order(order, seed):
        yield
