"""The MILP is exact: it equals brute force, and it evaluates any fixed plan like the perf model."""

import random

import pytest

from stagecoach.planner.bruteforce import solve_bruteforce
from stagecoach.planner.milp import objective_value, solve_fixed
from stagecoach.planner.perfmodel import Config, SyncChoice, evaluate
from stagecoach.planner.platforms import aws_platform
from stagecoach.planner.profile import LayerProfile, ModelProfile

MB = 2**20
WEIGHTS = [(1, 0), (1, 2**16), (1, 2**19), (1, 2**22), (0, 1)]


def random_profile(rng: random.Random, L: int) -> ModelProfile:
    layers = tuple(
        LayerProfile(
            f"l{j}",
            param_bytes=rng.uniform(5, 500) * MB,
            saved_bytes_per_sample=rng.uniform(1, 80) * MB,
            out_bytes_per_sample=rng.uniform(0.1, 8) * MB,
            in_bytes_per_sample=rng.uniform(0.1, 8) * MB,
            fwd_flops_per_sample=rng.uniform(0.2, 10) * 1e9,
            bwd_flops_per_sample=rng.uniform(0.4, 20) * 1e9,
        )
        for j in range(L)
    )
    return ModelProfile("random", layers, layers[0].in_bytes_per_sample)


def instances(n: int = 54):
    rng = random.Random(2024)
    plat = aws_platform()
    for i in range(n):
        L = rng.randint(2, 8) if i % 6 == 0 else rng.randint(2, 6)
        yield (
            random_profile(rng, L),
            rng.choice([1, 2, 4]),
            rng.choice([1, 2, 4]),
            rng.choice([1, 2, 3, 4]),
            tuple(sorted(rng.sample(plat.tiers_mb, 3))),
            rng.choice(WEIGHTS),
            3 if L > 6 else 4,
        )


@pytest.mark.parametrize("case", list(instances()), ids=lambda c: f"L{len(c[0].layers)}-d{c[1]}-b{c[2]}-m{c[3]}")
def test_milp_equals_bruteforce(case):
    prof, d, b, m, tiers, (a1, a2), smax = case
    plat = aws_platform()
    r = solve_fixed(prof, plat, d, b, m, a1, a2, tiers=tiers, max_stages=smax, time_limit=60)
    best, obj = solve_bruteforce(prof, plat, d, b, m, a1, a2, tiers=tiers, max_stages=smax)
    if best is None:
        assert r.config is None, f"brute force found nothing feasible but the MILP returned {r.config}"
        return
    assert r.config is not None and r.status == "optimal", r.status
    est = evaluate(prof, r.config, plat)
    assert est.feasible, est.violations
    mine = objective_value(est.cost, est.time_s, a1, a2)
    assert mine == pytest.approx(obj, rel=2e-6), (r.config, best.config)
    assert r.objective == pytest.approx(mine, rel=1e-6)  # the MILP's own objective is the model's


def test_milp_evaluates_fixed_configs_like_the_perf_model():
    rng = random.Random(7)
    plat = aws_platform()
    prof = random_profile(rng, 6)
    cfgs = [
        Config((6,), (10240,), 1, 2, 3, (SyncChoice("none", 1),)),
        Config((2, 4), (4096, 10240), 2, 2, 2, (SyncChoice("scatter_reduce", 2),) * 2),
        Config((1, 2, 3), (3072, 6144, 10240), 4, 1, 2, (SyncChoice("scatter_reduce", 4), SyncChoice("all_reduce", 1), SyncChoice("pipelined_scatter_reduce", 4))),
        Config((3, 1, 2), (8192, 2048, 10240), 4, 2, 1, (SyncChoice("k_reduce", 2),) * 3),
    ]
    for cfg in cfgs:
        est = evaluate(prof, cfg, plat)
        if not est.feasible:
            continue
        for a1, a2 in WEIGHTS:
            r = solve_fixed(prof, plat, cfg.replicas, cfg.micro_batch, cfg.micro_batches, a1, a2, tiers=sorted(set(cfg.tiers_mb)),
                            max_stages=3, sync_algos=("scatter_reduce", "pipelined_scatter_reduce", "k_reduce", "all_reduce"), fix=cfg)
            assert r.objective == pytest.approx(objective_value(est.cost, est.time_s, a1, a2), rel=1e-6)
