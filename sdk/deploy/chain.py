"""A job's executions: the job state machine continues as a new execution every
``windowsPerExecution`` windows (planner/emit/asl.py job_definition), so a job is a chain of
executions ``{job}``, ``{job}-c1``, ``{job}-c2``, ...; each link that continued ends SUCCEEDED
with output ``{"continuedAs": <next ARN>}``. Readers follow the chain to its latest link.
"""

from __future__ import annotations

import json
from typing import Any

from stagecoach.deploy.resources import BotoClient


def continued_as(description: dict[str, Any]) -> str | None:
    """The next link's ARN if this execution ended by continuing as a new one."""
    if description.get("status") != "SUCCEEDED":
        return None
    try:
        nxt = json.loads(description.get("output") or "{}").get("continuedAs")
    except (ValueError, AttributeError):
        return None
    return nxt if isinstance(nxt, str) else None


def follow(sfn: BotoClient, execution_arn: str) -> tuple[list[str], dict[str, Any]]:
    """Every link from ``execution_arn`` on, and DescribeExecution of the latest."""
    links = [execution_arn]
    d = sfn.describe_execution(executionArn=execution_arn)
    while (nxt := continued_as(d)) is not None:
        links.append(nxt)
        d = sfn.describe_execution(executionArn=nxt)
    return links, d
