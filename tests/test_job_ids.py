"""Job ids whose 8 hex digits read like a continuation (issue 24 item 3): ``digits-c1234567`` is
the job ``digits-c1234567``, not the 1234567th continuation of a job ``digits``. Every reader of a
job execution's name — job_of_execution, job_id_from on an ARN, list, attach, resume — finds the
job, for its own execution and for its continuations (``-c{n}``) and resumptions (``-r{n}``)."""

import random

import pytest
import torch
from torch import nn

from stagecoach import Job
from stagecoach.deploy import start
from stagecoach.deploy.resources import JOB_ID, DeployError, job_id_from, job_of_execution, new_job_id
from stagecoach.planner.emit import asl

# "c" and 7 digits (about 0.22% of new_job_id's), and others that end in what looks like a suffix
IDS = ["digits-c1234567", "digits-c0000000", "a-b-c9999999", "x-abcdef12-c7654321", "c1234567-c1234567", "run-c1-0a1b2c3d"]
SUFFIXES = ["", "-c1", "-c12", "-r1", "-r10"]
ARN = "arn:aws:states:eu-west-1:123456789012:execution:mystack-job:{}"


@pytest.mark.parametrize("job_id", IDS)
@pytest.mark.parametrize("suffix", SUFFIXES)
def test_an_executions_job_is_its_id_whatever_its_hex_digits(job_id, suffix):
    assert JOB_ID.fullmatch(job_id)
    assert job_of_execution(job_id + suffix) == job_id
    assert job_id_from(ARN.format(job_id + suffix)) == job_id
    assert job_id_from(job_id) == job_id


def test_every_new_job_id_is_read_back_from_each_of_its_execution_names():
    rng = random.Random(24)
    ids = [new_job_id("digits") for _ in range(2000)]
    ids += [f"digits-c{rng.randrange(10**7):07d}" for _ in range(2000)]  # the 0.22% the old rule misread
    for job_id in ids:
        for suffix in SUFFIXES:
            assert job_of_execution(job_id + suffix) == job_id, job_id + suffix


def test_a_name_that_is_no_job_execution_is_refused():
    with pytest.raises(DeployError, match="is not a job"):
        job_id_from(ARN.format("someone-elses-execution"))


def test_list_attach_and_resume_find_a_job_whose_id_reads_like_a_continuation(backend, monkeypatch):
    """On the local stack: a job named ``ids-c1234567`` that continues as a new execution after
    every window (1 iteration each), resumed to more iterations (``-r1``, which continues too)."""
    job_id = "ids-c1234567"
    monkeypatch.setattr(start, "new_job_id", lambda name: job_id)
    monkeypatch.setattr(asl, "window_length", lambda plan, limit=asl.HISTORY_LIMIT, **kw: 1)
    monkeypatch.setattr(asl, "windows_per_execution", lambda limit=asl.HISTORY_LIMIT: 1)
    g = torch.Generator().manual_seed(3)

    def job(iterations: int) -> Job:
        return Job(
            name="ids",
            model=lambda: nn.Sequential(nn.Linear(4, 3)),
            loss=nn.CrossEntropyLoss(),
            optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
            train=(torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)),
            global_batch=4,
            iterations=iterations,
        )

    run = job(2).run(backend=backend, stages=1)
    assert run.job_id == job_id and run.wait(progress=False, poll_s=0.2, timeout_s=600) == "SUCCEEDED"
    assert [a.rsplit(":", 1)[-1] for a in run.executions()] == [job_id, f"{job_id}-c1"]
    assert job_id_from(run.executions()[-1]) == job_id
    listed = [j for j in backend.jobs() if j.job.startswith("ids-")]
    assert [(j.job, j.name, j.status, j.iterations) for j in listed] == [(job_id, "ids", "SUCCEEDED", 2)]
    attached = backend.attach(job_id)
    assert attached.status() == "SUCCEEDED" and len(attached.losses()) == 2

    resumed = backend.resume(job_id, iterations=4, job=job(2))
    assert resumed.execution_arn.endswith(f":{job_id}-r1")
    assert resumed.wait(progress=False, poll_s=0.2, timeout_s=600) == "SUCCEEDED"
    # the resumption continued too, under a name of its own (its first continuation is the chain's second)
    assert [a.rsplit(":", 1)[-1] for a in resumed.executions()] == [f"{job_id}-r1", f"{job_id}-c2"]
    assert job_id_from(resumed.executions()[-1]) == job_id
    listed = [j for j in backend.jobs() if j.job.startswith("ids-")]
    assert [(j.job, j.status, j.iterations) for j in listed] == [(job_id, "SUCCEEDED", 4)]
    assert len(backend.attach(job_id).losses()) == 4
