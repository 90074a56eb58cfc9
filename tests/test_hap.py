"""FasDL's HAP with unequal partitioning (planner/hap.py, stagecoach.reference_hap, docs/exactness.md
"FasDL's HAP"): the split, the single-process reference against an independent implementation of
the documented semantics, and the refusals — HAP is never what a plan gets without naming it, and a
plan naming it runs (tests/test_hap_runtime.py) only with one stage, a possible split and no running
statistics; anything else is refused before anything is deployed."""

import pytest
import torch
from torch import nn
from torch.func import functional_call

from stagecoach import Job
from stagecoach.core.training import batch_indices, micro_batch
from stagecoach.job import JobError
from stagecoach.planner.hap import HAP_SYNC, HapSplit, split_of
from stagecoach.planner.model.syncmodel import ALL_SYNC
from stagecoach.planner.plan import SYNC_ALGORITHMS, Plan, PlanError
from stagecoach.reference import train_reference
from stagecoach.reference_hap import HapRefused, train_reference_hap

LR = 0.1


def model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def make_job(global_batch: int, iterations: int, net=model, optimizer=None) -> Job:
    g = torch.Generator().manual_seed(11)
    x = torch.randn(60, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (60,), generator=g)
    return Job(
        model=net,
        loss=nn.CrossEntropyLoss(),
        optimizer=optimizer or (lambda p: torch.optim.SGD(p, lr=LR)),
        train=(x, y),
        global_batch=global_batch,
        iterations=iterations,
        seed=5,
        dtype=torch.float64,
        name="hap",
    )


def max_diff(a: nn.Module, b: nn.Module) -> float:
    return max(float((p.detach() - q.detach()).abs().max()) for p, q in zip(a.parameters(), b.parameters(), strict=True))


# -- the split -------------------------------------------------------------------------------------
@pytest.mark.parametrize(("d", "k", "g", "e", "m"), [(4, 2, 14, 3, 1), (3, 1, 10, 2, 2), (5, 4, 25, 5, 1)])
def test_the_global_batch_is_cut_into_aggregator_and_larger_non_aggregator_shares(d, k, g, e, m):
    s = HapSplit(d, k, g, e, m)
    batch = torch.arange(100, 100 + g)
    got = [s.rows(batch, r, j) for r in range(d) for j in range(m)]
    assert torch.equal(torch.cat(got), batch)  # every sample once, in order: aggregators first
    assert [len(s.rows(batch, r, 0)) * m for r in range(d)] == [s.aggregator_batch] * k + [s.aggregator_batch + e] * (d - k)
    assert k * s.aggregator_batch + (d - k) * s.non_aggregator_batch == g
    assert sum(s.weight(r) for r in range(d)) * m == pytest.approx(1.0, abs=1e-15)


def test_with_no_extra_samples_the_split_is_the_usual_micro_batch_split():
    s = HapSplit(4, 2, 16, 0, 2)
    batch = batch_indices(5, 3, 60, 16)
    for r in range(4):
        for j in range(2):
            assert torch.equal(s.rows(batch, r, j), micro_batch(batch, 4, 2, r, j))


def test_aggregators_are_the_first_k_replicas_and_non_aggregators_are_one_version_behind():
    s = HapSplit(3, 1, 9, 0)
    assert [s.is_aggregator(r) for r in range(3)] == [True, False, False]
    assert [s.param_version(0, r) for r in range(3)] == [0, 0, 0]  # first iteration: theta_0 for all
    assert [s.param_version(5, r) for r in range(3)] == [5, 4, 4]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        ((3, 3, 9, 0), "no non-aggregator"),
        ((1, 1, 4, 0), "no non-aggregator"),
        ((3, 0, 9, 0), "aggregators=0"),
        ((3, 1, 10, 0), "does not split"),
        ((3, 1, 9, 6), "does not split"),  # B^a would be -1
        ((3, 1, 9, -1), "extra=-1"),
        ((3, 1, 12, 3, 2), "micro-batches"),
    ],
)
def test_impossible_splits_are_refused_with_the_fix(args, needle):
    with pytest.raises(ValueError, match=needle):
        HapSplit(*args)


