"""Per-job worker roles: what isolates one job's workers from another's on a shared stack.

Workers run the user's code (the job's pickled model), so each job's functions get a role of their
own that reaches only that job's objects (jobs/<job>/), the data sets it uses (data/<id>/, read
only: its "datasets" policy, written once they are uploaded), the stack's log group and X-Ray —
never another job's objects or data sets, or any function. The SDK creates the role
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
import re
import time
from typing import Any

from stagecoach.core import keys
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


def _functions_arn(log_group_arn: str, prefix: str, jobs: str) -> str:
    """The job's stage functions (deploy/resources.py function_name: "<prefix>-<job>-s<stage>"),
    in the log group's partition, region and account."""
    partition, region, account = log_group_arn.split(":")[1], log_group_arn.split(":")[3], log_group_arn.split(":")[4]
    return f"arn:{partition}:lambda:{region}:{account}:function:{prefix}-{jobs}-s*"


def _job_statements(bucket: str, log_group_arn: str, jobs: str, data: list[str], prefix: str) -> list[dict[str, Any]]:
    """What a job's workers do: their job's objects, data sets, logs, traces. ``jobs``: one job id,
    or "*" for the boundary that covers every job role of the stack; ``data``: the data-set key
    patterns they read ("data/*" in the boundary; none in a job's own "job" policy, whose data sets
    ``job_dataset_policy`` grants)."""
    objects = {
        "Sid": "JobObjects",
        "Effect": "Allow",
        "Action": ["s3:GetObject", "s3:PutObject", "s3:PutObjectTagging", "s3:DeleteObject"],
        "Resource": f"{bucket}/jobs/{jobs}/*",
    }
    datasets = [{"Sid": "Datasets", "Effect": "Allow", "Action": ["s3:GetObject"], "Resource": f"{bucket}/{d}"} for d in data]
    # without ListBucket a GET of a not-yet-written object answers 403, not 404 (NoSuchKey); S3
    # checks it with the requested key as s3:prefix, so listing stays within the same trees
    listing = {
        "Sid": "ListForNoSuchKey",
        "Effect": "Allow",
        "Action": ["s3:ListBucket"],
        "Resource": bucket,
        "Condition": {"StringLike": {"s3:prefix": [f"jobs/{jobs}/*", *data]}},
    }
    return [
        objects,
        *datasets,
        listing,
        {"Sid": "Logs", "Effect": "Allow", "Action": ["logs:CreateLogStream", "logs:PutLogEvents"], "Resource": log_group_arn},
        # X-Ray's PutTraceSegments/PutTelemetryRecords support no resource-level permissions
        {"Sid": "XRay", "Effect": "Allow", "Action": ["xray:PutTraceSegments", "xray:PutTelemetryRecords"], "Resource": "*"},
        # the phase watcher runs a late task again on its own job's functions (lambdas/watcher.py).
        # A name pattern alone could match another job whose name extends this one's ("<job>-s1-..."):
        # the tag every function carries from its launch (deploy/start.py) says whose it is, and
        # Lambda decides InvokeFunction on aws:ResourceTag (Lambda guide, "Secure your functions
        # by tag": https://docs.aws.amazon.com/lambda/latest/dg/attribute-based-access-control-example.html).
        # The boundary names the stack; each job's own policy narrows it to the job.
        {
            "Sid": "RunOwnTasksAgain",
            "Effect": "Allow",
            "Action": ["lambda:InvokeFunction"],
            "Resource": _functions_arn(log_group_arn, prefix, jobs),
            "Condition": {
                "StringEquals": {f"aws:ResourceTag/{STACK_TAG}": prefix} if jobs == "*" else {f"aws:ResourceTag/{JOB_TAG}": jobs}
            },
        },
    ]


def job_worker_policy(res: StackResources, job_id: str) -> dict[str, Any]:
    """The job role's "job" policy: its own objects, logs and traces; no data set (those are the
    "datasets" policy's, :func:`job_dataset_policy`). The job's spec is the deployer's: its workers
    read it but may not replace or delete it, since the control role's remediation and the SDK's
    cleanup and resume act on what it says (issue 24 item 7; an explicit Deny wins over the Allow)."""
    b = bucket_arn(res)
    spec = {
        "Sid": "SpecIsTheDeployers",
        "Effect": "Deny",
        "Action": ["s3:PutObject", "s3:PutObjectTagging", "s3:DeleteObject"],
        "Resource": f"{b}/{keys.job_spec(job_id)}",
    }
    return {"Version": "2012-10-17", "Statement": [*_job_statements(b, res.log_group_arn, job_id, [], res.prefix), spec]}


