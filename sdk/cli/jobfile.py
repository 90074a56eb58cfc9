"""Job files: a Python file defining ``job`` (a stagecoach.Job), the one convention of every command.

Optionally ``defaults``: a manual plan for `stagecoach train` (stages, replicas, micro_batches,
memory_mb), overridden by its options.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType

import click

from stagecoach.job import Job


def load_job_file(path: str) -> ModuleType:
    """Import a job file as a module; its code ships to the workers by value (cloudpickle)."""
    if not os.path.isfile(path):
        raise click.BadParameter(f"{path}: no such file", param_hint="FILE")
    name = "stagecoach_user_" + os.path.splitext(os.path.basename(path))[0].replace("-", "_")
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise click.BadParameter(f"{path}: not a Python file", param_hint="FILE")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    if not isinstance(getattr(module, "job", None), Job):
        raise click.BadParameter(f"{path} defines no `job` (a stagecoach.Job)", param_hint="FILE")
    return module
