"""FasDL's HAP run by the distributed runtime (sync "k_reduce_hap", one stage): on the local stack
the trained model and the per-iteration losses equal stagecoach.reference_hap's single-process
semantics (docs/exactness.md "FasDL's HAP"), with equal and unequal partitioning, and the run
differs from the same job under BSP k_reduce (the staleness is really there). Besides, which
stored parameter versions a HAP sync task keeps for its stale readers (lambdas/collectives.py
``forget_old_version``), against the in-memory S3 the channel tests use."""

import pytest
import torch
from memory_s3 import MemoryS3
from torch import nn

from stagecoach import Job
from stagecoach.core import keys
from stagecoach.core.netem import Network
from stagecoach.core.training import stage_layout
from stagecoach.lambdas import collectives
from stagecoach.lambdas.channel import Channel, Pools
from stagecoach.planner.hap import HAP_SYNC, HapSplit
from stagecoach.reference import train_reference
from stagecoach.reference_hap import train_reference_hap

N = 60


def model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def make_job(name: str, global_batch: int, optimizer) -> Job:
    g = torch.Generator().manual_seed(11)
    x = torch.randn(N, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (N,), generator=g)
    return Job(
        model=model,
        loss=nn.CrossEntropyLoss(),
        optimizer=optimizer,
        train=(x, y),
        global_batch=global_batch,
        iterations=5,
        seed=5,
        dtype=torch.float64,
        name=name,
    )


def sgd(p):
    return torch.optim.SGD(p, lr=0.2, momentum=0.9)


def adam(p):
    return torch.optim.Adam(p, lr=0.02)


# name -> (global batch, optimizer, the split: d, K, G, extra, m)
CASES = {
    "equal": (12, sgd, HapSplit(3, 1, 12, 0, 1)),  # B^a = B^n = 4
    "unequal": (12, adam, HapSplit(4, 2, 12, 2, 2)),  # B^a = 2, B^n = 4, two micro-batches each
}


def settings(split: HapSplit, sync: str = HAP_SYNC) -> dict:
    out = dict(replicas=split.replicas, aggregators=split.aggregators, micro_batches=split.micro_batches, sync=sync)
    return out | ({"hap_extra": split.extra} if sync == HAP_SYNC else {})


@pytest.fixture(scope="module")
def runs(backend):
    """The two HAP runs and the equal case's job under BSP k_reduce, all at once."""
    started = {}
    for name, (g, opt, split) in CASES.items():
        started[name] = make_job(f"hap-{name}", g, opt).run(backend=backend, **settings(split))
    g, opt, split = CASES["equal"]
    started["bsp"] = make_job("hap-bsp", g, opt).run(backend=backend, **settings(split, "k_reduce"))
    for run in started.values():
        run.wait(progress=False, poll_s=2.0, timeout_s=900)
    return started


def max_diff(a: nn.Module, b: nn.Module) -> float:
    return max(float((p.detach() - q.detach()).abs().max()) for p, q in zip(a.parameters(), b.parameters(), strict=True))


@pytest.mark.parametrize("name", list(CASES))
def test_the_distributed_hap_run_equals_the_single_process_reference(runs, name):
    run, (_, _, split) = runs[name], CASES[name]
    losses: list[float] = []
    want = train_reference_hap(run.job, split, losses)
    assert max_diff(run.trained_model(), want) <= 1e-10
    assert run.losses() == pytest.approx(losses, abs=1e-10)
    assert max_diff(want, train_reference(run.job, replicas=split.replicas)) > 1e-4  # HAP's model is not plain PyTorch's


def test_staleness_changes_the_run_against_bsp_k_reduce(runs):
    hap, bsp = runs["equal"], runs["bsp"]
    assert max_diff(bsp.trained_model(), train_reference(bsp.job, replicas=3)) <= 1e-10  # BSP is plain PyTorch
    assert max_diff(hap.trained_model(), bsp.trained_model()) > 1e-4
    got, plain = hap.losses(), bsp.losses()
    assert got[0] == pytest.approx(plain[0], abs=1e-12)  # iteration 0: every replica on theta_0, as BSP
    assert all(abs(a - b) > 1e-9 for a, b in zip(got[1:], plain[1:], strict=True))  # then stale replicas


def test_every_replica_computes_and_only_aggregators_sync(runs):
    """Each HAP iteration: d backward tasks (the replicas), then K sync tasks — shard k's owner
    is sync task k. (That the non-aggregators' tasks of t+1 run beside iteration t's aggregation
    is tests/test_hap_overlap.py's.)"""
    run, (_, _, split) = runs["unequal"], CASES["unequal"]
    ms = run.metrics()
    for t in range(run.job.iterations):
        back = [m for m in ms if m.t == t and m.phase == "backward"]
        sync = [m for m in ms if m.t == t and m.phase == "sync"]
        assert sorted(m.index for m in back) == list(range(split.replicas))
        assert sorted(m.index for m in sync) == list(range(split.aggregators))


# -- which stored versions a HAP sync task deletes -------------------------------------------------------
@pytest.mark.parametrize(
    ("stale", "second_window", "kept"),
    [
        (False, None, [0, 6]),  # BSP: the sync task of t deletes t-1; the window's checkpoint 0 stays
        (True, None, [0, 5, 6]),  # HAP: t-2 instead, so t-1 stays for iteration t+1's non-aggregators
        (False, 4, [0, 4, 6]),  # BSP, a second window from 4: its checkpoint 4 stays too
        (True, 4, [0, 3, 4, 5, 6]),  # HAP: and 3 (w - 1), which a restart's non-aggregators read at iteration 4
    ],
)
def test_a_hap_sync_task_keeps_the_versions_its_stale_readers_need(stale, second_window, kept):
    s3 = MemoryS3()
    ch = Channel(s3, "bucket", net=Network(None), pools=Pools())
    job, layout = "j", stage_layout(10, 8, 1, 2)
    for v in range(7):
        ch.put_tensors(keys.params(job, v, 0, 0, 0), {"p": torch.zeros(10, dtype=torch.float64)})
    for t in range(1, 7):  # the sync tasks of iterations 1..6 (each would write version t+1)
        start = second_window if second_window is not None and t >= second_window else 0
        spec = collectives.SyncSpec(job, 0, t, 2, layout, sgd, start, 0.0, stale_readers=stale)
        collectives.forget_old_version(ch, spec, 0)
        ch.settle()
    assert sorted({keys.state_version(job, "params", k) for k in s3.keys(keys.state_prefix(job, "params"))}) == kept
