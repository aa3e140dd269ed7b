"""A script of ``benchmarks/`` loaded as a module, for the tests that run its
``--quick`` smoke run in process (the scripts are not a package)."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
from types import ModuleType

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/NAME.py`` as the module ``NAME``."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module
