"""`stagecoach stop JOB`: end a running job at its next iteration boundary, keeping its checkpoint."""

from __future__ import annotations

import click
from botocore.exceptions import ClientError

from stagecoach.cli.options import backend_option, job_backend, latest_execution, region_option, stack_option
from stagecoach.core import keys
from stagecoach.deploy.resources import DeployError
from stagecoach.run import request_stop, status_of


@click.command(name="stop")
@click.argument("job")
@backend_option
@stack_option
@region_option
def stop_command(job: str, backend: str | None, stack: str | None, region: str | None) -> None:
    """Stop a job at its next iteration boundary. JOB: a job id (with --stack on AWS) or its execution ARN.

    The job's iteration gate finds the request before its next iteration and ends the job there,
    with status STOPPED and the parameters and optimizer state of the version it reached (what a
    later resume starts from). Returns at once; `stagecoach inspect` shows where it stopped."""
    b, job_id = job_backend(job, backend, stack, region)
    try:
        s3, bucket = b.clients.s3, b.resources.bucket
        try:
            s3.head_object(Bucket=bucket, Key=keys.job_spec(job_id))
        except ClientError:
            raise click.ClickException(
                f"no job {job_id} in s3://{bucket}/jobs/ (was it cleaned up, or started on another stack?)"
            ) from None
        # the job's latest execution, a resumption's too, followed to its latest link: whether it runs
        status, d = status_of(b.clients.sfn, latest_execution(b, job_id))
        if status != "RUNNING":
            click.echo(f"job {job_id} has already ended ({status}): nothing to stop")
            return
        wrote = request_stop(s3, bucket, job_id)
    except (DeployError, ClientError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(
        f"job {job_id}: {'stop requested' if wrote else 'a stop was already requested'}; it ends at its next iteration "
        f"boundary with status STOPPED, keeping its checkpoint (`stagecoach inspect {d['executionArn']}` shows where)"
    )
