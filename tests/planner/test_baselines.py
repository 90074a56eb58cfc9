"""The baselines of FuncPipe §5.1 follow the paper's rules (planner/baselines/classic.py)."""

import pytest

from stagecoach.planner.baselines.classic import (
    BASELINES,
    PS_USD_PER_HOUR,
    _balanced,
    hybridps,
    lambdaml,
    lambdaml_ga,
    lambdaml_memory_mb,
    lambdaml_searched,
    max_local_batch,
    tpdmp,
)
from stagecoach.planner.model.perfmodel import Config, evaluate
from stagecoach.planner.model.platforms import aws_platform
from stagecoach.planner.model.syncmodel import SyncChoice
from stagecoach.planner.plan import Plan
from stagecoach.planner.profile.zoo import zoo_profile
from stagecoach.planner.solve.objective import max_stages_for, objective_value
from stagecoach.planner.solve.pareto import FUNCPIPE_WEIGHTS


@pytest.fixture(scope="module")
def resnet():
    plat = aws_platform()
    return zoo_profile("resnet101").merged(12, plat), plat


def test_lambdaml_is_the_papers_rule_largest_memory_and_largest_local_batch(resnet):
    prof, plat = resnet
    e = lambdaml(prof, 64, plat)
    c = e.config
    assert c.stages == 1 and c.tiers_mb == (10240,) and c.micro_batches == 1 and c.replicas * c.micro_batch == 64
    assert c.sync[0].algo == "lambdaml_scatter_reduce" and c.sync[0].k == c.replicas
    # the runtime runs LambdaML's algorithm itself: the baseline is a plan, with no sync Map
    plan = Plan(
        balance=[sum(layer.count for layer in prof.layers)],
        replicas=c.replicas,
        micro_batches=1,
        global_batch=64,
        sync=[c.sync[0].plan_fields()[0]],
    )
    assert plan.sync == ("lambdaml_scatter_reduce",) and plan.aggregators == (c.replicas,) and plan.sync_tasks(0) == 0
    # the local batch is the largest divisor of G that fits by LambdaML's memory: the next one does not
    bigger = [b for b in range(c.micro_batch + 1, 65) if 64 % b == 0]
    assert bigger and all(lambdaml_memory_mb(prof, b, 64 // b, plat) > 10240 for b in bigger)
    assert lambdaml_searched(prof, 64, plat).config != c  # the searched variant is another plan, named apart
    assert "LambdaML-searched" in BASELINES and BASELINES["LambdaML"] is lambdaml


def test_lambdamls_memory_gives_amoebanet_d36_the_local_batch_funcpipe_reports():
    # FuncPipe §1: without partition, LambdaML trains AmoebaNet-D36 with a local batch of 8 (SGD)
    sgd = aws_platform(optimizer_state_ratio=0.0)
    assert max_local_batch(zoo_profile("amoebanet_d36"), 64, sgd, 10240) == 8


def test_ga_keeps_lambdamls_workers_with_micro_batches_of_one_and_the_least_memory(resnet):
    prof, plat = resnet
    base, ga = lambdaml(prof, 64, plat), lambdaml_ga(prof, 64, plat)
    c = ga.config
    assert c.replicas == base.config.replicas and c.micro_batch == 1 and c.micro_batches == 64 // c.replicas
    smaller = [t for t in plat.tiers_mb if t < c.tiers_mb[0]]
    assert lambdaml_memory_mb(prof, 1, c.replicas, plat) <= c.tiers_mb[0]
    assert all(lambdaml_memory_mb(prof, 1, c.replicas, plat) > t for t in smaller)  # the least tier that fits


def test_hybridps_pays_for_its_parameter_server(resnet):
    prof, plat = resnet
    e = hybridps(prof, 64, plat)
    assert e.config.sync[0].algo == "parameter_server" and e.config.tiers_mb == (10240,)
    bare = evaluate(prof, e.config, plat)
    assert e.cost == pytest.approx(bare.cost + PS_USD_PER_HOUR / 3600 * bare.time_s)


def test_tpdmp_returns_one_of_its_per_weight_optima(resnet):
    """TPDMP's pick is the optimum of one of FuncPipe's weights over its whole grid (d, stages,
    one tier), on FuncPipe's runtime (pipelined scatter-reduce; no sync with one replica). Which d
    wins is the model's business: with warm state a single replica pays its state's S3 traffic
    once per checkpoint, and the cheapest weight's optimum is then d = 1."""
    prof, plat = resnet
    e = tpdmp(prof, 64, plat)
    c = e.config
    assert c.micro_batch == 4 and all(s.algo == ("none" if c.replicas == 1 else "pipelined_scatter_reduce") for s in c.sync)
    assert len(set(c.tiers_mb)) == 1  # one tier for all stages: a grid over the allocation
    # no configuration of its grid beats it under every weight
    L = len(prof.layers)
    for d in (1, 2, 4, 8, 16, 32):
        m = 64 // (d * 4)
        for S in range(1, max_stages_for(d, L, 8) + 1):
            bal = _balanced(prof, plat, S, 4)
            for t in plat.tiers_mb:
                sync = (SyncChoice("none", 1) if d == 1 else SyncChoice("pipelined_scatter_reduce", d),) * S
                other = evaluate(prof, Config(bal, (t,) * S, d, 4, m, sync), plat)
                if other.feasible:
                    assert any(
                        objective_value(e.cost, e.time_s, a1, a2) <= objective_value(other.cost, other.time_s, a1, a2) + 1e-9
                        for a1, a2 in FUNCPIPE_WEIGHTS
                    ), (c, other.config)


def test_tpdmp_without_a_single_replica_runs_funcpipes_pipelined_scatter_reduce(resnet):
    prof, plat = resnet
    c = tpdmp(prof, 64, plat, replicas=(2, 4, 8, 16, 32)).config
    assert c.replicas > 1 and all(s.algo == "pipelined_scatter_reduce" and s.k == c.replicas for s in c.sync)
