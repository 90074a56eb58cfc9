"""Learning-rate schedules (issue 15 item 2): any PyTorch scheduler, stepped once per iteration,
applied identically by every task that updates parameters, equal to a plain PyTorch loop.

The plain loop is ``loss.backward(); optimizer.step(); scheduler.step()`` on the whole model,
float64; the runs go through the real state machines with each way a stage updates: sync tasks
(scatter-reduce), the backward task alone (one replica), and the backward tasks exchanging shards
(pipelined scatter-reduce) — with parameter groups and a scheduler that moves momentum as well.
"""

import pytest
import torch
from helpers import selected
from torch import nn

from stagecoach import Job, JobError
from stagecoach.core.schedule import Schedule
from stagecoach.core.training import batch_indices

G = torch.Generator().manual_seed(5)
X = torch.randn(48, 6, generator=G, dtype=torch.float64)
Y = torch.randint(0, 3, (48,), generator=G)
ITERATIONS = 6


def model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 3))


def adamw_groups(params):
    """No weight decay on biases: two parameter groups."""
    params = list(params)
    return torch.optim.AdamW(
        [{"params": [p for p in params if p.ndim > 1]}, {"params": [p for p in params if p.ndim == 1], "weight_decay": 0.0}],
        lr=0.01,
        weight_decay=0.1,
    )


CASES = {
    # OneCycleLR cycles the learning rate and Adam's beta1, per group
    "onecycle-groups-scatter": (
        adamw_groups,
        lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=ITERATIONS),
        dict(stages=2, replicas=2, micro_batches=2),
    ),
    "step-sgd-alone": (
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
        dict(stages=3, replicas=1, micro_batches=2),
    ),
    "cosine-pipelined": (
        lambda p: torch.optim.Adam(p, lr=0.02),
        lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=ITERATIONS),
        dict(stages=2, replicas=3, micro_batches=1, sync="pipelined_scatter_reduce"),
    ),
}


def make_job(name: str, optimizer, scheduler) -> Job:
    return Job(
        name=name,
        model=model,
        loss=nn.CrossEntropyLoss(),
        optimizer=optimizer,
        scheduler=scheduler,
        train=(X, Y),
        global_batch=12,
        iterations=ITERATIONS,
        seed=2,
        dtype=torch.float64,
    )


def plain_pytorch(job: Job) -> tuple[nn.Module, list[list[float]]]:
    torch.manual_seed(job.seed)
    net = job.model().double()
    opt = job.optimizer(list(net.parameters()))
    sched = job.scheduler(opt)
    lrs = []
    for t in range(job.iterations):
        lrs.append([g["lr"] for g in opt.param_groups])
        idx = batch_indices(job.seed, t, X.shape[0], job.global_batch)
        opt.zero_grad()
        job.loss(net(X[idx]), Y[idx]).backward()
        opt.step()
        sched.step()
    return net, lrs


def test_the_schedule_steps_forward_and_restarts_on_a_window_restart():
    opt_fn, sched_fn, _ = CASES["onecycle-groups-scatter"]
    s = Schedule(opt_fn, sched_fn, [{"lr": 0.01, "weight_decay": 0.1}, {"lr": 0.01, "weight_decay": 0.0}])
    _, want = plain_pytorch(make_job("sched-unit", opt_fn, sched_fn))
    assert [s.lrs(t) for t in range(ITERATIONS)] == want
    assert s.lrs(1) == want[1]  # back to an earlier iteration (a window restart): rebuilt, same values
    betas = [g["betas"][0] for g in s.at(3)]
    assert betas[0] == betas[1] and betas[0] != 0.9  # OneCycleLR moves beta1 too: it travels with the groups


def test_a_scheduler_that_needs_a_metric_is_refused():
    with pytest.raises(JobError, match="ReduceLROnPlateau, which steps on a measured metric"):
        make_job("sched-bad", lambda p: torch.optim.SGD(p, lr=0.1), lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o)).validate()


DEFAULT = "onecycle-groups-scatter"  # the others (d = 1, pipelined) run in the slow set


@pytest.fixture(scope="module")
def runs(backend, request):
    wanted = selected(request, "case")
    started = {}
    for name, (opt, sched, plan) in CASES.items():
        if name not in wanted:
            continue
        started[name] = make_job(f"sched-{name[:12]}", opt, sched).run(backend=backend, **plan)
    for run in started.values():
        run.wait(progress=False, poll_s=0.2, timeout_s=600)
    return started


@pytest.mark.parametrize("case", [c if c == DEFAULT else pytest.param(c, marks=pytest.mark.slow) for c in CASES])
def test_schedules_train_like_plain_pytorch(runs, case):
    run = runs[case]
    net, lrs = plain_pytorch(run.job)
    got = run.trained_model().state_dict()
    initial = run.job.build_model().state_dict()
    assert max(float((got[k] - initial[k]).abs().max()) for k in got) > 1e-3, "training moved it"
    assert max(float((got[k] - v).abs().max()) for k, v in net.state_dict().items()) < 1e-5
    assert run.learning_rates() == lrs  # per iteration, per parameter group, in the metrics
