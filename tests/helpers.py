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


def capped_backend():
    """A local stack of its own whose worker processes are capped at what this machine's memory
    holds (Fidelity.max_environments: the longest-idle, i.e. finished runs', shut down first). For
    modules that run many jobs: with warm state and d > 1 every worker is a process of its own."""
    from stagecoach.local.backend import LocalBackend
    from stagecoach.local.fidelity import Fidelity, default_max_environments

    return LocalBackend(fidelity=Fidelity(max_environments=default_max_environments()))


def run_in_waves(starts: dict, wave: int) -> dict:
    """Start the runs ``wave`` at a time (each start a no-argument call returning a Run), waiting
    for a wave to end before the next starts, so the cap above never meets a running job's workers."""
    done, items = {}, list(starts.items())
    for w in range(0, len(items), wave):
        started = {key: start() for key, start in items[w : w + wave]}
        for run in started.values():
            run.wait(progress=False, poll_s=2.0, timeout_s=900)
        done.update(started)
    return done
