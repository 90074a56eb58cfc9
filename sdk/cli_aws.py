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

    parts = execution_arn.split(":")
    if len(parts) != 8 or parts[0] != "arn" or parts[2] != "states" or parts[5] != "execution":
        raise click.ClickException(f"{execution_arn!r} is not a job execution ARN: give the one `stagecoach train` "
                                   "prints (arn:aws:states:REGION:ACCOUNT:execution:STACK-job:JOB)")
    if backend is None and stack is None:
        # the local stack's account is moto's 123456789012 (AWS's documentation example, no real account)
        backend = "local" if parts[4] == "123456789012" else None
        if backend is None and parts[6].endswith("-job"):
            # an AWS ARN without --stack: the job state machine is named "<stack>-job", and the
            # ARN's region beats an AWS_REGION from the environment (an explicit --region is kept)
            stack, backend = parts[6][: -len("-job")], "aws"
            source = click.get_current_context().get_parameter_source("region")
            if region is None or source is click.core.ParameterSource.ENVIRONMENT:
                region = parts[3]
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
        try:
            paths = write_plots(ins, plot_dir)
        except (InspectError, OSError) as e:
            raise click.ClickException(f"cannot write the plots to {plot_dir}: {e}") from None
        for path in paths:
            click.echo(f"wrote {path}")
        if not paths:
            click.echo("no plots: no task has finished yet")


@click.command(name="cleanup")
@click.argument("job")
@backend_option
@stack_option
@region_option
@click.option("--keep-results", is_flag=True, help="keep the job's objects (parameters, metrics) in the bucket")
@click.option("--force", is_flag=True, help="stop the job first if it is still running")
def cleanup_command(job: str, backend: str | None, stack: str | None, region: str | None, keep_results: bool, force: bool) -> None:
    """Remove a job's functions, window state machine and objects. JOB: a job id or its execution ARN.

    Shared things stay: datasets (data/), what past runs taught the job's next run (history/), the
    stack itself. Running it again is harmless (what is already gone is skipped)."""
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
