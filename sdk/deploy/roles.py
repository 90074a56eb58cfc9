"""Per-job worker roles: what isolates one job's workers from another's on a shared stack.

Workers run the user's code (the job's pickled model), so each job's functions get a role of their
own that reaches only that job's objects (jobs/<job>/), the shared datasets (data/, read only), the
stack's log group and X-Ray — never another job's objects or any function. The SDK creates the role
when the job launches and deletes it with the job.

Privilege: the deployer may create such roles only with the stack's permissions boundary (the
template's JobRoleBoundary, whose statements are :func:`job_boundary_policy`), and only under the
stack's IAM path "/stagecoach/<stack>/", which holds nothing the stack did not create. A role it
creates can therefore never do more than the boundary allows, which is less than the deployer
itself may do (tests/test_isolation.py checks both).

The policies are written here once: the local stack provisions them, template.yaml states the same
statements for AWS, and tests/test_template.py checks that the two agree.
"""

from __future__ import annotations

import json
import time
from typing import Any

from stagecoach.deploy.resources import Clients, StackResources

LAMBDA_TRUST = {
    "Version": "2012-10-17",
    "Statement": [{"Effect": "Allow", "Principal": {"Service": "lambda.amazonaws.com"}, "Action": "sts:AssumeRole"}],
}
STACK_TAG = "stagecoach:stack"
JOB_TAG = "stagecoach:job"
# Lambda refuses a role IAM has not yet propagated ("The role defined for the function cannot be
# assumed by Lambda."); reported for seconds after CreateRole, up to tens of seconds.
ROLE_PROPAGATION_MESSAGE = "cannot be assumed by Lambda"
ROLE_PROPAGATION_WAIT_S = 90.0


def role_path(stack: str) -> str:
    return f"/stagecoach/{stack}/"


def job_role_name(res: StackResources, job_id: str) -> str:
    """ "<stack>-<job>": shorter than the job's function names, which are checked against 64 characters."""
    return f"{res.prefix}-{job_id}"


def job_role_arn(res: StackResources, job_id: str) -> str:
    partition, account = res.control_role_arn.split(":")[1], res.control_role_arn.split(":")[4]
    return f"arn:{partition}:iam::{account}:role{role_path(res.prefix)}{job_role_name(res, job_id)}"


def bucket_arn(res: StackResources) -> str:
    return f"arn:{res.control_role_arn.split(':')[1]}:s3:::{res.bucket}"


def _worker_statements(bucket: str, log_group_arn: str, jobs: str) -> list[dict[str, Any]]:
    """What a job's workers do: their job's objects, datasets, logs, traces. ``jobs``: one job id, or
    "*" for the boundary that covers every job role of the stack."""
    return [
        {
            "Sid": "JobObjects",
            "Effect": "Allow",
            "Action": ["s3:GetObject", "s3:PutObject", "s3:PutObjectTagging", "s3:DeleteObject"],
            "Resource": f"{bucket}/jobs/{jobs}/*",
        },
        {"Sid": "Datasets", "Effect": "Allow", "Action": ["s3:GetObject"], "Resource": f"{bucket}/data/*"},
        # without ListBucket a GET of a not-yet-written object answers 403, not 404 (NoSuchKey); S3
        # checks it with the requested key as s3:prefix, so listing stays within the same trees
        {
            "Sid": "ListForNoSuchKey",
            "Effect": "Allow",
            "Action": ["s3:ListBucket"],
            "Resource": bucket,
            "Condition": {"StringLike": {"s3:prefix": [f"jobs/{jobs}/*", "data/*"]}},
        },
        {"Sid": "Logs", "Effect": "Allow", "Action": ["logs:CreateLogStream", "logs:PutLogEvents"], "Resource": log_group_arn},
        # X-Ray's PutTraceSegments/PutTelemetryRecords support no resource-level permissions
        {"Sid": "XRay", "Effect": "Allow", "Action": ["xray:PutTraceSegments", "xray:PutTelemetryRecords"], "Resource": "*"},
    ]


def job_worker_policy(res: StackResources, job_id: str) -> dict[str, Any]:
    return {"Version": "2012-10-17", "Statement": _worker_statements(bucket_arn(res), res.log_group_arn, job_id)}


def job_boundary_policy(bucket: str, log_group_arn: str) -> dict[str, Any]:
    """The stack's permissions boundary of every job role (template.yaml JobRoleBoundary)."""
    return {"Version": "2012-10-17", "Statement": _worker_statements(bucket, log_group_arn, "*")}


