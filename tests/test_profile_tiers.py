"""The worker handler's profile phase, run once per memory tier through the stack (here: local)."""

import pytest
import torch
from torch import nn

from stagecoach import Job
from stagecoach.core.profiling import measure_model
from stagecoach.profile_tiers import profile_tiers


def make_job() -> Job:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 32, generator=g)
    y = torch.randint(0, 4, (64,), generator=g)
    return Job(
        model=lambda: nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)),
        loss=nn.CrossEntropyLoss(),
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        train=(x, y),
        global_batch=32,
        iterations=4,
        seed=0,
        name="prof",
    )


def test_each_tier_is_measured_inside_a_function_of_that_memory_and_nothing_is_left(backend):
    job = make_job()
    before = {f["FunctionName"] for f in backend.clients.lambda_.list_functions()["Functions"]}
    prof = profile_tiers(job, backend, tiers=(512, 2048), micro_batch_sizes=(1, 2))
    here = measure_model(job.build_model(), job.train[0][0], micro_batch_sizes=(1, 2))
    assert [l.param_bytes for l in prof.layers] == [l.param_bytes for l in here.layers]
    for layer in prof.layers:
        assert set(layer.tier_s) == {512, 2048}
        assert all(set(v) == {1, 2} and all(t > 0 for pair in v.values() for t in pair) for v in layer.tier_s.values())
    after = {f["FunctionName"] for f in backend.clients.lambda_.list_functions()["Functions"]}
    assert after == before, "the profiling functions are removed"
    listing = backend.clients.s3.list_objects_v2(Bucket=backend.resources.bucket, Prefix="jobs/prof-")
    assert not [o["Key"] for o in listing.get("Contents", []) if "-prof/" in o["Key"]]


def test_a_tier_lambda_cannot_have_is_refused_before_anything_is_created(backend):
    with pytest.raises(ValueError, match="128-10240 MB"):
        profile_tiers(make_job(), backend, tiers=(64,))


def test_profile_function_names_are_checked_against_lambda_s_64_characters_before_anything_is_made(backend):
    """A 20-character stack and a 30-character job name make "-prof-s<i>" names of 68 characters."""
    from stagecoach.backend import Backend
    from stagecoach.deploy.resources import DeployError, StackResources

    class LongStack(Backend):
        name = "local"

        def __init__(self, real):
            self.real, self.clients = real, real.clients
            self.resources = StackResources(**{**real.resources.__dict__, "prefix": "s" * 20})

        def long_call_client(self, service):
            return self.real.long_call_client(service)

    job = make_job()
    job.name = "j" * 30
    before = {f["FunctionName"] for f in backend.clients.lambda_.list_functions()["Functions"]}
    with pytest.raises(DeployError, match=r"would be 6\d characters \(Lambda allows 64\)"):
        profile_tiers(job, LongStack(backend), tiers=(512,))
    assert {f["FunctionName"] for f in backend.clients.lambda_.list_functions()["Functions"]} == before
