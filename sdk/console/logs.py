"""The worker's log of each failed task, for the console's failed-task panel: the lines
`stagecoach logs JOB --task PHASE-sSTAGE -t T` shows for it (sdk/worker_logs.py), from the stack's
log group (CloudWatch Logs on AWS) and, locally, the stack's workers.log: the handler's structured
records, Lambda's REPORT, the local runtime's notes (an injected fault, a kill for memory)."""

from __future__ import annotations

from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from stagecoach.backend import Backend
from stagecoach.deploy.resources import DeployError
from stagecoach.inspect.events import FailedTask
from stagecoach.worker_logs import function_prefix, job_lines, per_worker, task_lines, workers_log

MAX_LINES = 40


def worker_logs(backend: Backend, job_id: str, failed: list[FailedTask]) -> list[dict[str, Any]]:
    """Per failed task, the last lines of its worker's log (``lines``) and where they come from
    (``source``); the job's logs are read once, and an error reading them is shown in their place,
    not raised into the page."""
    if not failed:
        return []
    local = workers_log(backend)
    source = f"CloudWatch Logs {backend.resources.log_group_arn}" + (f" and {local}" if local else "")
    try:
        lines, _ = job_lines(backend, job_id)
        each = per_worker(backend, job_id)
    except (DeployError, ClientError, BotoCoreError) as e:
        return [{"source": source, "lines": [], "error": str(e)} for _ in failed]
    prefix = function_prefix(backend, job_id)[: -len("s")]
    return [{"source": source, "lines": [x.format(prefix) for x in task_lines(lines, f, each, MAX_LINES)]} for f in failed]
