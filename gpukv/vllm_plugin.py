"""The vLLM releases gpukv's scheduler is tested with, and the start-up check
vLLM runs through its ``vllm.general_plugins`` entry point.

vLLM resolves ``--scheduler-cls`` only after it has loaded and profiled the
model; an untested vLLM would fail (or worse, misbehave) only then. vLLM
runs every ``vllm.general_plugins`` entry point at start-up in each of its
processes, the API server's argument parsing first, so gpukv's (``plugin``)
checks the installed vLLM there, before any model is loaded, when gpukv's
scheduler is the one configured: ``--scheduler-cls gpukv.…`` on the command
line, or ``GPUKV_VLLM_CHECK=1`` in the environment (the Python API, where
``from gpukv.vllm import AsyncScheduler`` makes the same check at import).
With any other scheduler the plugin does nothing.

The check: the installed release is one of ``TESTED_VLLM`` (else
``UntestedVllmError``, naming the tested releases and the command that
installs one), unless ``GPUKV_ALLOW_UNTESTED_VLLM=1`` opts in; either way
the adapter's conformance check (``gpukv.vllm.v0_33.conformance``) then
compares what that vLLM asks of its block manager with what gpukv answers.

This module imports neither torch nor vLLM until a check is due.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

from gpukv.errors import GpukvError

TESTED_VLLM: dict[str, str] = {
    "0.8.5": "gpukv.vllm.Scheduler",
    "0.8.5.post1": "gpukv.vllm.Scheduler",
    "0.33.0": "gpukv.vllm.AsyncScheduler",
    "0.34.0": "gpukv.vllm.AsyncScheduler",
}
"""Each vLLM release gpukv's tests run against, with the scheduler class to name."""

CURRENT_VLLM = "0.34.0"
"""The newest tested release: what a new server installs."""

ALLOW_UNTESTED_ENV = "GPUKV_ALLOW_UNTESTED_VLLM"
CHECK_ENV = "GPUKV_VLLM_CHECK"


class UntestedVllmError(GpukvError, ImportError):
    """The installed vLLM is not one gpukv's scheduler is tested with."""


def release(version: str) -> str:
    """A vLLM version without its local part (``0.34.0+cu130`` is ``0.34.0``)."""
    return version.split("+", 1)[0]


def install_hint() -> str:
    return (f"on a GPU server, from a gpukv clone: `pip install vllm=={CURRENT_VLLM}` then `pip install -e .` "
            f"(or `pip install -e '.[vllm]'`, which pins vLLM {CURRENT_VLLM})")


def check_vllm_version(version: str, environ: Mapping[str, str] = os.environ) -> None:
    """Refuse an untested vLLM ``version`` (``UntestedVllmError``), unless
    ``GPUKV_ALLOW_UNTESTED_VLLM=1`` is set."""
    if release(version) in TESTED_VLLM or environ.get(ALLOW_UNTESTED_ENV) == "1":
        return
    tested = ", ".join(TESTED_VLLM)
    raise UntestedVllmError(
        f"gpukv's vLLM scheduler is tested with vLLM {tested}; found vLLM {version}", argument="vllm",
        fix=f"{install_hint()}; or set {ALLOW_UNTESTED_ENV}=1 to try this release anyway (gpukv still refuses, "
            "at start-up, any manager call, parameter or request field it does not know)")


def has_async_scheduler() -> bool:
    """The installed vLLM's API generation, read from what it offers: from 0.33
    on (0.33, 0.34) it has an ``AsyncScheduler``; 0.8.5 has not. (Finding the
    module imports vLLM's package, not the scheduler.)"""
    import importlib.util

    return importlib.util.find_spec("vllm.v1.core.sched.async_scheduler") is not None


def names_gpukv_scheduler(argv: Sequence[str]) -> bool:
    """Whether a vLLM command line names one of gpukv's scheduler classes."""
    for i, arg in enumerate(argv):
        flag, _, value = arg.partition("=")
        if flag.replace("_", "-") != "--scheduler-cls":
            continue
        if not value and i + 1 < len(argv):
            value = argv[i + 1]
        if value.startswith("gpukv."):
            return True
    return False


def plugin() -> None:
    """vLLM's ``vllm.general_plugins`` entry point (it takes no arguments):
    when gpukv's scheduler is configured, check the installed vLLM now, before
    the model loads (the version, then the adapter's conformance)."""
    if os.environ.get(CHECK_ENV) != "1" and not names_gpukv_scheduler(sys.argv):
        return
    from importlib.metadata import version

    check_vllm_version(version("vllm"))
    import gpukv.vllm  # noqa: F401  (picks the adapter by what vLLM offers and checks its conformance)
