"""Performance-model sanity, plans respect memory, Pareto and the delta rule."""

import pytest

from stagecoach.planner.model.perfmodel import Config, evaluate
from stagecoach.planner.model.platforms import aws_platform
from stagecoach.planner.model.syncmodel import SyncChoice
from stagecoach.planner.profile.layers import LayerProfile, ModelProfile
from stagecoach.planner.solve.pareto import delta, pareto_front, recommend
from stagecoach.planner.solve.sweep import plan_model

MB = 2**20


def toy(L=6, pmb=60.0):
    layers = tuple(LayerProfile(f"l{i}", pmb * MB, 20 * MB, 2 * MB, 2 * MB, 3e9, 6e9) for i in range(L))
    return ModelProfile("toy", layers, 2 * MB)


def test_more_memory_is_faster_and_single_replica_has_no_sync():
    plat = aws_platform()
    p = toy()
    t = [evaluate(p, Config((6,), (tier,), 1, 4, 4, (SyncChoice("none", 1),)), plat) for tier in (2048, 4096, 10240)]
    assert t[0].time_s > t[1].time_s > t[2].time_s
    assert all(e.stage_sync_s == [0.0] for e in t)
    e = evaluate(p, Config((3, 3), (4096, 4096), 4, 4, 1, (SyncChoice("scatter_reduce", 4),) * 2), plat)
    assert e.stage_forward_s[1] == 0.0  # the last stage's forward runs inside its backward
    assert all(s > 0 for s in e.stage_sync_s)
    assert 0 < e.orchestration_share < 1
    assert e.cost == pytest.approx(e.cost_lambda_duration + e.cost_lambda_requests + e.cost_transitions + e.cost_s3)


def test_pipelined_scatter_reduce_beats_scatter_reduce_and_pipeline_overlaps():
    plat = aws_platform()
    p = toy()
    mk = lambda algo, m: Config((3, 3), (4096, 4096), 4, 1, m, (SyncChoice(algo, 4),) * 2)
    sr, psr = evaluate(p, mk("scatter_reduce", 4), plat), evaluate(p, mk("pipelined_scatter_reduce", 4), plat)
    assert psr.time_s < sr.time_s and psr.stage_sync_s[0] < sr.stage_sync_s[0]
    # pipelining: 4 micro-batches over 2 stages take less than 4x one micro-batch's two stages
    one = evaluate(p, mk("scatter_reduce", 1), plat)
    assert sr.forward_s < 4 * one.forward_s


def test_every_plan_respects_memory_limits():
    plat = aws_platform()
    res = plan_model(toy(8, 400.0), 32, plat, replicas=(1, 2, 4), time_limit=5)
    assert res.candidates
    for c in res.candidates:
        assert c.estimate.feasible
        for need, tier in zip(c.estimate.stage_memory_bytes, c.config.tiers_mb):
            assert need <= plat.usable_bytes(tier)
        plan = c.to_plan()
        assert sum(plan.balance) == 8 and plan.global_batch == 32
    assert res.recommended in res.pareto


class P:
    def __init__(self, t, c):
        self.time_s, self.cost = t, c


def test_pareto_front_and_delta_rule():
    pts = [P(10, 1.0), P(8, 1.1), P(9, 1.2), P(5, 2.0), P(4.9, 4.0)]
    front = pareto_front(pts)
    assert [(p.time_s, p.cost) for p in front] == [(10, 1.0), (8, 1.1), (5, 2.0), (4.9, 4.0)]
    assert delta(10, 1.0, 5, 2.0) == pytest.approx(1.0)
    assert delta(10, 1.0, 4.9, 4.0) < 0.8
    assert recommend(front) is front[2]
    assert recommend(front[:1]) is front[0]


def test_the_pipelined_exchange_moves_in_groups_of_the_uploads_in_flight():
    """Chunks handed to the uploader together share the link and land together: with a few chunks
    the exchange is LambdaML's four transfers one after another; with many it pipelines."""
    from stagecoach.planner.limits import UPLOADS_IN_FLIGHT
    from stagecoach.planner.model.syncmodel import SYNC_ALGORITHMS, chunks_per_shard

    plat = aws_platform().replace(optimizer_state_ratio=0.0)
    w, lat = plat.bandwidth_Bps, plat.storage_latency_s
    pipelined = SYNC_ALGORITHMS["pipelined_scatter_reduce"]
    small, large = 8 * 2**20, 512 * 2**20  # one stage, d = 2
    assert chunks_per_shard(2, 2, small) <= UPLOADS_IN_FLIGHT < chunks_per_shard(2, 2, large)
    for p, chained in ((small, True), (large, False)):
        e = p / (2 * w)  # (d-1)/d of the stage on a link
        tail = pipelined.stage(2, 2, p, 0.0, 10.0, plat, 0.0).tail_s
        if chained:  # up, down, up, down: one group is the whole exchange
            assert tail == pytest.approx(4 * e + 3 * lat)
        else:  # the groups are a fifth of it: well under four transfers
            assert 2 * e < tail < 3 * e


def test_the_recommendation_prefers_the_cheaper_tier_within_the_models_accuracy():
    """examples/digits.py's front (issue 28): three one-stage plans 512/1024/2048 MB, each a bit
    faster and a bit dearer. FuncPipe's delta rule takes the 2,048 MB one (1.2% faster for 1% more);
    within the model's 8% accuracy the three are equally fast, so the cheapest is recommended."""
    from stagecoach.planner.solve.pareto import MODEL_TIME_ACCURACY, recommend_within_accuracy

    front = pareto_front([P(0.2022, 1.6760e-4), P(0.2006, 1.6818e-4), P(0.1998, 1.6933e-4)])
    assert recommend(front) is front[2]
    assert recommend_within_accuracy(front) is front[0]
    assert recommend_within_accuracy(front, accuracy=0.0) is recommend(front)  # FuncPipe's rule
    # a speed-up beyond the accuracy still counts: a 3 MiB MLP's 10,240 MB plan, 12% faster for 0.04% more
    wide = pareto_front([P(0.1594, 1.7781e-4), P(0.1422, 1.7789e-4)])
    assert 0.16 / 0.14 - 1 > MODEL_TIME_ACCURACY and recommend_within_accuracy(wide) is wide[1]
    # the delta rule picks the 5 s plan; a plan 2% slower and cheaper is recommended instead
    pts = pareto_front([P(10, 1.0), P(5.1, 1.9), P(5.0, 2.0), P(4.9, 4.0)])
    assert recommend(pts).time_s == 5.0 and recommend_within_accuracy(pts).time_s == 5.1
