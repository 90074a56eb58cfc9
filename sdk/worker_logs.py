"""A job's worker output wherever its stack keeps it: the stack's log group (CloudWatch Logs on
AWS, the local stack's emulation), and locally the stack's ``workers.log`` too. One reader for
`stagecoach logs` and the console's failed-task panel, so both show the same lines on either
backend; parsing and selecting the lines is sdk/inspect/logs.py."""

from __future__ import annotations

import time

from stagecoach.aws.backend import AwsBackend
from stagecoach.backend import Backend
from stagecoach.deploy.resources import BotoClient, DeployError, function_name
from stagecoach.deploy.resume import job_executions
from stagecoach.inspect.events import FailedTask
from stagecoach.inspect.logs import LogLine, TaskFilter, group_lines, select, workers_log_lines
from stagecoach.local.backend import LocalBackend
from stagecoach.planner.plan import per_worker_functions
from stagecoach.run import read_spec

__all__ = ["function_prefix", "job_lines", "per_worker", "task_lines", "workers_log"]


def function_prefix(b: Backend, job_id: str) -> str:
    """What the job's functions' names start with: ``<stack>-<job>-s``."""
    return function_name(b.resources, job_id, 0)[:-1]


def job_lines(b: Backend, job_id: str) -> tuple[list[LogLine], int]:
    """The job's lines from the stack's log group over its lifetime (its first execution's start
    to its latest one's end), and locally from workers.log too; and how many workers.log lines name
    no job (print output and tracebacks of every job, unlabelled)."""
    execs = job_executions(b.clients, b.resources, job_id)
    if not execs:
        raise DeployError(f"no job {job_id} in stack {b.resources.prefix} ({b.name}): `stagecoach list` shows its jobs")
    start = execs[0]["startDate"].timestamp() - 5  # a few seconds of clock skew either side
    ends = [e["stopDate"].timestamp() for e in execs if e.get("stopDate")]
    end = time.time() if any(e["status"] == "RUNNING" for e in execs) or not ends else max(ends) + 60
    group = b.resources.log_group_arn.split(":log-group:", 1)[1].removesuffix(":*")
    prefix = function_prefix(b, job_id)
    lines = list(group_lines(_logs_client(b), group, prefix, int(start * 1000), int(end * 1000)))
    unlabelled = 0
    path = workers_log(b)
    if path:
        local, unlabelled = workers_log_lines(path, job_id, prefix)
        lines += local
    return lines, unlabelled


def per_worker(b: Backend, job_id: str) -> bool:
    """Whether the job has a function per worker (its spec; a cleaned-up job's is gone: then not)."""
    try:
        spec = read_spec(b.clients.s3, b.resources.bucket, job_id)
    except b.clients.s3.exceptions.ClientError:
        return False
    return per_worker_functions(spec.to_plan(), spec.warm_state)


def task_lines(lines: list[LogLine], f: FailedTask, per_worker: bool, max_lines: int) -> list[LogLine]:
    """Of the job's lines (``job_lines``), the last ``max_lines`` of one failed task: its
    function's, of its phase, iteration and stage (a REPORT and a runtime note by the invocation
    they belong to), up to a second after it failed (a later attempt's, which succeeded, are not
    the failure's)."""
    want = TaskFilter(f.phase, f.stage, None, f.t)
    mine = [x for x in select(lines, want, per_worker) if x.function == f.function]
    if f.time is not None:
        mine = [x for x in mine if x.time <= f.time + 1.0]
    return mine[-max_lines:]


def _logs_client(b: Backend) -> BotoClient:
    """A CloudWatch Logs client on the backend's stack: the local stack's endpoint, or the AWS
    session's region (the identity needs logs:FilterLogEvents on the stack's log group: docs/aws.md)."""
    if isinstance(b, LocalBackend):
        return b.stack.client("logs")
    if isinstance(b, AwsBackend):
        return b.session.client("logs", region_name=b.region)
    raise DeployError(f"the {b.name} backend has no logs to read")


def workers_log(b: Backend) -> str | None:
    """The local stack's workers.log (every local invocation's output), or None on AWS."""
    return b.stack.log_path if isinstance(b, LocalBackend) and b.stack.log_dir else None
