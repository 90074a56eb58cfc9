"""One exception base for everything Stagecoach raises, so a caller can catch all of it at once.

    try:
        run = job.run(stages=2)
        run.wait()
    except stagecoach.JobError as e:      # refused before anything was deployed: e says what to change
        ...
    except stagecoach.StagecoachError:    # anything else Stagecoach raised (deploy, run, inspect, ...)
        ...

The subclasses users catch keep the built-in base they always had (``JobError`` and ``PlanError``
are ``ValueError``s, ``RunFailed`` and ``DeployError`` ``RuntimeError``s), so existing ``except``
clauses still match; each is defined beside the code that raises it and exported from ``stagecoach``.
This module imports nothing: every layer, the planner and the workers included, may derive from it.
"""

from __future__ import annotations

__all__ = ["StagecoachError"]


class StagecoachError(Exception):
    """The base of every exception Stagecoach raises on purpose."""
