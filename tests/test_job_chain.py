"""A job runs as a chain of executions: windows computed by the job state machine, which continues
as a new execution every windowsPerExecution windows (planner/emit/asl.py job_definition). Run on
the local stack with short windows and short links so the chain has several of each."""

import torch
from torch import nn

from stagecoach import Job
from stagecoach.planner.emit import asl
from stagecoach.reference import train_reference


def test_a_job_continues_as_new_executions_and_trains_exactly_like_pytorch(backend, monkeypatch):
    # 2 iterations per window and 2 windows per execution: 7 iterations are 4 windows in 2 links
    monkeypatch.setattr(asl, "window_length", lambda plan, limit=asl.HISTORY_LIMIT, **kw: 2)
    monkeypatch.setattr(asl, "windows_per_execution", lambda limit=asl.HISTORY_LIMIT: 2)
    g = torch.Generator().manual_seed(11)
    job = Job(
        model=lambda: nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)),
        loss=nn.CrossEntropyLoss(),
        optimizer=lambda p: torch.optim.Adam(p, lr=0.01),
        train=(torch.randn(40, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (40,), generator=g)),
        global_batch=8,
        iterations=7,
        seed=2,
        dtype=torch.float64,
        name="chain",
    )
    run = job.run(stages=2, replicas=2, micro_batches=1, backend=backend)
    assert run.wait(progress=False, poll_s=0.2, timeout_s=600) == "SUCCEEDED"
    links = run.executions()
    assert [a.rsplit(":", 1)[-1] for a in links] == [run.job_id, f"{run.job_id}-c1"]
    windows = sorted(run.window_executions())
    assert len(windows) == 4
    # the first link ran 2 windows and continued: its history is exactly what the emitter counts on
    assert len(run.history(execution_arn=links[0])) == asl.EV_JOB_FIXED + 2 * asl.EV_JOB_WINDOW
    assert len(run.losses()) == 7
    expected = train_reference(job, replicas=2, micro_batches=1)
    trained = run.trained_model()
    assert max(float((p - q).detach().abs().max()) for p, q in zip(trained.parameters(), expected.parameters())) < 1e-9
