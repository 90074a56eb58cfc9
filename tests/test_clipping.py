"""Gradient clipping by the global norm (issue 15 item 3): equal to
torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) in a plain loop, float64, through the
real state machines, for each way a stage updates: sync tasks (scatter-reduce, K-reduce with fewer
aggregators than replicas), the backward task alone (one replica, warm state), the backward tasks
exchanging shards (pipelined scatter-reduce); the norm per iteration is in the metrics.
"""

import pytest
import torch
from helpers import selected
from torch import nn

from stagecoach import Job, JobError
from stagecoach.core.training import batch_indices

G = torch.Generator().manual_seed(13)
X = torch.randn(48, 6, generator=G, dtype=torch.float64) * 3
Y = torch.randint(0, 3, (48,), generator=G)
MAX_NORM = 0.5  # under the gradients' norm in most iterations, over it in one: both branches of min(1, ...)

PLANS = {
    "scatter": dict(stages=2, replicas=2, micro_batches=2),
    "k-reduce": dict(stages=3, replicas=3, micro_batches=1, sync="k_reduce", aggregators=2),
    "alone": dict(stages=3, replicas=1, micro_batches=2),
    "pipelined": dict(stages=2, replicas=3, micro_batches=1, sync="pipelined_scatter_reduce"),
}


def make_job(name: str) -> Job:
    return Job(
        name=name,
        model=lambda: nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 3)),
        loss=nn.CrossEntropyLoss(),
        optimizer=lambda p: torch.optim.SGD(p, lr=0.2, momentum=0.9),
        clip_grad_norm=MAX_NORM,
        train=(X, Y),
        global_batch=12,
        iterations=5,
        seed=6,
        dtype=torch.float64,
    )


def plain_pytorch(job: Job) -> tuple[nn.Module, list[float]]:
    torch.manual_seed(job.seed)
    net = job.model().double()
    opt = job.optimizer(list(net.parameters()))
    norms = []
    for t in range(job.iterations):
        idx = batch_indices(job.seed, t, X.shape[0], job.global_batch)
        opt.zero_grad()
        job.loss(net(X[idx]), Y[idx]).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), MAX_NORM)))
        opt.step()
    return net, norms


def test_a_bad_max_norm_is_refused():
    job = make_job("clip-bad")
    job.clip_grad_norm = -1.0
    with pytest.raises(JobError, match="clip_grad_norm=-1.0: give the largest gradient norm, a positive number"):
        job.validate()


DEFAULT = ("scatter", "alone")  # K-reduce and the pipelined exchange run in the slow set


@pytest.fixture(scope="module")
def runs(backend, request):
    wanted = selected(request, "name")
    started = {name: make_job(f"clip-{name}").run(backend=backend, **plan) for name, plan in PLANS.items() if name in wanted}
    for run in started.values():
        run.wait(progress=False, poll_s=0.2, timeout_s=600)
    return started


@pytest.mark.parametrize("name", [n if n in DEFAULT else pytest.param(n, marks=pytest.mark.slow) for n in PLANS])
def test_clipping_equals_clip_grad_norm_(runs, name):
    run = runs[name]
    net, norms = plain_pytorch(run.job)
    assert sum(n > MAX_NORM for n in norms) >= 3 and min(norms) < MAX_NORM  # clipped, and once not
    got = run.trained_model().state_dict()
    assert max(float((got[k] - v).abs().max()) for k, v in net.state_dict().items()) < 1e-5
    assert run.grad_norms() == pytest.approx(norms, rel=1e-9)


def test_the_performance_model_charges_the_norm_exchange():
    from dataclasses import replace

    from stagecoach.planner.model.perfmodel import Config, SyncChoice, evaluate
    from stagecoach.planner.model.platforms import aws_platform
    from stagecoach.planner.profile.meta import profile_meta

    job = make_job("clip-model")
    profile = profile_meta(job.build_model(), X[0])
    plat = aws_platform()
    cfg = Config(
        balance=(3, 2), replicas=2, micro_batch=3, micro_batches=2, tiers_mb=(1024, 1024), sync=(SyncChoice("scatter_reduce", 2),) * 2
    )
    plain, clipped = evaluate(profile, cfg, plat), evaluate(replace(profile, clip_grad_norm=True), cfg, plat)
    assert clipped.time_s - plain.time_s == pytest.approx(2 * plat.storage_latency_s + plat.poll_delay_s)
    u = 4  # two stages, two sync tasks each
    assert (clipped.s3_puts - plain.s3_puts, clipped.s3_gets - plain.s3_gets) == (u, u * (u - 1))
