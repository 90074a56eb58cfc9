"""Options shared by the commands that reach a stack, and the backend they name."""

from __future__ import annotations

from typing import Unpack

import click
from botocore.exceptions import BotoCoreError, ClientError

from stagecoach.backend import Backend
from stagecoach.backends import LocalStackOptions, get_backend
from stagecoach.deploy.resources import DeployError
from stagecoach.local.daemon_state import running_stack
from stagecoach.local.process import ACCOUNT as LOCAL_ACCOUNT

backend_option = click.option(
    "--backend", type=click.Choice(["local", "aws"]), default=None, help="local (embedded stack) or aws; default: aws if --stack is given"
)
stack_option = click.option("--stack", envvar="STAGECOACH_STACK", help="the SAM stack's name (aws backend)")
region_option = click.option("--region", envvar="AWS_REGION", help="the stack's region (aws backend)")


def backend_for(
    backend: str | None, stack: str | None, region: str | None, need_daemon: bool = False, **local: Unpack[LocalStackOptions]
) -> Backend:
    """The backend the options name, with its errors turned into CLI errors.

    ``need_daemon``: the local backend must be the `stagecoach local start` daemon's (a run started
    by an earlier process lives only there), for inspect and cleanup.
    """
    if need_daemon and (backend or ("aws" if stack else "local")) == "local" and running_stack() is None:
        raise click.ClickException(
            "no local stack is running: start one with `stagecoach local start` before training, then inspect runs made while it ran"
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
