"""`stagecoach logs JOB [--task PHASE[-sSTAGE[-INDEX]]] [-t T]`: the worker output of a job's
tasks, from the stack's log group (and, locally, the stack's workers.log): sdk/inspect/logs.py."""

from __future__ import annotations

import time

import click
from botocore.exceptions import BotoCoreError, ClientError

from stagecoach.aws.backend import AwsBackend
from stagecoach.backend import Backend
from stagecoach.cli.options import backend_option, job_backend, region_option, stack_option
from stagecoach.deploy.resources import BotoClient, DeployError, function_name
from stagecoach.deploy.resume import job_executions
from stagecoach.inspect.logs import LogLine, LogsError, TaskFilter, group_lines, select, workers_log_lines
from stagecoach.local.backend import LocalBackend
from stagecoach.planner.plan import per_worker_functions
from stagecoach.run import read_spec


@click.command(name="logs")
@click.argument("job")
@click.option(
    "--task",
    help="only this task's lines, named as its metrics are: PHASE[-sSTAGE[-INDEX]], e.g. backward, backward-s1, "
    "sync-s0-2 (INDEX: the replica, or a sync task's shard)",
)
@click.option("-t", "--iteration", "t", type=int, help="only iteration T's tasks (an evaluate or checkpoint task: the version it read)")
@backend_option
@stack_option
@region_option
def logs_command(job: str, task: str | None, t: int | None, backend: str | None, stack: str | None, region: str | None) -> None:
    """The worker output of a job's tasks, oldest first. JOB: a job id (with --stack on AWS) or its execution ARN.

    Each line: the time (UTC), the function (stage s0, its replica r1 or sync shard k2), the task
    (phase and iteration) and the record: the handler's own (task done, task failed with its
    error), Lambda's REPORT (duration, memory used), or what the job's code printed."""
    try:
        want = TaskFilter.parse(task, t)
    except LogsError as e:
        raise click.BadParameter(str(e), param_hint="--task") from None
    b, job_id = job_backend(job, backend, stack, region)
    prefix = function_name(b.resources, job_id, 0)[:-1]  # <stack>-<job>-s
    try:
        lines, unlabelled = _read(b, job_id, prefix)
        per_worker = _per_worker(b, job_id)
        shown = select(lines, want, per_worker)
    except LogsError as e:
        raise click.ClickException(str(e)) from None
    except (DeployError, ClientError, BotoCoreError) as e:
        raise click.ClickException(str(e)) from None
    for line in shown:
        click.echo(line.format(prefix[: -len("s")]))
    if not shown:
        click.echo(f"no lines of job {job_id}" + (" for that task" if task or t is not None else "") + " in its logs")
    if unlabelled:
        click.echo(f"({unlabelled} lines of the stack's workers.log name no job: print output and tracebacks; see {_workers_log(b)})")


def _read(b: Backend, job_id: str, prefix: str) -> tuple[list[LogLine], int]:
    """The job's lines from the stack's log group over its lifetime, and locally from workers.log too."""
    execs = job_executions(b.clients, b.resources, job_id)
    if not execs:
        raise DeployError(f"no job {job_id} in stack {b.resources.prefix} ({b.name}): `stagecoach list` shows its jobs")
    start = execs[0]["startDate"].timestamp() - 5  # a few seconds of clock skew either side
    ends = [e["stopDate"].timestamp() for e in execs if e.get("stopDate")]
    end = time.time() if any(e["status"] == "RUNNING" for e in execs) or not ends else max(ends) + 60
    group = b.resources.log_group_arn.split(":log-group:", 1)[1].removesuffix(":*")
    lines = list(group_lines(_logs_client(b), group, prefix, int(start * 1000), int(end * 1000)))
    unlabelled = 0
    path = _workers_log(b)
    if path:
        local, unlabelled = workers_log_lines(path, job_id, prefix)
        lines += local
    return lines, unlabelled


def _per_worker(b: Backend, job_id: str) -> bool:
    """Whether the job has a function per worker (its spec; a cleaned-up job's is gone: then not)."""
    try:
        spec = read_spec(b.clients.s3, b.resources.bucket, job_id)
    except ClientError:
        return False
    return per_worker_functions(spec.to_plan(), spec.warm_state)


def _logs_client(b: Backend) -> BotoClient:
    """A CloudWatch Logs client on the backend's stack: the local stack's endpoint, or the AWS
    session's region (the identity needs logs:FilterLogEvents on the stack's log group: docs/aws.md)."""
    if isinstance(b, LocalBackend):
        return b.stack.client("logs")
    if isinstance(b, AwsBackend):
        return b.session.client("logs", region_name=b.region)
    raise DeployError(f"the {b.name} backend has no logs to read")


def _workers_log(b: Backend) -> str | None:
    """The local stack's workers.log (every local invocation's output), or None on AWS."""
    return b.stack.log_path if isinstance(b, LocalBackend) and b.stack.log_dir else None