def control_policy(bucket: str, log_group_arn: str, stack: str, partition: str, region: str, account: str) -> dict[str, Any]:
    """The stack's default worker (template.yaml ControlRole): it runs no user code, only the job
    state machine's out-of-memory remediation (lambdas/remediate.py), which reads a job's spec and
    memory evidence, records what it did, remembers the memory for the job's next run (history/)
    and raises the stage function's memory."""
    return {
        "Version": "2012-10-17",
        "Statement": [
            {
                "Sid": "RemediationReads",
                "Effect": "Allow",
                "Action": ["s3:GetObject"],
                "Resource": [f"{bucket}/jobs/*/job.json", f"{bucket}/jobs/*/evidence/*", f"{bucket}/history/*"],
            },
            {
                "Sid": "RemediationWrites",
                "Effect": "Allow",
                "Action": ["s3:PutObject"],
                "Resource": [f"{bucket}/jobs/*/remediations/*", f"{bucket}/history/*"],
            },
            {"Sid": "ConsumeEvidence", "Effect": "Allow", "Action": ["s3:DeleteObject"], "Resource": f"{bucket}/jobs/*/evidence/*"},
            {
                "Sid": "ListForNoSuchKey",
                "Effect": "Allow",
                "Action": ["s3:ListBucket"],
                "Resource": bucket,
                "Condition": {"StringLike": {"s3:prefix": ["jobs/*", "history/*"]}},
            },
            {"Sid": "Logs", "Effect": "Allow", "Action": ["logs:CreateLogStream", "logs:PutLogEvents"], "Resource": log_group_arn},
            # the killed stage's function, one memory tier up; the function_updated_v2 waiter polls
            # GetFunction, which on a tagged function also needs ListTags. The tag condition keeps
            # the name pattern from reaching functions the stack did not create.
            {
                "Sid": "RemediateStackFunctionMemory",
                "Effect": "Allow",
                "Action": [
                    "lambda:GetFunction",
                    "lambda:GetFunctionConfiguration",
                    "lambda:UpdateFunctionConfiguration",
                    "lambda:ListTags",
                ],
                "Resource": f"arn:{partition}:lambda:{region}:{account}:function:{stack}-*-s*",
                "Condition": {"StringEquals": {f"aws:ResourceTag/{STACK_TAG}": stack}},
            },
            {"Sid": "XRay", "Effect": "Allow", "Action": ["xray:PutTraceSegments", "xray:PutTelemetryRecords"], "Resource": "*"},
        ],
    }


def create_job_role(res: StackResources, c: Clients, job_id: str) -> str:
    """The job's worker role, bounded by the stack's boundary; returns its ARN. Repeatable: a
    launch retried after a failure finds the role and rewrites its policy."""
    name = job_role_name(res, job_id)
    try:
        c.iam.create_role(
            RoleName=name,
            Path=role_path(res.prefix),
            AssumeRolePolicyDocument=json.dumps(LAMBDA_TRUST),
            PermissionsBoundary=res.job_boundary_arn,
            Description=f"Stagecoach job {job_id}: its own objects, the datasets, the stack's logs",
        )
    except c.iam.exceptions.EntityAlreadyExistsException:
        pass
    c.iam.put_role_policy(RoleName=name, PolicyName="job", PolicyDocument=json.dumps(job_worker_policy(res, job_id)))
    return job_role_arn(res, job_id)


def delete_job_role(res: StackResources, c: Clients, job_id: str) -> bool:
    """Remove the job's role (its inline policy first, as IAM requires); False if it was gone."""
    name = job_role_name(res, job_id)
    try:
        c.iam.delete_role_policy(RoleName=name, PolicyName="job")
    except c.iam.exceptions.NoSuchEntityException:
        pass
    try:
        c.iam.delete_role(RoleName=name)
    except c.iam.exceptions.NoSuchEntityException:
        return False
    return True


def create_function_when_role_ready(c: Clients, spec: dict[str, Any], wait_s: float = ROLE_PROPAGATION_WAIT_S) -> None:
    """CreateFunction, retried while Lambda cannot yet assume a just-created role (IAM is eventually
    consistent; botocore does not retry this InvalidParameterValueException): every quarter second
    for the first two seconds, so a short propagation costs little waiting past it, then backing
    off to 4 s between attempts."""
    start = time.monotonic()
    deadline = start + wait_s
    delay = 0.25
    while True:
        try:
            c.lambda_.create_function(**spec)
            return
        except c.lambda_.exceptions.InvalidParameterValueException as e:
            if ROLE_PROPAGATION_MESSAGE not in str(e) or time.monotonic() + delay > deadline:
                raise
        time.sleep(delay)
        if time.monotonic() - start >= 2.0:
            delay = min(delay * 2, 4.0)