# -- the reference -----------------------------------------------------------------------------------
def independent_hap(job: Job, split: HapSplit) -> list[torch.Tensor]:
    """docs/exactness.md's semantics written another way: functional parameters, the losses of a
    whole role's samples summed (reduction='sum') over G, plain SGD by hand."""
    net = job.build_model()
    names = [n for n, _ in net.named_parameters()]
    cur = [p.detach().clone() for p in net.parameters()]
    prev = [p.clone() for p in cur]
    x_all, y_all = job.train
    for t in range(job.iterations):
        batch = batch_indices(job.seed, t, len(y_all), job.global_batch)
        grads = [torch.zeros_like(p) for p in cur]
        for r in range(split.replicas):
            base = cur if split.is_aggregator(r) or t == 0 else prev
            ps = [p.clone().requires_grad_(True) for p in base]
            rows = torch.cat([split.rows(batch, r, j) for j in range(split.micro_batches)])
            out = functional_call(net, dict(zip(names, ps, strict=True)), (x_all[rows],))
            loss = nn.functional.cross_entropy(out, y_all[rows], reduction="sum") / job.global_batch
            for g, gr in zip(grads, torch.autograd.grad(loss, ps), strict=True):
                g += gr
        prev = cur
        cur = [p - LR * g for p, g in zip(cur, grads, strict=True)]
    return cur


@pytest.mark.parametrize(("split", "iterations"), [(HapSplit(4, 2, 14, 3), 6), (HapSplit(3, 1, 10, 2, 2), 7)])
def test_reference_equals_an_independent_implementation_of_the_semantics(split, iterations):
    job = make_job(split.global_batch, iterations)
    got = train_reference_hap(job, split)
    want = independent_hap(job, split)
    diff = max(float((p.detach() - q).abs().max()) for p, q in zip(got.parameters(), want, strict=True))
    assert diff <= 1e-12, diff


def test_first_iteration_has_no_staleness_and_equals_plain_pytorch():
    job = make_job(12, 1, optimizer=lambda p: torch.optim.Adam(p, lr=0.01))
    assert max_diff(train_reference_hap(job, HapSplit(3, 1, 12, 0)), train_reference(job, replicas=3)) <= 1e-15


def test_staleness_changes_the_model_so_hap_is_not_plain_pytorch():
    job = make_job(12, 8)
    losses: list[float] = []
    hap = train_reference_hap(job, HapSplit(3, 1, 12, 0), losses)
    assert max_diff(hap, train_reference(job, replicas=3)) > 1e-6
    assert len(losses) == 8 and all(torch.isfinite(torch.tensor(losses)))


def test_reference_refuses_running_statistics_and_another_global_batch():
    bn = make_job(12, 2, net=lambda: nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)))
    with pytest.raises(HapRefused, match="running statistics"):
        train_reference_hap(bn, HapSplit(3, 1, 12, 0))
    with pytest.raises(HapRefused, match="global batch of 9"):
        train_reference_hap(make_job(12, 2), HapSplit(3, 1, 9, 0))


# -- refused unless asked for; run only where the runtime computes its semantics ----------------------------
def test_no_planner_or_default_plan_chooses_hap():
    assert HAP_SYNC not in SYNC_ALGORITHMS and HAP_SYNC not in ALL_SYNC
    assert Plan(balance=(3,), replicas=3, global_batch=12).sync == ("scatter_reduce",)
    assert Plan(balance=(3,), replicas=3, global_batch=12, sync="k_reduce", aggregators=1).aggregators == (1,)


def test_a_pipelined_hap_plan_is_refused_naming_stages():
    with pytest.raises(PlanError, match="data-parallel only.*use stages=1"):
        Plan(balance=(2, 1), replicas=3, global_batch=12, sync=HAP_SYNC, aggregators=1)


def test_a_data_parallel_hap_plan_runs_when_named_with_its_split():
    p = Plan(balance=(3,), replicas=4, global_batch=14, sync=HAP_SYNC, aggregators=2, hap_extra=3)
    assert split_of(p) == HapSplit(4, 2, 14, 3)  # 14 is no multiple of d m = 4: HAP's own cut decides
    assert Plan.from_dict(p.to_dict()) == p
    assert "hap_extra" not in Plan(balance=(3,), replicas=3, global_batch=12, sync="k_reduce", aggregators=1).to_dict()


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        (dict(replicas=3, global_batch=12), "K=3 aggregators has no non-aggregator.*use sync 'k_reduce'"),  # K defaults to d
        (dict(replicas=3, global_batch=13, aggregators=1), "does not split.*choose a global batch"),
        (dict(replicas=4, global_batch=14, aggregators=2, hap_extra=3, micro_batches=2), "micro-batches"),
    ],
)
def test_a_hap_plan_whose_split_is_impossible_is_refused_with_the_fix(kw, needle):
    with pytest.raises(PlanError, match=needle):
        Plan(balance=(3,), sync=HAP_SYNC, **kw)


