"""Shared helpers: test functions on the local stack, and waiting for executions."""

import json
import os
import time
import uuid

HANDLERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "handlers")


def create_function(backend, handler: str, memory_mb: int = 512, timeout_s: int = 30) -> str:
    """A Lambda function (image package, like the workers) whose handler lives in tests/handlers."""
    c, res = backend.clients, backend.resources
    name = f"test-{handler.split('.')[0]}-{uuid.uuid4().hex[:6]}"
    c.lambda_.create_function(
        FunctionName=name,
        Role=res.control_role_arn,
        PackageType="Image",
        Code={"ImageUri": res.image_uri},
        ImageConfig={"Command": [handler]},
        Timeout=timeout_s,
        MemorySize=memory_mb,
        Environment={"Variables": {"PYTHONPATH": HANDLERS}},
    )
    return name


def run_state_machine(backend, definition: dict, payload: dict, timeout_s: float = 120) -> tuple[dict, list]:
    c, res = backend.clients, backend.resources
    arn = c.sfn.create_state_machine(name=f"test-{uuid.uuid4().hex[:8]}", definition=json.dumps(definition), roleArn=res.states_role_arn)[
        "stateMachineArn"
    ]
    ex = c.sfn.start_execution(stateMachineArn=arn, input=json.dumps(payload))["executionArn"]
    deadline = time.time() + timeout_s
    while (d := c.sfn.describe_execution(executionArn=ex))["status"] == "RUNNING":
        assert time.time() < deadline, "execution did not finish"
        time.sleep(0.2)
    events = []
    for page in c.sfn.get_paginator("get_execution_history").paginate(executionArn=ex):
        events += page["events"]
    return d, events


def selected(request, param: str) -> set:
    """The values of ``param`` among the requesting module's selected tests: a module-scoped
    fixture starts only the runs those tests need (``-k`` and ``-m`` deselect the rest); another
    module's parameters of the same name (which need not be hashable) are not looked at."""
    items = [i for i in request.session.items if i.path == request.path and getattr(i, "callspec", None)]
    return {i.callspec.params[param] for i in items if param in i.callspec.params}
