"""Task timeouts: refused past Lambda's 15 minutes, and refined from the job's past runs (DiSDeL)."""

import json

import pytest
import torch
from torch import nn

from stagecoach import Job, Plan, PlanError
from stagecoach.history import observed_task_seconds
from stagecoach.planner.plan import TIMEOUT_SAFETY, Prediction, timeouts_from


def test_a_phase_predicted_past_15_minutes_is_refused_with_what_to_change():
    with pytest.raises(
        PlanError, match="stage 1's backward task is predicted to take 500 s.*more stages.*more replicas.*smaller micro-batches"
    ):
        Plan(
            balance=[1, 1], prediction=Prediction(task_s=({"backward": 10}, {"backward": 500}), s_per_iteration=510, usd_per_iteration=0.0)
        )
    with pytest.raises(PlanError, match="stage 0's sync task takes 460 s"):
        timeouts_from([{"forward": 1, "backward": 2, "sync": 460}])


def test_timeouts_follow_the_task_seconds():
    t = timeouts_from([{"forward": 0.5, "backward": 100, "sync": 200}])
    assert t == ({"forward": 60, "backward": int(100 * TIMEOUT_SAFETY + 10), "sync": int(200 * TIMEOUT_SAFETY + 10)},)


def test_the_second_run_of_a_job_takes_its_timeouts_from_the_first(backend):
    x, y = torch.randn(32, 4), torch.randint(0, 2, (32,))
    job = Job(
        model=lambda: nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)),
        loss=nn.CrossEntropyLoss(),
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        train=(x, y),
        global_batch=8,
        iterations=3,
        name="timeouts-twice",
    )
    first = job.run(stages=2, replicas=2, backend=backend)
    first.wait(progress=False, poll_s=0.2)
    assert first.plan.timeouts_s[0]["backward"] == 300  # the manual plan's default
    second = job.run(stages=2, replicas=2, backend=backend)
    second.wait(progress=False, poll_s=0.2)
    observed = observed_task_seconds(first.metrics(), stages=2)
    assert observed[1]["backward"] > 0
    assert second.plan.timeouts_s == timeouts_from(observed)
    # the plan's timeouts hold until the run has learnt its own (lambdas/timeouts.py): iteration 0
    events = second.history(execution_arn=second.window_executions()[0])
    scheduled = [e["taskScheduledEventDetails"] for e in events if e["type"] == "TaskScheduled"]
    first = next(
        d for d in scheduled if json.loads(d["parameters"])["Payload"].get("phase") == "backward" and '"stage": 1' in d["parameters"]
    )
    assert first["timeoutInSeconds"] == second.plan.timeouts_s[1]["backward"] < 300
