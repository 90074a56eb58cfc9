"""Options shared by the commands that reach a stack, the backend they name, and the job a JOB
argument names (a job id or an execution ARN, read the same way by every command)."""

from __future__ import annotations

from typing import Unpack

import click
from botocore.exceptions import BotoCoreError, ClientError

from stagecoach.backend import Backend
from stagecoach.backends import LocalStackOptions, get_backend
from stagecoach.deploy.resources import JOB_ID, DeployError, job_id_from
from stagecoach.local.daemon_state import running_stack
from stagecoach.local.process import ACCOUNT as LOCAL_ACCOUNT
from stagecoach.run import latest_execution as run_latest_execution

backend_option = click.option(
    "--backend", type=click.Choice(["local", "aws"]), default=None, help="local (embedded stack) or aws; default: aws if --stack is given"
)
stack_option = click.option("--stack", envvar="STAGECOACH_STACK", help="the SAM stack's name (aws backend)")
region_option = click.option("--region", envvar="AWS_REGION", help="the stack's region (aws backend)")


def backend_for(
    backend: str | None, stack: str | None, region: str | None, need_daemon: bool = False, **local: Unpack[LocalStackOptions]
) -> Backend:
    """The backend the options name, with its errors turned into CLI errors.

    ``need_daemon``: the local backend must be this project's daemon's (a run started by an
    earlier process lives only there), for inspect, stop, resume and cleanup; a project with saved
    jobs starts its daemon on demand (stagecoach.local.daemon_state.running_stack).
    """
    if need_daemon and (backend or ("aws" if stack else "local")) == "local":
        try:
            attached = running_stack()
        except DeployError as e:  # another checkout's daemon, or one that would not start
            raise click.ClickException(str(e)) from None
        if attached is None:
            raise click.ClickException(
                "no local stack is running for this project: `stagecoach local start` starts it with the jobs it "
                "saved, `stagecoach train FILE` starts it for a new run (a job on AWS: give --stack NAME, or its execution ARN)"
            )
    try:
        return get_backend(backend or ("aws" if stack else "local"), stack=stack, region=region, **local)
    except (DeployError, ClientError, BotoCoreError) as e:
        raise click.ClickException(str(e)) from None


def infer_from_arn(arn: str, backend: str | None, stack: str | None, region: str | None) -> tuple[str | None, str | None, str | None]:
    """(backend, stack, region) for a job execution ARN given without --backend or --stack: the
    local stack's account means local; otherwise the job state machine is named "<stack>-job", and
    the ARN's region beats an AWS_REGION from the environment (an explicit --region is kept)."""
    parts = arn.split(":")
    if backend is not None or stack is not None or len(parts) != 8:
        return backend, stack, region
    if parts[4] == LOCAL_ACCOUNT:
        return "local", stack, region
    if parts[6].endswith("-job"):
        source = click.get_current_context().get_parameter_source("region")
        if region is None or source is click.core.ParameterSource.ENVIRONMENT:
            region = parts[3]
        return "aws", parts[6][: -len("-job")], region
    return backend, stack, region


# what every command that names a job says when JOB is neither (tests/test_inspect.py reads it)
NOT_A_JOB = (
    "{ref!r} is not a job id (NAME-xxxxxxxx, as `stagecoach train` prints it) and is not a job execution ARN "
    "(arn:aws:states:REGION:ACCOUNT:execution:STACK-job:JOB)"
)


def job_backend(ref: str, backend: str | None, stack: str | None, region: str | None) -> tuple[Backend, str]:
    """The backend and the job id JOB names: a job id, or any of its job executions' ARNs (first,
    continuation or resumption). The one place inspect, stop, resume and cleanup read JOB.

    An ARN names its stack and region (``infer_from_arn``; explicit options win) and is checked
    against the backend (``check_arn``: another region or account); a job id needs the options'
    backend (``--stack`` on AWS). The shape is checked before any stack is reached; the backend
    before an ARN's execution name is read, so a missing local daemon is said first."""
    is_arn = ref.startswith("arn:")
    if is_arn:
        parts = ref.split(":")
        if len(parts) != 8 or parts[2] != "states" or parts[5] != "execution":
            raise click.ClickException(NOT_A_JOB.format(ref=ref))
        backend, stack, region = infer_from_arn(ref, backend, stack, region)
    elif not JOB_ID.fullmatch(ref):
        raise click.ClickException(NOT_A_JOB.format(ref=ref))
    b = backend_for(backend, stack, region, need_daemon=True)
    try:
        if is_arn:
            b.check_arn(ref)
        return b, job_id_from(ref)
    except (DeployError, ClientError) as e:
        raise click.ClickException(str(e)) from None


def latest_execution(b: Backend, job_id: str) -> str:
    """The ARN of the job's latest execution (run.py ``latest_execution``: the one every command
    and ``attach`` read), with its errors turned into CLI errors."""
    try:
        return run_latest_execution(b.clients, b.resources, job_id)
    except ClientError as e:
        if e.response.get("Error", {}).get("Code") == "ExecutionDoesNotExist":
            raise click.ClickException(
                f"no job {job_id} in stack {b.resources.prefix} ({b.name}): `stagecoach list` shows its jobs"
            ) from None
        raise click.ClickException(str(e)) from None
    except DeployError as e:
        raise click.ClickException(str(e)) from None
