import pathlib
import sys

# Tests import the package from the checkout, installed or not.
ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import gpukv._runtime  # noqa: E402,F401  (Triton's interpreter on machines without CUDA)

SHARED = ROOT.parent / "shared"
