"""Deploy calls that converge: create, or bring what exists to the spec; wait until Active."""

from __future__ import annotations

from typing import Any

from botocore.exceptions import WaiterError

from stagecoach.deploy.resources import BotoClient, DeployError


# --------------------------------------------------------------------- idempotent deploy calls
def ensure_function(client: BotoClient, spec: dict[str, Any], wait: bool = True) -> dict[str, Any]:
    """Create the function, or bring an existing one to ``spec`` (code, then configuration, tags).

    Launching again with the same job id (a retried ``launch``) then converges instead of failing
    on ResourceConflictException. With ``wait``, returns once the function is Active: an image
    function is Pending for a while after creation and Lambda rejects invocations until then.
    """
    name = spec["FunctionName"]
    out: dict[str, Any]  # the function's configuration (boto3's responses are untyped)
    try:
        out = client.create_function(**spec)
    except client.exceptions.ResourceConflictException:
        wait_function(client, name, "function_updated_v2")
        code = {"FunctionName": name, "ImageUri": spec["Code"]["ImageUri"]}
        if "Architectures" in spec:
            code["Architectures"] = spec["Architectures"]
        client.update_function_code(**code)
        wait_function(client, name, "function_updated_v2")
        conf_keys = ("Role", "MemorySize", "Timeout", "Environment", "ImageConfig", "LoggingConfig", "TracingConfig", "Description")
        client.update_function_configuration(FunctionName=name, **{k: spec[k] for k in conf_keys if k in spec})
        if spec.get("Tags"):
            arn = client.get_function_configuration(FunctionName=name)["FunctionArn"]
            client.tag_resource(Resource=arn, Tags=spec["Tags"])
        out = client.get_function_configuration(FunctionName=name)
    if wait:
        wait_function(client, name)
    return out


def wait_function(client: BotoClient, name: str, *waiters: str) -> None:
    """Wait until the function is Active and its last update done; a function that ends Failed
    (e.g. Lambda may not pull the image) raises DeployError with Lambda's reason."""
    for waiter in waiters or ("function_active_v2", "function_updated_v2"):
        try:
            client.get_waiter(waiter).wait(FunctionName=name, WaiterConfig={"Delay": 2, "MaxAttempts": 300})
        except WaiterError:
            conf = client.get_function_configuration(FunctionName=name)
            reason = (
                f"{conf.get('StateReasonCode') or conf.get('LastUpdateStatusReasonCode') or ''}: "
                f"{conf.get('StateReason') or conf.get('LastUpdateStatusReason') or 'no reason given'}"
            )
            hint = ""
            if "Image" in reason:
                hint = (
                    " The worker image's ECR repository policy must let lambda.amazonaws.com call "
                    "ecr:BatchGetImage and ecr:GetDownloadUrlForLayer (docs/aws.md, 'The worker image')."
                )
            raise DeployError(
                f"Lambda function {name} is {conf.get('State')} (last update {conf.get('LastUpdateStatus')}): {reason}.{hint}"
            ) from None


def ensure_state_machine(client: BotoClient, **spec: Any) -> dict[str, Any]:
    """Create the state machine, or update the existing one of that name (definition and role)."""
    try:
        arn = client.create_state_machine(**spec)["stateMachineArn"]
    except client.exceptions.StateMachineAlreadyExists:
        found = find_state_machine(client, spec["name"])
        if found is None:
            raise
        arn = found
    # CreateStateMachine returns an identical existing machine's ARN instead of failing (and some
    # emulators do so even when it differs): compare, and update what differs.
    d = client.describe_state_machine(stateMachineArn=arn)
    if d.get("definition") != spec["definition"] or d.get("roleArn") != spec["roleArn"]:
        client.update_state_machine(stateMachineArn=arn, definition=spec["definition"], roleArn=spec["roleArn"])
    return {"stateMachineArn": arn}


def find_state_machine(client: BotoClient, name: str) -> str | None:
    """The ARN of the state machine called ``name`` (ListStateMachines, paged), or None."""
    for page in client.get_paginator("list_state_machines").paginate():
        for sm in page["stateMachines"]:
            if sm["name"] == name:
                return str(sm["stateMachineArn"])
    return None


class _Delegate:
    """Passes every call to the wrapped client except the ones a subclass overrides."""

    def __init__(self, client: BotoClient) -> None:
        self._client = client

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


class IdempotentLambda(_Delegate):
    """create_function -> :func:`ensure_function`; adds the stack's shared log group (retention).

    With ``pending`` (a list shared with :class:`IdempotentStepFunctions`), creations do not wait:
    the names are collected and waited for together just before the job starts, so the stages'
    images are optimised by Lambda at the same time rather than one after the other.
    """

    def __init__(self, client: BotoClient, log_group: str | None = None, wait: bool = True, pending: list[str] | None = None) -> None:
        super().__init__(client)
        self._log_group = log_group
        self._wait = wait and pending is None
        self._pending = pending

    def create_function(self, **spec: Any) -> dict[str, Any]:
        if self._log_group and "LoggingConfig" not in spec:
            # all workers log into the stack's log group, which has the stack's retention; the
            # worker role may write only there (no logs:CreateLogGroup)
            spec["LoggingConfig"] = {"LogFormat": "JSON", "LogGroup": self._log_group}
        spec.setdefault("TracingConfig", {"Mode": "Active"})
        out = ensure_function(self._client, spec, wait=self._wait)
        if self._pending is not None:
            self._pending.append(spec["FunctionName"])
        return out


class IdempotentStepFunctions(_Delegate):
    """create_state_machine -> :func:`ensure_state_machine`; start_execution first waits until
    every function in ``pending`` is Active (a Pending function rejects invocations)."""

    def __init__(self, client: BotoClient, lambda_client: BotoClient = None, pending: list[str] | None = None) -> None:
        super().__init__(client)
        self._lambda = lambda_client
        self._pending = pending if pending is not None else []

    def create_state_machine(self, **spec: Any) -> dict[str, Any]:
        return ensure_state_machine(self._client, **spec)

    def start_execution(self, **kw: Any) -> dict[str, Any]:
        while self._pending:
            wait_function(self._lambda, self._pending[0])
            self._pending.pop(0)
        started: dict[str, Any] = self._client.start_execution(**kw)
        return started
