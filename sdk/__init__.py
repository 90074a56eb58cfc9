"""Stagecoach: pipelined, data-parallel PyTorch training on AWS Lambda, orchestrated by Step Functions.

    from stagecoach import Job
    run = Job(model=..., loss=..., optimizer=..., train=(x, y), global_batch=64, iterations=100).run(stages=2)
    run.wait(); model = run.trained_model()

Names are imported lazily so that ``import stagecoach`` stays cheap. Every exception Stagecoach
raises derives from ``StagecoachError``; ``JobError``, ``NotExact`` and ``PlanError`` refuse
a job or plan before anything is deployed, ``DeployError`` a stack that cannot take it,
``RunFailed`` a run that failed, ``InspectError`` a run that cannot be read back.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what type checkers see; at run time __getattr__ imports each name on first use
    from stagecoach.deploy.resources import DeployError
    from stagecoach.errors import StagecoachError
    from stagecoach.exactness import NotExact
    from stagecoach.inspect.report import InspectError
    from stagecoach.job import Job, JobError
    from stagecoach.lifecycle import attach, list_jobs, resume
    from stagecoach.planner.plan import Plan, PlanError
    from stagecoach.run import Run, RunFailed

__all__ = [
    "Job",
    "Run",
    "Plan",
    "StagecoachError",
    "JobError",
    "NotExact",
    "PlanError",
    "DeployError",
    "RunFailed",
    "InspectError",
    "attach",
    "resume",
    "list_jobs",
]
__version__ = "0.1.0"

_WHERE = {
    "Job": "stagecoach.job",
    "JobError": "stagecoach.job",
    "Run": "stagecoach.run",
    "RunFailed": "stagecoach.run",
    "Plan": "stagecoach.planner.plan",
    "StagecoachError": "stagecoach.errors",
    "NotExact": "stagecoach.exactness",
    "DeployError": "stagecoach.deploy.resources",
    "InspectError": "stagecoach.inspect.report",
    "PlanError": "stagecoach.planner.plan",
    "attach": "stagecoach.lifecycle",
    "resume": "stagecoach.lifecycle",
    "list_jobs": "stagecoach.lifecycle",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'stagecoach' has no attribute {name!r}")