def test_extra_samples_without_hap_are_refused():
    with pytest.raises(PlanError, match="hap_extra=2 is for sync 'k_reduce_hap'.*give 0"):
        Plan(balance=(3,), replicas=3, global_batch=12, sync="k_reduce", aggregators=1, hap_extra=2)


def test_run_refuses_what_hap_cannot_run_before_anything_is_deployed():
    with pytest.raises(PlanError, match="data-parallel only.*use stages=1"):
        make_job(12, 2).run(stages=2, replicas=3, sync=HAP_SYNC, aggregators=1, backend="no-such-backend")
    bn = make_job(12, 2, net=lambda: nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)))
    bn.deferred_batch_norm = True  # BSP would run it exactly; HAP's stale forwards would not
    with pytest.raises(JobError, match="running statistics.*track_running_stats=False"):
        bn.run(replicas=3, sync=HAP_SYNC, aggregators=1, backend="no-such-backend")


def test_our_model_does_not_predict_hap_and_says_where_its_time_model_is():
    job = make_job(12, 2)
    plan = Plan(balance=(3,), replicas=3, global_batch=12, sync=HAP_SYNC, aggregators=1)
    for predict in (job.predict, job.predict_cost):
        with pytest.raises(PlanError, match="predicting sync='k_reduce_hap' is not supported.*hap_prediction"):
            predict(plan)


# -- FasDL's time model for HAP (planner/baselines/fasdl.py) next to ours ------------------------------
def test_fasdls_extra_samples_fill_exactly_the_aggregation_time():
    from stagecoach.planner.baselines.fasdl import FasDLModel

    m = FasDLModel(model_bytes=100e6, a=2000.0, b=2.0, m=100.0, up_Bps=60e6, down_Bps=80e6, ramp_bytes=1e6)
    W, K, M, Ba = 8, 2, 3008, 16
    obj = 100e6 / K
    assert m.agg_s(W, K, M) == pytest.approx((W - 1) * obj / m.tp_down(M, obj) + obj / m.tp_up(M, obj))
    e = m.hap_extra(W, K, M, Ba)
    assert e > 0
    # Eq. 16: B^n = B^a + e is the largest batch a non-aggregator trains within T_train(B^a) + T_agg
    assert m.train_s(Ba + e, M) <= m.train_s(Ba, M) + m.agg_s(W, K, M) < m.train_s(Ba + e + 1, M)
    t, c, g = m.hap_iteration(W, K, M, Ba, e)
    bsp_t, bsp_c = m.iteration(W * Ba, W, K, M)
    assert t == pytest.approx(bsp_t) and c == pytest.approx(bsp_c)  # same time and cost ...
    assert g == K * Ba + (W - K) * (Ba + e) > W * Ba  # ... more samples
    slow, _, _ = m.hap_iteration(W, K, M, Ba, e + 50)  # too many extra samples: the aggregators wait
    assert slow > bsp_t
    assert m.hap_extra(W, W, M, Ba) == 0 and m.hap_extra(1, 1, M, Ba) == 0


def test_hap_prediction_puts_fasdls_hap_beside_our_bsp_prediction():
    from stagecoach.planner.baselines.fasdl import fit_fasdl_model, hap_prediction
    from stagecoach.planner.model.platforms import aws_platform
    from stagecoach.planner.profile.layers import LayerProfile, ModelProfile

    mib = 2**20
    profile = ModelProfile("toy", tuple(LayerProfile(f"l{i}", 30 * mib, 8 * mib, mib, mib, 2e9, 4e9) for i in range(6)), mib)
    plat = aws_platform()
    p = hap_prediction(profile, plat, workers=8, k=2, memory_mb=3008, batch_a=8)
    fm = fit_fasdl_model(profile, plat)
    assert p.extra == fm.hap_extra(8, 2, 3008, 8) and p.hap_batch == 2 * 8 + 6 * (8 + p.extra)
    assert p.hap_s == pytest.approx(p.bsp_s) and p.hap_samples_per_s >= p.bsp_samples_per_s
    assert p.ours_bsp_s > 0 and p.ours_bsp_cost > 0 and p.ours_bsp_samples_per_s > 0
