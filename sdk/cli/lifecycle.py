"""`stagecoach resume JOB` and `stagecoach list`: continue a job from its last checkpoint, and see
the stack's jobs (sdk/deploy/resume.py)."""

from __future__ import annotations

import time

import click
from botocore.exceptions import ClientError

from stagecoach.cli.options import backend_for, backend_option, job_backend, region_option, stack_option
from stagecoach.cli.report import report_run
from stagecoach.deploy.resources import DeployError
from stagecoach.lifecycle import list_jobs
from stagecoach.run import RunFailed


@click.command(name="resume")
@click.argument("job")
@click.option("--iterations", type=int, help="train to this many iterations in all (default: the job's own)")
@click.option("--wait/--no-wait", default=True, help="follow the run to its end (default) or return once it has started")
@click.option("--out", default="stagecoach-runs", show_default=True, help="directory for results (as `stagecoach train --out`)")
@backend_option
@stack_option
@region_option
def resume_command(
    job: str, iterations: int | None, wait: bool, out: str, backend: str | None, stack: str | None, region: str | None
) -> None:
    """Continue a stopped, failed or finished job from its last complete checkpoint. JOB: a job id
    (with --stack on AWS) or its execution ARN. The continued run ends bit-identical to one that
    never stopped; it is reported and saved as `train` reports and saves a run (loss, evaluation,
    cost, results folder), its model rebuilt from the job's uploaded code."""
    if iterations is not None and iterations < 1:
        raise click.BadParameter(f"{iterations}: give a positive number of iterations", param_hint="--iterations")
    t0 = time.time()
    b, job_id = job_backend(job, backend, stack, region)  # an ARN names its stack and region
    try:
        run = b.resume(job_id, iterations)
    except (DeployError, ClientError) as e:
        raise click.ClickException(str(e)) from None
    spec = run.spec()
    click.echo(f"job {run.job_id}: resumed from its checkpoint, to {spec.iterations} iterations: execution {run.execution_arn}")
    if not wait:
        return
    try:
        status = run.wait(progress=True)
    except (RunFailed, DeployError) as e:
        raise click.ClickException(str(e)) from None
    report_run(run, status, time.time() - t0, out)


@click.command(name="list")
@backend_option
@stack_option
@region_option
def list_command(backend: str | None, stack: str | None, region: str | None) -> None:
    """The stack's jobs, newest first: job id, name, status, iterations, when it started."""
    b = backend_for(backend, stack, region, need_daemon=True)
    try:
        jobs = list_jobs(b)  # each job's status as inspect and train show it
    except (DeployError, ClientError) as e:
        raise click.ClickException(str(e)) from None
    if not jobs:
        click.echo("no jobs")
        return
    click.echo(f"{'job':<28} {'name':<16} {'status':<10} {'iterations':>10}  started")
    for j in jobs:
        click.echo(f"{j.job:<28} {j.name:<16} {j.status:<10} {j.iterations:>10}  {j.started}")
