"""Attach, resume and list (issue 15 item 5): a finished job continued to more iterations ends
bit-identical to one that ran them all at once (data order, dropout masks, the schedule and Adam's
state are all functions of the seed and the iteration); a job is found from anywhere by its id.
"""

import time

import pytest
import torch
from torch import nn

from stagecoach import Job
from stagecoach.deploy.resources import DeployError
from stagecoach.deploy.resume import last_checkpoint

G = torch.Generator().manual_seed(23)
X, Y = torch.randn(48, 6, generator=G), torch.randint(0, 3, (48,), generator=G)


def make_job(name: str, iterations: int) -> Job:
    return Job(
        name=name,
        model=lambda: nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.1), nn.Linear(16, 3)),
        loss=nn.CrossEntropyLoss(),
        optimizer=lambda p: torch.optim.Adam(p, lr=0.01),
        scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5),
        train=(X, Y),
        global_batch=12,
        iterations=iterations,
        seed=5,
    )


PLAN = dict(stages=2, replicas=2, micro_batches=2)


@pytest.mark.slow  # three runs; the default set resumes a stopped job (below)
def test_a_resumed_job_ends_bit_identical_to_an_uninterrupted_one(backend):
    """One replica, warm state: the resumed tasks land in the first run's warm containers, which
    must read the rewritten spec (8 iterations) to store version 8 as the final checkpoint."""
    one = dict(stages=2, micro_batches=2)
    whole = make_job("life-whole", 8).run(backend=backend, **one)
    first = make_job("life-part", 4).run(backend=backend, **one)
    for run in (whole, first):
        run.wait(progress=False, poll_s=2.0, timeout_s=600)
    assert last_checkpoint(backend.clients, backend.resources.bucket, first.job_id) == 4
    with pytest.raises(DeployError, match="already: give --iterations above 4"):
        backend.resume(first.job_id)
    resumed = backend.resume(first.job_id, iterations=8, job=make_job("life-part", 4))
    assert resumed.execution_arn.endswith(f"{first.job_id}-r1") and resumed.job.iterations == 8
    resumed.wait(progress=False, poll_s=2.0, timeout_s=600)
    got, want = resumed.trained_model().state_dict(), whole.trained_model().state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)  # bit for bit
    assert resumed.losses() == whole.losses()  # iterations 0-3 from the first execution, 4-7 from the resumption
    # attach finds it from its id alone; list shows both jobs
    attached = backend.attach(first.job_id)
    assert attached.status() == "SUCCEEDED" and len(attached.losses()) == 8
    with pytest.raises(ValueError, match="attached without its Job"):
        attached.trained_model()
    listed = {j.job: j for j in backend.jobs()}
    assert listed[first.job_id].status == "SUCCEEDED" and listed[first.job_id].iterations == 8
    assert listed[whole.job_id].name == "life-whole"
    with pytest.raises(DeployError, match="no job life-none-1a2b3c4d"):
        backend.attach("life-none-1a2b3c4d")


def test_a_stopped_job_resumes_to_the_parameters_of_an_uninterrupted_one(backend):
    """Stopped at an iteration boundary (Run.stop: the iteration gate), listed as STOPPED, then
    resumed to 3 iterations past the checkpoint it kept: bit-identical to those iterations at once."""
    long = make_job("life-stop", 1000).run(backend=backend, **PLAN)  # far more than it runs before the stop
    while not long.metrics() or long.iterations_done() < 2:  # metrics() reads what the tasks wrote so far
        time.sleep(0.5)
    long.stop()
    assert long.wait(progress=False, poll_s=1.0, timeout_s=600) == "STOPPED"
    assert {j.job: j.status for j in backend.jobs()}[long.job_id] == "STOPPED"
    kept = long.version()
    assert 0 <= kept <= long.iterations_done()
    total = kept + 3
    whole = make_job("life-whole2", total).run(backend=backend, **PLAN)
    resumed = backend.resume(long.job_id, iterations=total, job=make_job("life-stop", 1000))
    assert resumed.wait(progress=False, poll_s=2.0, timeout_s=600) == "SUCCEEDED"
    whole.wait(progress=False, poll_s=2.0, timeout_s=600)
    got, want = resumed.trained_model().state_dict(), whole.trained_model().state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
