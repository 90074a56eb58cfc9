"""Finding a deployed stack by its CloudFormation outputs, with errors that say what to do."""

from __future__ import annotations

import sys
import tomllib

from botocore.exceptions import ClientError

from stagecoach.aws.access import AccessDenied
from stagecoach.deploy.resources import BotoClient, DeployError

REQUIRED_OUTPUTS = ("BucketName", "ControlRoleArn", "StatesRoleArn", "JobStateMachineArn", "JobRoleBoundaryArn", "WorkerLogGroupName")
USABLE_STATUSES = {"CREATE_COMPLETE", "UPDATE_COMPLETE", "UPDATE_ROLLBACK_COMPLETE", "IMPORT_COMPLETE", "IMPORT_ROLLBACK_COMPLETE"}


class StackError(DeployError):
    """The stack cannot be used: not found, in another region, not a Stagecoach stack, not ready.

    A DeployError, so every caller that reports a failed deployment (``stagecoach train``) reports
    these too, as a message rather than a traceback.
    """


class StackNotFound(StackError):
    pass


class RegionMismatch(StackError):
    pass


# ----------------------------------------------------------------------------------- backend
def _arn_part(arn: str, i: int) -> str:
    parts = arn.split(":")
    return parts[i] if arn.startswith("arn:") and len(parts) > 5 else ""


def _arn_region(arn: str) -> str:
    return _arn_part(arn, 3)


def _arn_account(arn: str) -> str:
    return _arn_part(arn, 4)


def _samconfig_region(stack: str, path: str = "samconfig.toml") -> str | None:
    """The region ``sam deploy --guided`` recorded for ``stack`` (samconfig.toml in the cwd)."""
    try:
        with open(path, "rb") as f:
            conf = tomllib.load(f)
    except (OSError, ValueError):
        return None
    for env in conf.values():
        if not isinstance(env, dict):
            continue
        params = env.get("deploy", {}).get("parameters", {})
        if params.get("stack_name") == stack and params.get("region"):
            return str(params["region"])
    return None


def python_version() -> str:
    """This interpreter's "major.minor": the worker image must run the same (cloudpickle)."""
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def stack_outputs(cfn: BotoClient, stack: str, region: str) -> dict[str, str]:
    """The stack's outputs; a missing, unfinished or foreign stack raises StackError saying what to do."""
    try:
        stacks = cfn.describe_stacks(StackName=stack)["Stacks"]
    except AccessDenied:
        raise
    except ClientError as e:
        if "does not exist" not in str(e):
            raise
        elsewhere = _samconfig_region(stack)
        if elsewhere and elsewhere != region:
            raise RegionMismatch(
                f"stack {stack!r} is not in {region}; samconfig.toml says it was deployed to {elsewhere}: "
                f"pass --region {elsewhere} (or set AWS_REGION={elsewhere})"
            ) from None
        raise StackNotFound(
            f"no CloudFormation stack {stack!r} in {region}. Deploy it with "
            f"`sam build && sam deploy --guided --stack-name {stack} --region {region}` (docs/aws.md), "
            f"or pass the region it lives in with --region"
        ) from None
    st = stacks[0]
    status = str(st.get("StackStatus"))
    if status not in USABLE_STATUSES:
        why = f" ({st['StackStatusReason']})" if st.get("StackStatusReason") else ""
        if status.endswith("_IN_PROGRESS"):
            todo = "wait until it is complete (sam deploy shows its progress)"
        elif status in ("ROLLBACK_COMPLETE", "ROLLBACK_FAILED", "CREATE_FAILED", "DELETE_FAILED"):
            todo = (
                f"it never deployed: read its events in the CloudFormation console, then `sam delete --stack-name {stack}` and deploy again"
            )
        else:
            todo = "fix it: its events in the CloudFormation console say what failed"
        raise StackError(f"stack {stack!r} is {status}{why}: {todo}")
    outputs = {o["OutputKey"]: o["OutputValue"] for o in st.get("Outputs", [])}
    missing = [k for k in REQUIRED_OUTPUTS if k not in outputs]
    if "WorkerImageUri" not in outputs and "WorkerFunctionName" not in outputs:
        missing.append("WorkerImageUri or WorkerFunctionName")
    if missing:
        raise StackError(
            f"stack {stack!r} lacks the outputs {missing}: is it deployed from Stagecoach's template.yaml? "
            "A stack deployed by an older Stagecoach lacks the per-job role outputs: `sam build && sam deploy` it again"
        )
    stack_region = outputs.get("Region") or _arn_region(outputs["JobStateMachineArn"])
    if stack_region and stack_region != region:
        raise RegionMismatch(f"stack {stack!r} reports region {stack_region} but the SDK uses {region}: pass --region {stack_region}")
    return outputs
