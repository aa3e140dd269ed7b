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
#: tiles (``tests/helpers/program_order.py``; docs/fuzzing.md). A test module that sets
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


#: The suite's longest tests (seconds on this project's 2-core CI machine, from
#: ``pytest --durations``), started first: pytest-xdist hands tests out in
#: collection order, and one of these collected last kept a worker busy long
#: after the other had run out of tests. Only the order changes. (tests/kernels/
#: test_compile.py stays where it is: its module fixture costs a minute per worker.)
LONGEST_FIRST = (
    "tests/differential/test_state_machine.py::test_fuzz_device_against_reference",  # 114 s, 73 s
    "tests/tools/test_replay.py::test_whole_mooncake_trace_hit_rate_with_512_token_blocks",  # 81 s
    "tests/core/test_failstop.py::test_the_workload_launches_every_kernel_but_the_known_few",  # 61 s
    "tests/test_vllm/test_vllm_chunked.py::test_random_chunked_sequences_match_vllm_on_the_device",  # 49 s
    "tests/test_vllm/test_differential.py::test_same_scheduler_output_as_vllm_on_the_device_manager",  # 47 s, 22 s
    "tests/device/test_manager.py::test_random_workloads_match_the_reference_step_by_step",  # 35 s
    "tests/benchmarks/test_bench_scheduler.py::test_what_a_step_pays_does_not_grow_with_the_requests",  # 22 s
    "tests/differential/test_adversarial.py::test_no_false_hit_on_the_device",  # 22 s
)


def _rank(nodeid: str) -> int:
    return next((i for i, prefix in enumerate(LONGEST_FIRST) if nodeid.startswith(prefix)), len(LONGEST_FIRST))


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: _rank(item.nodeid))  # stable: the rest keep their order
