"""Fixtures of the planner tests: the benchmark scripts whose tables they check, loaded as modules
(benchmarks/ is no package: its scripts run as ``python benchmarks/X.py``)."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(script: str, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / script)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def tables() -> ModuleType:
    return _load("paper_tables.py", "paper_tables")


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return _load("cost.py", "cost_benchmark")
