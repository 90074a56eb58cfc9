"""`stagecoach logs JOB [--task PHASE[-sSTAGE[-INDEX]]] [-t T]`: the worker output of a job's
tasks, from the stack's log group (and, locally, the stack's workers.log): sdk/worker_logs.py reads
them, sdk/inspect/logs.py parses and selects them."""

from __future__ import annotations

import click
from botocore.exceptions import BotoCoreError, ClientError

from stagecoach.cli.options import backend_option, job_backend, region_option, stack_option
from stagecoach.deploy.resources import DeployError
from stagecoach.inspect.logs import LogsError, TaskFilter, select
from stagecoach.worker_logs import function_prefix, job_lines, per_worker, workers_log


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
    prefix = function_prefix(b, job_id)  # <stack>-<job>-s
    try:
        lines, unlabelled = job_lines(b, job_id)
        shown = select(lines, want, per_worker(b, job_id))
    except LogsError as e:
        raise click.ClickException(str(e)) from None
    except (DeployError, ClientError, BotoCoreError) as e:
        raise click.ClickException(str(e)) from None
    for line in shown:
        click.echo(line.format(prefix[: -len("s")]))
    if not shown:
        click.echo(f"no lines of job {job_id}" + (" for that task" if task or t is not None else "") + " in its logs")
    if unlabelled:
        click.echo(f"({unlabelled} lines of the stack's workers.log name no job: print output and tracebacks; see {workers_log(b)})")
