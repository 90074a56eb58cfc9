"""`stagecoach inspect` and `stagecoach cleanup` for both backends, and the backend choice of `train`.

``--backend`` defaults to ``aws`` when ``--stack`` (or STAGECOACH_STACK) is given, else ``local``
(which needs `stagecoach local start`: the embedded stack of an earlier process is gone).
"""

from __future__ import annotations

import json
from typing import Any

import click

backend_option = click.option("--backend", type=click.Choice(["local", "aws"]), default=None,
                              help="local (embedded stack) or aws; default: aws if --stack is given")
stack_option = click.option("--stack", envvar="STAGECOACH_STACK", help="the SAM stack's name (aws backend)")
region_option = click.option("--region", envvar="AWS_REGION", help="the stack's region (aws backend)")


def resolve_backend(backend: str | None, stack: str | None, region: str | None) -> Any:
    """A backend instance, with the AWS backend's errors turned into CLI errors."""
    from botocore.exceptions import BotoCoreError, ClientError

    from stagecoach.aws_backend import StackError, make_backend

    if backend is None:
        backend = "aws" if stack else "local"
    if backend == "local":
        from stagecoach.cli_local import running_stack

        if running_stack() is None:
            raise click.ClickException("no local stack is running: start one with `stagecoach local start` "
                                       "before training, then inspect runs made while it ran")
    try:
        return make_backend(backend, stack=stack, region=region)
    except (StackError, ClientError, BotoCoreError) as e:
        raise click.ClickException(str(e)) from None


@click.command(name="inspect")
@click.argument("execution_arn")
@backend_option
@stack_option
@region_option
@click.option("--plot", "plot_dir", type=click.Path(file_okay=False), help="write Gantt, time-breakdown and loss PNGs here")
@click.option("--json", "as_json", is_flag=True, help="print the inspection as JSON")
def inspect_command(execution_arn: str, backend: str | None, stack: str | None, region: str | None,
                    plot_dir: str | None, as_json: bool) -> None:
    """Status, window and iteration, phase timings, loss curve and failed tasks of a job execution."""
    from botocore.exceptions import ClientError

    from stagecoach.aws_backend import StackError
    from stagecoach.inspect_run import InspectError, format_report, inspect_execution, write_plots

    if backend is None and stack is None and execution_arn.startswith("arn:"):
        backend = "local" if ":123456789012:" in execution_arn else None
        if backend is None:
            # an AWS ARN without --stack: the job state machine is named "<stack>-job"
            sm = execution_arn.split(":")[6] if execution_arn.count(":") >= 7 else ""
            if sm.endswith("-job"):
                stack, backend = sm[: -len("-job")], "aws"
                region = region or execution_arn.split(":")[3]
    b = resolve_backend(backend, stack, region)
    try:
        ins = inspect_execution(b, execution_arn)
    except (InspectError, StackError, ClientError) as e:
        raise click.ClickException(str(e)) from None
    if as_json:
        click.echo(json.dumps(ins.to_dict(), indent=2, default=str))
    else:
        click.echo(format_report(ins))
    if plot_dir:
        for path in write_plots(ins, plot_dir):
            click.echo(f"wrote {path}")


@click.command(name="cleanup")
@click.argument("job")
@backend_option
@stack_option
@region_option
@click.option("--keep-results", is_flag=True, help="keep the job's objects (parameters, metrics) in the bucket")
@click.option("--force", is_flag=True, help="stop the job first if it is still running")
def cleanup_command(job: str, backend: str | None, stack: str | None, region: str | None, keep_results: bool, force: bool) -> None:
    """Remove a job's functions, window state machine and objects. JOB: a job id or its execution ARN."""
    from botocore.exceptions import ClientError

    from stagecoach.aws_backend import StackError, cleanup_job, job_id_from

    b = resolve_backend(backend, stack, region)
    if hasattr(b, "check_arn") and job.startswith("arn:"):
        try:
            b.check_arn(job)
        except StackError as e:
            raise click.ClickException(str(e)) from None
    try:
        removed = cleanup_job(b, job_id_from(job), keep_results=keep_results, stop_running=force, log=click.echo)
    except (StackError, ClientError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"removed {len(removed['functions'])} functions, {len(removed['state_machines'])} state machines, "
               f"{len(removed['objects'])} objects" + (f"; stopped {removed['stopped'][0]}" if removed["stopped"] else ""))


def train_backend(backend: str | None, stack: str | None, region: str | None) -> Any:
    """For `stagecoach train`: the backend object to pass to ``job.run(backend=...)``.

    ``local`` stays the string "local" (the SDK's default path, which also attaches to a running
    daemon); ``aws`` builds an AwsBackend from ``--stack``/``--region`` with CLI-friendly errors.
    """
    if backend is None:
        backend = "aws" if stack else "local"
    if backend == "local":
        return "local"
    return resolve_backend(backend, stack, region)
