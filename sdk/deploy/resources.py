"""What a stack offers a job, and the names a job's resources get (the naming contract).

A stack (SAM on AWS, the embedded moto server locally) provides the bucket, the worker image, the
roles and the job state machine (:class:`StackResources`); per job, Stagecoach creates resources
named after the stack and the job id, within Lambda's and Step Functions' name limits.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from stagecoach.errors import StagecoachError

# Lambda limits names to 64 characters and Step Functions to 80: the stack name, the job id and the
# stage all go into them.
MAX_FUNCTION_NAME = 64
MAX_STATE_MACHINE_NAME = 80
# A job id is "<job name>-<8 hex>" (new_job_id; job names: stagecoach.job).
JOB_ID = re.compile(r"[a-z0-9][a-z0-9-]{0,29}-[0-9a-f]{8}")


HANDLER = "stagecoach.lambdas.handler.handler"

# A boto3 client (S3, Lambda, Step Functions, IAM, ...). boto3 ships no type information and no
# stubs are installed here, so to mypy a client is Any: this name says what is meant.
BotoClient = Any


@dataclass(frozen=True)
class StackResources:
    """What a deployed stack offers a job (CloudFormation outputs on AWS)."""

    prefix: str
    region: str
    bucket: str
    image_uri: str
    # the stack's default worker's role (remediation); each job's functions get a role of their own
    # (deploy/roles.py), created under role_path with the job_boundary_arn permissions boundary
    control_role_arn: str
    states_role_arn: str
    job_state_machine_arn: str
    # the stack's own worker function: the job state machine's remediation step runs there (never on
    # a job's stage function, which may be the one short of memory)
    control_function: str
    job_boundary_arn: str
    log_group_arn: str
    architecture: str = "x86_64"
    console: str = "https://{region}.console.aws.amazon.com/states/home?region={region}#/v2/executions/details/{arn}"


@dataclass
class Clients:
    s3: BotoClient
    lambda_: BotoClient
    sfn: BotoClient
    iam: BotoClient


def function_name(res: StackResources, job: str, stage: int) -> str:
    return f"{res.prefix}-{job}-s{stage}"


def window_state_machine_name(res: StackResources, job: str) -> str:
    return f"{res.prefix}-{job}-window"


def group_state_machine_name(res: StackResources, job: str) -> str:
    """The job's group state machine (planner/emit/groups.py): only a plan with a phase Map of
    more than GROUP_SIZE tasks has one."""
    return f"{res.prefix}-{job}-group"


def group_state_machine_of(window_arn: str) -> str:
    """The group state machine's ARN beside a job's window machine (the same name rule:
    ``window_state_machine_name``, ``group_state_machine_name``)."""
    return window_arn.removesuffix("-window") + "-group"


def window_log_group_arn(res: StackResources) -> str:
    """The stack's log group of Express windows (template.yaml WindowLogGroup), as a logging
    destination names it (with ":*")."""
    head = res.job_state_machine_arn.split(":states:", 1)[0]  # arn:<partition>
    region, account = res.job_state_machine_arn.split(":")[3:5]
    return f"{head}:logs:{region}:{account}:log-group:/aws/vendedlogs/states/{res.prefix}-windows:*"


def state_machine_arn(res: StackResources, name: str) -> str:
    """The ARN of the state machine ``name`` in the stack's region and account (as the job machine's)."""
    return res.job_state_machine_arn.rsplit(":", 1)[0] + ":" + name


def first_execution_arn(res: StackResources, job_id: str) -> str:
    """The ARN of the job's first execution, which deploy/start.py names after the job."""
    return res.job_state_machine_arn.replace(":stateMachine:", ":execution:") + ":" + job_id


def new_job_id(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:8]}"


class DeployError(StagecoachError, RuntimeError):
    """The stack cannot take the job; the message says what is missing and how to fix it."""


def object_exists(s3: BotoClient, bucket: str, key: str) -> bool:
    """HEAD the object (a 403 for a caller without s3:ListBucket counts as absent, as a 404 does)."""
    try:
        s3.head_object(Bucket=bucket, Key=key)
        return True
    except s3.exceptions.ClientError:
        return False


def read_json(s3: BotoClient, bucket: str, key: str) -> Any:
    return json.loads(s3.get_object(Bucket=bucket, Key=key)["Body"].read())


def check_name_lengths(stack: str, job_name: str, stages: int, workers: int = 0) -> None:
    """Refuse before creating anything if a function or state machine name would be too long.
    ``workers``: with a function per worker, the most replicas or sync tasks of a stage (their
    functions add "-r{i}" / "-k{i}", planner/plan.py worker_function)."""
    job_id_len = len(job_name) + 9  # "-" + 8 hex (deploy.new_job_id)
    fn = len(stack) + 1 + job_id_len + 2 + len(str(max(0, stages - 1))) + (2 + len(str(workers - 1)) if workers > 1 else 0)
    sm = len(stack) + 1 + job_id_len + len("-window")
    if fn > MAX_FUNCTION_NAME or sm > MAX_STATE_MACHINE_NAME:
        raise DeployError(
            f"names '{stack}-{job_name}-xxxxxxxx-s{stages - 1}' would be {fn} characters (Lambda allows {MAX_FUNCTION_NAME}): "
            f"shorten the job name or the stack name"
        )


# A job execution's name: the job id (its first execution), ``{job}-c{n}`` for a continuation
# (deploy/chain.py) and ``{job}-r{n}`` for a resumption (deploy/resume.py), n counting from 1.
# The job id is matched first and whole, so its own 8 hex digits are never taken for a suffix:
# ``digits-c1234567`` is that job's first execution, not a continuation of a job ``digits``.
# (A name reads two ways only for a continuation numbered with exactly 7 digits, the millionth
# and on: a job never gets there, and the name is then read as a job id.)
_EXECUTION = re.compile(rf"(?P<job>{JOB_ID.pattern})(?:-(?P<kind>[cr])(?P<n>[1-9][0-9]*))?")


@dataclass(frozen=True)
class ExecutionName:
    """A job execution's name, read: its job, and which link it is ("" the first execution,
    "c" a continuation, "r" a resumption, each with its number ``n``; 0 for the first)."""

    job: str
    kind: str
    n: int


def parse_execution_name(name: str) -> ExecutionName | None:
    """What a job execution's name says, or None for a name no job execution has."""
    m = _EXECUTION.fullmatch(name)
    if m is None:
        return None
    return ExecutionName(m["job"], m["kind"] or "", int(m["n"] or 0))


def job_of_execution(execution_name: str) -> str:
    """The job id of a job execution: ``{job}``, ``{job}-c{n}`` or ``{job}-r{n}``; a name no job
    execution has comes back unchanged (``job_id_from`` refuses it)."""
    parsed = parse_execution_name(execution_name)
    return parsed.job if parsed is not None else execution_name


def job_id_from(ref: str) -> str:
    """A job id from itself or from any of its job executions' ARNs (``job_of_execution``)."""
    job_id = job_of_execution(ref.rsplit(":", 1)[-1]) if ref.startswith("arn:") else ref
    if not JOB_ID.fullmatch(job_id):
        raise DeployError(f"{ref!r} is not a job: give a job id (NAME-xxxxxxxx, as `stagecoach train` prints it) or its job execution ARN")
    return job_id
