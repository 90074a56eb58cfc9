"""Bad input is refused at the earliest point with a clear error, and leaves nothing behind.

Job and plan errors are raised in the SDK before any AWS call; a failure during deployment removes
what was already created. (Malformed worker events: tests/test_handler.py; a layer too big for
10 GB: tests/planner.)
"""

import pytest
import torch
from torch import nn

from stagecoach import Job, JobError, Plan, PlanError
from stagecoach.backend import Backend
from stagecoach.deploy.resources import DeployError, StackResources

X = torch.randn(32, 4)
Y = torch.randint(0, 2, (32,))


def good(**change):
    kw = dict(
        model=lambda: nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)),
        loss=nn.CrossEntropyLoss(),
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        train=(X, Y),
        global_batch=8,
        iterations=3,
        name="bad",
    )
    kw.update(change)
    return Job(**kw)


class NotTensorBlock(nn.Module):
    def forward(self, x):
        return x, "x"


JOB_CASES = [
    (dict(model=lambda: nn.Linear(4, 2)), "not an nn.Sequential"),
    (dict(model=lambda: 1 / 0), "job.model\\(\\) fails"),
    (dict(model=lambda: nn.Sequential(nn.Linear(4, 4), NotTensorBlock())), "block 1 \\(NotTensorBlock\\) returned tuple holding str"),
    (dict(model=lambda: nn.Sequential()), "empty nn.Sequential"),
    (dict(model=lambda: nn.Sequential(nn.Linear(5, 2))), "block 0 \\(Linear\\) fails on a sample batch"),
    (dict(iterations=0), "job.iterations=0"),
    (dict(seed=-1), "job.seed=-1"),
    (dict(global_batch=64), "larger than the training set"),
    (dict(train=X), "without labels"),
    (dict(train=(X, Y[:10])), "32 inputs but 10 labels"),
    (dict(loss=nn.CrossEntropyLoss(reduction="none")), "scalar"),
    (dict(optimizer="adamw2"), "optimizer='adamw2' is not callable"),
    (dict(optimizer=lambda p: "sgd"), "not a torch.optim.Optimizer"),
    (dict(name="My Job"), "job name"),
    (dict(dtype=torch.float16), "use torch.float32, torch.float64, or torch.bfloat16"),
]


def resources(backend):
    c, res = backend.clients, backend.resources
    objects = c.s3.list_objects_v2(Bucket=res.bucket, Prefix="jobs/").get("KeyCount", 0)
    functions = len(c.lambda_.list_functions()["Functions"])
    machines = len(c.sfn.list_state_machines()["stateMachines"])
    return objects, functions, machines


@pytest.mark.parametrize("change, message", JOB_CASES, ids=[m for _, m in JOB_CASES])
def test_bad_jobs_are_refused_before_anything_is_created(backend, change, message):
    before = resources(backend)
    with pytest.raises(JobError, match=message):
        good(**change).run(stages=1, backend=backend)
    assert resources(backend) == before


PLAN_CASES = [
    (dict(replicas=3), "not divisible into 3 replicas"),
    (dict(micro_batches=3), "not divisible"),
    (dict(stages=4), "cannot split 3 layers into 4 stages"),
    (dict(memory_mb=64), "128-10240 MB"),
    (dict(memory_mb=20480), "128-10240 MB"),
    (dict(timeout_s=1200), "more stages, more replicas or smaller micro-batches"),
]


@pytest.mark.parametrize("manual, message", PLAN_CASES, ids=[m for _, m in PLAN_CASES])
def test_bad_manual_plans_are_refused_before_anything_is_created(backend, manual, message):
    before = resources(backend)
    with pytest.raises(PlanError, match=message):
        good().run(backend=backend, **manual)
    assert resources(backend) == before


def test_a_plan_that_does_not_fit_the_model_is_refused(backend):
    before = resources(backend)
    with pytest.raises(PlanError, match="covers 2 layers but the model has 3"):
        good().run(plan=Plan(balance=[1, 1], global_batch=8), backend=backend)
    with pytest.raises(PlanError, match="differs from job.global_batch"):
        good().run(plan=Plan(balance=[3], global_batch=16), backend=backend)
    assert resources(backend) == before


class _Backend(Backend):
    """The real local stack's clients with a stack description that names a missing bucket."""

    name = "local"

    def __init__(self, real, **change):
        self.real = real
        self.clients = real.clients
        self.resources = StackResources(**{**real.resources.__dict__, **change})

    def long_call_client(self, service):
        return self.real.long_call_client(service)


def test_a_missing_bucket_is_named(backend):
    before = resources(backend)
    with pytest.raises(DeployError, match="bucket 'no-such-bucket' is not usable.*sam deploy"):
        good().run(backend=_Backend(backend, bucket="no-such-bucket"))
    assert resources(backend) == before


def test_a_missing_job_state_machine_is_named(backend):
    arn = backend.resources.job_state_machine_arn + "-gone"
    with pytest.raises(DeployError, match="job state machine .*-gone is missing"):
        good().run(backend=_Backend(backend, job_state_machine_arn=arn))


def test_a_failure_midway_through_deployment_leaves_nothing_behind(backend, monkeypatch):
    before = resources(backend)
    sfn = backend.clients.sfn

    def refuse(**kwargs):
        raise sfn.exceptions.InvalidDefinition({"Error": {"Code": "InvalidDefinition", "Message": "no"}}, "CreateStateMachine")

    monkeypatch.setattr(sfn, "create_state_machine", refuse)
    with pytest.raises(sfn.exceptions.InvalidDefinition):
        good().run(stages=2, backend=backend)
    assert resources(backend) == before
