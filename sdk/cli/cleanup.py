"""`stagecoach cleanup JOB`: remove a job's functions, window state machine and objects."""

from __future__ import annotations

import click
from botocore.exceptions import ClientError

from stagecoach.cli.options import backend_option, job_backend, region_option, stack_option
from stagecoach.deploy.resources import DeployError


@click.command(name="cleanup")
@click.argument("job")
@backend_option
@stack_option
@region_option
@click.option("--keep-results", is_flag=True, help="keep the job's objects (parameters, metrics) in the bucket")
@click.option("--force", is_flag=True, help="stop the job first if it is still running")
def cleanup_command(job: str, backend: str | None, stack: str | None, region: str | None, keep_results: bool, force: bool) -> None:
    """Remove a job's functions, window state machine and objects. JOB: a job id (with --stack on
    AWS) or its execution ARN.

    Shared things stay: datasets (data/), what past runs taught the job's next run (history/), the
    stack itself. Running it again is harmless (what is already gone is skipped)."""
    b, job_id = job_backend(job, backend, stack, region)  # an ARN names its stack and region
    try:
        removed = b.cleanup(job_id, keep_results=keep_results, stop_running=force, log=click.echo)
    except (DeployError, ClientError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(
        f"removed {len(removed.functions)} functions, {len(removed.state_machines)} state machines, "
        f"{len(removed.objects)} objects"
        + (", the job's role" if removed.roles else "")
        + (f"; stopped {removed.stopped[0]}" if removed.stopped else "")
    )
