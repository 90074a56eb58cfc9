"""plan_model: every weight's plan is the optimum over all (d, micro-batch size), the runtime Plan
carries the sync algorithm of every stage, and a model that cannot fit is refused by name."""

import math

import pytest

from stagecoach.planner.model.perfmodel import Config, evaluate
from stagecoach.planner.model.platforms import aws_platform
from stagecoach.planner.model.syncmodel import ALL_SYNC, SyncChoice
from stagecoach.planner.plan import Plan
from stagecoach.planner.profile.layers import LayerProfile, LayerTooLargeError, ModelProfile
from stagecoach.planner.solve.bruteforce import all_plans
from stagecoach.planner.solve.objective import objective_value
from stagecoach.planner.solve.pareto import FUNCPIPE_WEIGHTS
from stagecoach.planner.solve.sweep import PlannedConfig, plan_model

MB = 2**20


def toy(pmb=(120.0, 300.0, 80.0, 200.0)) -> ModelProfile:
    layers = tuple(LayerProfile(f"l{i}", p * MB, 30 * MB, 3 * MB, 3 * MB, (2 + i) * 1e9, (4 + 2 * i) * 1e9) for i, p in enumerate(pmb))
    return ModelProfile("toy", layers, 3 * MB)


def test_every_weight_gets_the_optimum_over_all_replicas_and_micro_batch_sizes():
    plat = aws_platform().replace(tiers_mb=(1024, 4096, 10240))
    prof, G, replicas, sizes = toy(), 8, (1, 2, 4), (1, 2)
    res = plan_model(prof, G, plat, replicas=replicas, micro_batch_sizes=sizes, max_stages=3)
    assert res.proven and len(res.candidates) == len(FUNCPIPE_WEIGHTS)
    best = {w: math.inf for w in FUNCPIPE_WEIGHTS}
    for d in replicas:
        for b in sizes:
            if G % (d * b):
                continue
            for e in all_plans(prof, plat, d, b, G // (d * b), max_stages=3, sync_algos=ALL_SYNC):
                if e.feasible:
                    for w in best:
                        best[w] = min(best[w], objective_value(e.cost, e.time_s, *w))
    for c in res.candidates:
        assert c.method == "milp"
        assert objective_value(c.cost, c.time_s, *c.weights) == pytest.approx(best[c.weights], rel=2e-6)
    assert res.recommended in res.pareto


def test_to_plan_emits_each_stages_sync_algorithm_and_aggregators():
    plat = aws_platform()
    prof = toy()
    cfg = Config(
        (1, 2, 1),
        (4096, 10240, 4096),
        4,
        2,
        2,
        (SyncChoice("pipelined_scatter_reduce", 4), SyncChoice("k_reduce", 2), SyncChoice("all_reduce", 1)),
    )
    e = evaluate(prof, cfg, plat)
    assert e.feasible, e.violations
    plan = PlannedConfig(e, (1, 2**19), "milp", 0.0, prof, plat).to_plan()
    assert plan.sync == ("pipelined_scatter_reduce", "k_reduce", "all_reduce")
    assert plan.aggregators == (4, 2, 1)
    assert [plan.sync_tasks(s) for s in range(3)] == [0, 2, 1]  # the fused algorithm has no sync Map
    assert Plan.from_json(plan.to_json()) == plan
    assert plan.prediction is not None and len(plan.prediction.task_s) == 3 and plan.memory_mb == (4096, 10240, 4096)
    assert Plan.from_json(plan.to_json()) == plan  # the prediction survives the round trip


def test_the_planner_chooses_among_all_sync_algorithms_by_default():
    import inspect

    assert inspect.signature(plan_model).parameters["sync_algos"].default == ALL_SYNC
    res = plan_model(toy(), 16, aws_platform(), replicas=(4,), micro_batch_sizes=(2,), max_stages=2)
    assert {s.algo for c in res.candidates for s in c.config.sync} - {"scatter_reduce"}  # not only the LambdaML one


def test_a_layer_that_cannot_fit_10_gb_is_named_with_its_size():
    prof = toy((120.0, 4000.0, 80.0))  # 4000 MB of parameters: weights, gradients and a copy exceed 10 GB
    with pytest.raises(LayerTooLargeError, match=r"layer 'l1' of 'toy' cannot fit in 10240 MB.*4000 MB of parameters"):
        plan_model(prof, 8, aws_platform())


def test_bad_arguments_are_explained():
    with pytest.raises(ValueError, match="global_batch=0"):
        plan_model(toy(), 0)
    with pytest.raises(ValueError, match="unknown sync algorithms.*'ring'"):
        plan_model(toy(), 8, sync_algos=("ring",))
