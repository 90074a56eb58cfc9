"""TensorBoard event files (issue 28 item 4): Run.save writes them beside the model, and
TensorBoard's own reader finds the run's loss, learning rates, gradient norms, evaluations, phase
seconds and cost in them, equal to what the Run reports."""

import math

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

from stagecoach import Job

G = torch.Generator().manual_seed(3)
X, XV = torch.randn(48, 6, generator=G), torch.randn(10, 6, generator=G)
Y, YV = torch.randint(0, 3, (48,), generator=G), torch.randint(0, 3, (10,), generator=G)


def accuracy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output.argmax(1) == target).float().mean()


def two_groups(params) -> torch.optim.Optimizer:
    """Weights and biases apart, the biases at half the learning rate."""
    params = list(params)
    weights, biases = [p for p in params if p.ndim > 1], [p for p in params if p.ndim == 1]
    return torch.optim.SGD([{"params": weights}, {"params": biases, "lr": 0.05}], lr=0.1)


def summarised_job() -> Job:
    """Two parameter groups under a scheduler, clipping and evaluation: every tag the writer has."""
    return Job(
        name="tb-summaries",
        model=lambda: nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)),
        loss=nn.CrossEntropyLoss(),
        optimizer=two_groups,
        scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
        clip_grad_norm=1.0,
        train=(X, Y),
        validation=(XV, YV),
        eval_every=2,
        metrics={"accuracy": accuracy},
        global_batch=12,
        iterations=4,
        seed=1,
    )


@pytest.fixture(scope="module")
def saved(backend, tmp_path_factory):
    r = summarised_job().run(stages=2, replicas=1, micro_batches=2, backend=backend)
    r.wait(progress=False, poll_s=1.0, timeout_s=600)
    directory = r.save(str(tmp_path_factory.mktemp("runs") / r.job_id))
    events = EventAccumulator(directory)
    events.Reload()
    return r, events


def scalars(events: EventAccumulator, tag: str) -> list[tuple[int, float]]:
    return [(e.step, e.value) for e in events.Scalars(tag)]


def test_the_training_curves_are_the_runs_own(saved):
    r, events = saved
    assert scalars(events, "train/loss") == [(t + 1, pytest.approx(v, rel=1e-6)) for t, v in enumerate(r.losses())]
    assert len(r.losses()) == 4
    lrs = r.learning_rates()
    for g in range(2):
        assert scalars(events, f"train/lr/group{g}") == [(t + 1, pytest.approx(v[g], rel=1e-6)) for t, v in enumerate(lrs)]
    # the rate each iteration trained with: StepLR(step_size=2) halves it after iteration 1
    assert [v for _, v in scalars(events, "train/lr/group0")] == pytest.approx([0.1, 0.1, 0.05, 0.05])
    assert scalars(events, "train/grad_norm") == [(t + 1, pytest.approx(v, rel=1e-6)) for t, v in enumerate(r.grad_norms())]


def test_evaluations_sit_on_the_step_of_the_version_they_evaluate(saved):
    r, events = saved
    evals = r.evaluations()
    assert [e.version for e in evals] == [2, 4]
    assert scalars(events, "eval/loss") == [(e.version, pytest.approx(e.loss, rel=1e-6)) for e in evals]
    assert scalars(events, "eval/accuracy") == [(e.version, pytest.approx(e.metrics["accuracy"], rel=1e-6)) for e in evals]


def test_phase_seconds_and_cost_are_measured_ones(saved):
    r, events = saved
    tags = set(events.Tags()["scalars"])
    assert {"time/forward_s", "time/backward_s", "time/iteration_s"} <= tags
    iteration_s = scalars(events, "time/iteration_s")
    assert [s for s, _ in iteration_s] == [1, 2, 3, 4] and all(0 < v < 60 for _, v in iteration_s)
    tasks = [v for _, v in scalars(events, "cost/tasks_usd")]
    assert tasks == sorted(tasks) and tasks[0] > 0  # cumulative
    cost = r.cost()  # read from what the run stored: the same whenever and by whom it is asked
    u, p = cost.total, cost.prices
    ((step, measured),) = scalars(events, "cost/measured_usd")
    assert step == 4 and measured == pytest.approx(cost.usd, rel=1e-6)
    assert scalars(events, "cost/lambda_usd")[0][1] == pytest.approx(u.gb_s * p.gb_s + u.invocations * p.request, rel=1e-6)
    assert scalars(events, "cost/step_functions_usd")[0][1] == pytest.approx(u.transitions * p.transition, rel=1e-6)
    assert scalars(events, "cost/s3_usd")[0][1] == pytest.approx(u.puts * p.put + u.gets * p.get, rel=1e-6)
    parts = sum(scalars(events, t)[0][1] for t in ("cost/lambda_usd", "cost/step_functions_usd", "cost/s3_usd"))
    assert parts == pytest.approx(measured, rel=1e-6)
    assert tasks[-1] < measured  # the tasks alone leave out transitions and the client's requests
    assert all(math.isfinite(v) for _, v in iteration_s)
