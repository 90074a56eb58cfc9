"""Dynamic workers keyed by epoch (issue 27 item 1, docs/runtime.md "Dynamic workers"):
``replicas=stagecoach.dynamic.by_epoch({0: 1, 1: 2})`` (and ``global_batch``, ``lr_scale``, or
``adabatch(by_epoch(...), G)``) runs as the iteration-keyed schedule it converts to, where each
epoch's first batch is taken (core/training.py batch_position), and trains what plain PyTorch (or
the schedule's single-process reference) trains."""

import dataclasses

import pytest
import torch
from helpers import max_diff
from test_dynamic_workers import backward_tasks, make_job

from stagecoach import dynamic
from stagecoach.core.training import batch_position
from stagecoach.dynamic import by_epoch, iteration_keys
from stagecoach.planner.plan import Plan, PlanError
from stagecoach.planner.segments import scheduled_plan
from stagecoach.reference import train_reference, train_reference_schedule


def _scheduled(job, **manual) -> Plan:
    return job.as_run(dynamic.manual_scheduled_plan(job, {"stages": 2, **manual}, job.manual_plan))


def test_a_fixed_batch_s_epoch_keys_are_multiples_of_its_iterations_per_epoch():
    job = make_job("epoch-keys", iterations=10)  # 96 samples, global batch 24: 4 iterations an epoch
    assert iteration_keys(job, {"replicas": by_epoch({0: 1, 1: 2, 2: 4})}) == {"replicas": {0: 1, 4: 2, 8: 4}}
    assert _scheduled(job, replicas=by_epoch({0: 1, 2: 2})) == _scheduled(job, replicas={0: 1, 8: 2})
    assert iteration_keys(job, {"replicas": {0: 1, 3: 2}}) == {"replicas": {0: 1, 3: 2}}  # iteration keys as they were


def test_a_growing_batch_s_epochs_start_where_the_data_order_starts_them():
    """adabatch by epoch: the batch doubles at each epoch, so epoch 1 (G 16) starts after 12
    iterations of 8 and epoch 2 (G 32) after 6 of 16; each key is where batch_position enters that
    epoch at its first sample."""
    job = dataclasses.replace(make_job("epoch-grow", iterations=20), global_batch=8)
    got = iteration_keys(job, dynamic.adabatch(by_epoch({0: 1, 1: 2, 2: 4}), 8))
    assert got == {"replicas": {0: 1, 12: 2, 18: 4}, "global_batch": {0: 8, 12: 16, 18: 32}, "lr_scale": {12: 0.75, 18: 0.75}}
    sizes = sorted(got["global_batch"].items())
    for epoch, first in ((1, 12), (2, 18)):
        assert batch_position(first, 96, sizes)[:2] == (epoch, 0)
        assert batch_position(first - 1, 96, sizes)[0] == epoch - 1


@pytest.mark.parametrize(
    "manual, words",
    [
        ({"replicas": by_epoch({0: 1, 3: 2})}, "epoch 3 starts at or after the job's last iteration"),
        ({"replicas": by_epoch({0: 1, "1": 2})}, "must be an epoch"),
        ({"global_batch": by_epoch({1: 48})}, "add a key 0"),
        ({"global_batch": by_epoch({0: 24, 1: 200})}, "training set"),
        ({"replicas": {"epoch:1": 2, 0: 1}}, "by_epoch"),
    ],
)
def test_what_an_epoch_schedule_cannot_say_is_refused_up_front(manual, words):
    with pytest.raises(PlanError, match=words):
        make_job("epoch-refused", iterations=10).run(stages=2, backend="no-such-backend", **manual)


def test_a_plan_built_without_the_job_refuses_an_epoch_schedule_by_name():
    with pytest.raises(PlanError, match="iteration_keys"):
        scheduled_plan(by_epoch({0: 1, 1: 2}), 10, lambda d: Plan(balance=(3, 2), replicas=d, global_batch=24))


@pytest.fixture(scope="module")
def epoch_runs(backend):
    """A fixed batch d 1 -> 2 at epoch 1 (iteration 4 of 6), and adabatch by epoch with G 32 -> 64
    at epoch 1 (iteration 3 of 5), started together on the session's shared stack (never closed here)."""
    fixed = make_job("epoch-run", iterations=6)
    grow = dataclasses.replace(make_job("epoch-grow-run", iterations=5), global_batch=32)
    runs = {
        "fixed": fixed.run(backend=backend, stages=2, replicas=by_epoch({0: 1, 1: 2})),
        "adabatch": grow.run(backend=backend, stages=2, **dynamic.adabatch(by_epoch({0: 1, 1: 2}), 32)),
    }
    for run in runs.values():
        run.wait(progress=False, poll_s=0.2, timeout_s=900)
    return runs


def test_an_epoch_keyed_change_trains_what_plain_pytorch_trains(epoch_runs):
    run = epoch_runs["fixed"]
    assert run.status() == "SUCCEEDED"
    assert backward_tasks(run) == [1, 1, 1, 1, 2, 2]  # epoch 1 starts at iteration 4 = 96 // 24
    assert max_diff(run.trained_model(), run.job.build_model()) > 1e-3
    assert max_diff(run.trained_model(), train_reference(run.job)) < 1e-5


def test_adabatch_by_epoch_trains_what_its_reference_trains(epoch_runs):
    run = epoch_runs["adabatch"]
    assert run.status() == "SUCCEEDED"
    assert backward_tasks(run) == [1, 1, 1, 2, 2]  # 3 iterations of 32 make epoch 0
    expected = train_reference_schedule(run.job, {0: 32, 3: 64}, {3: 0.75})
    assert max_diff(run.trained_model(), expected) < 1e-5
    assert max_diff(run.trained_model(), train_reference_schedule(run.job, {0: 32, 3: 64})) > 1e-4  # the lr rule was applied
    assert torch.isfinite(torch.cat([p.flatten() for p in run.trained_model().parameters()])).all()