def job_boundary_policy(bucket: str, log_group_arn: str, prefix: str) -> dict[str, Any]:
    """The stack's permissions boundary of every job role (template.yaml JobRoleBoundary): the most
    any job's role may do, every data set included; each role's own policies narrow it."""
    return {"Version": "2012-10-17", "Statement": _job_statements(bucket, log_group_arn, "*", ["data/*"], prefix)}


_DATASET_ID = re.compile(r"[0-9a-f]{32}")  # Manifest.dataset_id: no character IAM reads as a wildcard


def job_dataset_policy(res: StackResources, dataset_ids: list[str]) -> dict[str, Any]:
    """The job role's "datasets" policy: reading (and listing, for 404 rather than 403) the data
    sets the job uses, each its prefix data/<id>/ (core/keys.py dataset_prefix), and no other, so
    one job's workers cannot read another job's training bytes (issue 24 item 6)."""
    bad = [d for d in dataset_ids if not _DATASET_ID.fullmatch(d)]
    if bad or not dataset_ids:
        raise ValueError(f"data set ids {dataset_ids}: each must be 32 hex digits (core/samples.py Manifest.dataset_id)")
    prefixes = [f"{keys.dataset_prefix(d)}*" for d in dict.fromkeys(dataset_ids)]
    b = bucket_arn(res)
    return {
        "Version": "2012-10-17",
        "Statement": [
            {"Sid": "Datasets", "Effect": "Allow", "Action": ["s3:GetObject"], "Resource": [f"{b}/{p}" for p in prefixes]},
            {
                "Sid": "ListDatasets",
                "Effect": "Allow",
                "Action": ["s3:ListBucket"],
                "Resource": b,
                "Condition": {"StringLike": {"s3:prefix": prefixes}},
            },
        ],
    }


def control_policy(bucket: str, log_group_arn: str, stack: str, partition: str, region: str, account: str) -> dict[str, Any]:
    """The stack's default worker (template.yaml ControlRole): it runs no user code, only the job
    state machine's out-of-memory remediation (lambdas/remediate.py), which reads a job's spec and
    memory evidence (the stage's record, the killed invocation's REPORT log event), records what it did, remembers the memory for the job's next run (history/)
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
            # the killed invocation's REPORT, in the stack's log group where every function of the
            # stack logs (its ARN with ":*", the form IAM policies use for log-group actions)
            {"Sid": "ReadReports", "Effect": "Allow", "Action": ["logs:FilterLogEvents"], "Resource": log_group_arn},
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


def _ensure_role(res: StackResources, c: Clients, job_id: str) -> str:
    """The job's worker role, bounded by the stack's boundary, created unless it exists; its name."""
    name = job_role_name(res, job_id)
    try:
        c.iam.create_role(
            RoleName=name,
            Path=role_path(res.prefix),
            AssumeRolePolicyDocument=json.dumps(LAMBDA_TRUST),
            PermissionsBoundary=res.job_boundary_arn,
            Description=f"Stagecoach job {job_id}: its own objects, its data sets, the stack's logs",
        )
    except c.iam.exceptions.EntityAlreadyExistsException:
        pass
    return name


def create_job_role(res: StackResources, c: Clients, job_id: str) -> str:
    """The job's worker role with its "job" policy; returns its ARN. Repeatable: a launch retried
    after a failure finds the role and rewrites its policy. Its data sets are granted once they are
    uploaded (:func:`grant_datasets`), before or after this."""
    name = _ensure_role(res, c, job_id)
    c.iam.put_role_policy(RoleName=name, PolicyName="job", PolicyDocument=json.dumps(job_worker_policy(res, job_id)))
    return job_role_arn(res, job_id)


def grant_datasets(res: StackResources, c: Clients, job_id: str, dataset_ids: list[str]) -> None:
    """Let the job's workers read ``dataset_ids`` (the role's "datasets" policy; the role is created
    if it does not exist yet). Called by the upload as soon as the data sets are up, before the
    job's code and functions, so IAM has propagated the policy by the first task (IAM user guide,
    "Changes that I make are not always immediately visible":
    https://docs.aws.amazon.com/IAM/latest/UserGuide/troubleshoot_general.html#troubleshoot_general_eventual-consistency)."""
    name = _ensure_role(res, c, job_id)
    c.iam.put_role_policy(RoleName=name, PolicyName="datasets", PolicyDocument=json.dumps(job_dataset_policy(res, dataset_ids)))


def delete_job_role(res: StackResources, c: Clients, job_id: str) -> bool:
    """Remove the job's role (its inline policies first, as IAM requires); False if it was gone."""
    name = job_role_name(res, job_id)
    for policy in ("job", "datasets"):
        try:
            c.iam.delete_role_policy(RoleName=name, PolicyName=policy)
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
