"""`stagecoach inspect JOB`: status, where the run is, timings, loss, failed tasks, plots. JOB is a
job id (its latest execution is inspected) or one of its execution ARNs (that execution)."""

from __future__ import annotations

import json

import click
from botocore.exceptions import ClientError

from stagecoach.cli.options import backend_option, job_backend, latest_execution, region_option, stack_option
from stagecoach.deploy.resources import DeployError
from stagecoach.inspect.plots import write_plots
from stagecoach.inspect.report import InspectError, format_report, inspect_execution


@click.command(name="inspect")
@click.argument("job")
@backend_option
@stack_option
@region_option
@click.option("--plot", "plot_dir", type=click.Path(file_okay=False), help="write Gantt, time-breakdown and loss PNGs here")
@click.option("--json", "as_json", is_flag=True, help="print the inspection as JSON")
def inspect_command(job: str, backend: str | None, stack: str | None, region: str | None, plot_dir: str | None, as_json: bool) -> None:
    """Status, window and iteration, phase timings, loss curve and failed tasks of a job execution.

    JOB: a job id (with --stack on AWS), whose latest execution is inspected, or the ARN of one of
    its executions, which names its stack and region."""
    b, job_id = job_backend(job, backend, stack, region)
    execution_arn = job if job.startswith("arn:") else latest_execution(b, job_id)
    try:
        ins = inspect_execution(b, execution_arn)
    except (InspectError, DeployError, ClientError) as e:
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
