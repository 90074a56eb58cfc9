"""AccessDenied that names the IAM action, the resource and the deployer-policy statement to add."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from botocore.exceptions import ClientError

from stagecoach.aws.policy import deployer_policy
from stagecoach.deploy.iam_policy import arn_matches
from stagecoach.deploy.resources import BotoClient, DeployError

DENIED_CODES = {"AccessDenied", "AccessDeniedException", "UnauthorizedOperation", "AuthorizationError", "UnauthorizedAccess", "403"}


class AccessDenied(ClientError, DeployError):  # type: ignore[misc]  # botocore ships no types: ClientError is Any to mypy
    """An AWS call was denied; the message says which action on which resource, and the fix.

    A ClientError subclass so code that handles ClientError (e.g. deploy's cleanup on failure)
    keeps working, and a DeployError so ``stagecoach train`` prints it instead of a traceback;
    ``action``, ``resource``, ``statement`` and ``explicit_deny`` are there for programs.
    """

    def __init__(
        self,
        response: dict[str, Any],
        operation: str,
        action: str,
        resource: str,
        statement: dict[str, Any] | None,
        stack: str,
        covered: bool = True,
    ) -> None:
        super().__init__(response, operation)
        self.action = action
        self.resource = resource
        self.statement = statement
        self.stack = stack
        self.covered = covered  # the statement's resources include ``resource``
        msg = str(response.get("Error", {}).get("Message", ""))
        self.explicit_deny = "explicit deny" in msg.lower()

    def __str__(self) -> str:
        msg = self.response.get("Error", {}).get("Message", "")
        head = f"AccessDenied: {self.action} on {self.resource} was denied"
        if msg:
            head += f" ({msg})"
        if self.explicit_deny:
            return (
                head + ". An explicit Deny (a service control policy, permissions boundary, session policy or "
                "resource policy) blocks it: an Allow statement cannot override that; ask your administrator."
            )
        if self.statement is None:
            return head + f". {self.action} is not part of the Stagecoach deployer policy; check SCPs and permission boundaries."
        if not self.covered:
            return (
                f"{head}. The deployer policy grants {self.action} only on {self.statement['Resource']} "
                f"(statement {self.statement['Sid']!r} of docs/deployer-policy.json): is {self.resource} a resource "
                f"of stack {self.stack!r}?"
            )
        return (
            f"{head}. Add the statement {self.statement['Sid']!r} of docs/deployer-policy.json to the policy of the "
            f"identity running the SDK (for stack {self.stack!r}):\n{json.dumps(self.statement, indent=2)}"
        )


_S3_ACTIONS = {
    "ListObjectsV2": "s3:ListBucket",
    "ListObjects": "s3:ListBucket",
    "HeadObject": "s3:GetObject",
    "DeleteObjects": "s3:DeleteObject",
    "HeadBucket": "s3:ListBucket",
}


_PREFIX = {
    "s3": "s3",
    "lambda": "lambda",
    "sfn": "states",
    "cloudformation": "cloudformation",
    "iam": "iam",
    "ecr": "ecr",
    "sts": "sts",
    "logs": "logs",
}


# Not a missing permission: bad or expired credentials, wrong clock. Reported as they are.
_CREDENTIAL_CODES = {
    "SignatureDoesNotMatch",
    "InvalidClientTokenId",
    "ExpiredToken",
    "ExpiredTokenException",
    "InvalidAccessKeyId",
    "UnrecognizedClientException",
    "RequestExpired",
    "InvalidToken",
    "IncompleteSignature",
    "MissingAuthenticationToken",
}


def iam_action(service: str, operation: str) -> str:
    """The IAM action an API operation needs (S3's few renamed ones included)."""
    if service == "s3" and operation in _S3_ACTIONS:
        return _S3_ACTIONS[operation]
    return f"{_PREFIX.get(service, service)}:{operation}"


def _resource_of(service: str, params: dict[str, Any], region: str, account: str, partition: str = "aws") -> str:
    """Best-effort ARN of what a call touched, from its parameters (the error rarely says)."""
    arn = f"arn:{partition}"
    if service == "s3":
        b = params.get("Bucket", "*")
        return f"{arn}:s3:::{b}/{params['Key']}" if "Key" in params else f"{arn}:s3:::{b}"
    if service == "lambda" and "FunctionName" in params:
        name = params["FunctionName"]
        return name if name.startswith("arn:") else f"{arn}:lambda:{region}:{account}:function:{name}"
    if service == "sfn":
        for k in ("executionArn", "stateMachineArn", "resourceArn"):
            if k in params:
                return str(params[k])
        if "name" in params:
            return f"{arn}:states:{region}:{account}:stateMachine:{params['name']}"
    if service == "cloudformation" and "StackName" in params:
        return f"{arn}:cloudformation:{region}:{account}:stack/{params['StackName']}/*"
    return "*"


def statement_for(
    action: str, stack: str, region: str, account: str, resource: str = "*", policy: dict[str, Any] | None = None
) -> tuple[dict[str, Any] | None, bool]:
    """The deployer-policy statement granting ``action``, rendered for this stack, and whether its
    resources cover ``resource`` (a statement naming the action for other resources only means the
    call touched something that is not the stack's)."""
    pol = policy or deployer_policy(stack, region, account)
    candidates = [st for st in pol["Statement"] if action in st["Action"]]
    for st in candidates:
        rs = st["Resource"] if isinstance(st["Resource"], list) else [st["Resource"]]
        if resource == "*" or any(arn_matches(r, resource) or "${" in r for r in rs):
            return st, True
    return (candidates[0], False) if candidates else (None, True)


_NOT_AUTHORIZED = re.compile(r"not authorized to perform:? ([\w-]+:\w+)(?: on resource:? \"?([^\s\"]+)\"?)?")


def explain_access_denied(
    client: BotoClient, stack: str, region: str, account: str, policy: Callable[[], dict[str, Any]] | None = None
) -> None:
    """Make ``client`` raise :class:`AccessDenied` (action, resource, policy statement) on a denial.

    botocore events, not a wrapper: they also see the calls paginators and waiters make.
    ``policy``: the deployer policy rendered for the stack (called when a denial happens).
    """
    service = client.meta.service_model.service_name  # "stepfunctions" for Step Functions (IAM: "states")
    service_key = {"stepfunctions": "sfn", "states": "sfn"}.get(service, service)
    partition = client.meta.partition or "aws"

    def remember(params: dict[str, Any], context: dict[str, Any], **_: Any) -> None:
        context["stagecoach_params"] = dict(params)

    def check(http_response: Any, parsed: dict[str, Any], model: Any, context: dict[str, Any], **_: Any) -> None:
        if http_response is None or http_response.status_code < 300:
            return
        err = parsed.get("Error", {}) or {}
        code = str(err.get("Code", ""))
        if code in _CREDENTIAL_CODES:
            return
        # S3 answers a denied HEAD request with a bare 403 (no body, so no error code)
        bare_head_403 = code in ("", "Forbidden") and http_response.status_code == 403 and service_key == "s3"
        if code not in DENIED_CODES and not bare_head_403:
            return
        params = context.get("stagecoach_params", {})
        found = _NOT_AUTHORIZED.search(str(err.get("Message", "")))
        action = found.group(1) if found else iam_action(service_key, model.name)
        resource = found.group(2).rstrip(".") if found and found.group(2) else _resource_of(service_key, params, region, account, partition)
        st, covered = statement_for(action, stack, region, account, resource, policy() if policy else None)
        raise AccessDenied(parsed, model.name, action, resource, st, stack, covered)

    client.meta.events.register("provide-client-params", remember)
    client.meta.events.register("after-call", check)
