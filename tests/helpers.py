"""Shared helpers: test functions and state machines on the local stack, waiting for executions,
the small job the reliability tests break, and comparing what runs trained."""

import json
import os
import time
import uuid

import torch
from torch import nn

from stagecoach import Job

HANDLERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "handlers")


def create_function(backend, handler: str, memory_mb: int = 512, timeout_s: int = 30, name: str | None = None) -> str:
    """A Lambda function (image package, like the workers) whose handler lives in tests/handlers."""
    c, res = backend.clients, backend.resources
    name = name or f"test-{handler.split('.')[0]}-{uuid.uuid4().hex[:6]}"
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


def task_machine(fn: str, timeout_s: int = 60, retry: list | None = None) -> dict:
    """A state machine of one Task that invokes ``fn`` with its input, retried as ``retry`` says."""
    task = {
        "Type": "Task",
        "Resource": "arn:aws:states:::lambda:invoke",
        "Parameters": {"FunctionName": fn, "Payload.$": "$"},
        "TimeoutSeconds": timeout_s,
    }
    if retry:
        task["Retry"] = retry
    return {"StartAt": "T", "States": {"T": {**task, "End": True}}}


def watcher_events(events: list) -> list:
    """The events of the phase watchers' Tasks (lambdas/watcher.py; a ``Watch*`` state and what
    chains back to it by previousEventId): on moto an abandoned watcher's end comes late or not at
    all (docs/local-stack.md), so a count of a window's events leaves them out."""
    by_id = {e["id"]: e for e in events}
    out = []
    for e in events:
        cur = e
        for _ in range(8):
            name = (cur.get("stateEnteredEventDetails") or {}).get("name")
            if name is not None:
                if name.startswith("Watch"):
                    out.append(e)
                break
            cur = by_id.get(cur.get("previousEventId"), {})
    return out


def task_failure(events: list) -> dict:
    """The last TaskFailed event's details in an execution's history (there must be one)."""
    failed = [e for e in events if e["type"] == "TaskFailed"]
    assert failed, [e["type"] for e in events]
    return failed[-1]["taskFailedEventDetails"]


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
            run.wait(progress=False, poll_s=0.2, timeout_s=900)
        done.update(started)
    return done


def recovery_job(name: str, warm: bool = True) -> Job:
    """The small job whose runs under faults are compared with a fault-free run: dropout draws
    random numbers, so a retried task or restarted window that replays them wrongly shows, and
    Adam's state must survive a restart as the parameters do."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(64, 6, generator=g)
    y = torch.randint(0, 3, (64,), generator=g)
    model = lambda: nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.1), nn.Linear(16, 3))
    return Job(
        model=model,
        loss=nn.CrossEntropyLoss(),
        optimizer=lambda p: torch.optim.Adam(p, lr=0.01),
        train=(x, y),
        global_batch=16,
        iterations=5,
        seed=5,
        name=name,
        warm_state=warm,
    )


def tiny_job(name: str, iterations: int = 2, **options) -> Job:
    """The smallest job the CLI tests drive: a 4-8-2 MLP on 16 random samples, batches of 8."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 4, generator=g), torch.randint(0, 2, (16,), generator=g)
    return Job(
        model=lambda: nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)),
        loss=nn.CrossEntropyLoss(),
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        train=(x, y),
        global_batch=8,
        iterations=iterations,
        seed=0,
        name=name,
        **options,
    )


def task_errors(r, watchers: bool = False) -> list[str]:
    """The error of every failed or timed-out task in every window execution of the run; with
    ``watchers`` also the phase watchers' PhaseDone (lambdas/watcher.py), which is no failure."""
    errors = []
    for arn in r.window_executions():
        for ev in r.history(execution_arn=arn):
            det = ev.get("taskFailedEventDetails") or ev.get("taskTimedOutEventDetails")
            if det and (watchers or det.get("error") != "PhaseDone"):
                errors.append(det.get("error", ""))
    return errors


def window_statuses(r) -> list[str]:
    """The status of each of the run's window executions (a restarted window adds one)."""
    return [r._c.sfn.describe_execution(executionArn=a)["status"] for a in r.window_executions()]


def same_parameters(a: nn.Module, b: nn.Module) -> bool:
    """Bit-identical parameters."""
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def max_diff(a: nn.Module, b: nn.Module) -> float:
    """The largest absolute difference between corresponding parameters."""
    return max(float((p - q).detach().abs().max()) for p, q in zip(a.parameters(), b.parameters()))
