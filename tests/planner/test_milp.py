"""The exact solve is exact: it equals brute force, and it evaluates any fixed plan like the perf model."""

import random

import pytest

from stagecoach.planner.model.perfmodel import Config, evaluate
from stagecoach.planner.model.platforms import aws_platform
from stagecoach.planner.model.syncmodel import SyncChoice
from stagecoach.planner.profile.layers import LayerProfile, ModelProfile
from stagecoach.planner.solve.bruteforce import solve_bruteforce
from stagecoach.planner.solve.objective import objective_value
from stagecoach.planner.solve.search import BANDS_FROM_M, solve_fixed

MB = 2**20
WEIGHTS = [(1, 0), (1, 2**16), (1, 2**19), (1, 2**22), (0, 1)]
ALL = ("scatter_reduce", "pipelined_scatter_reduce", "k_reduce", "all_reduce")


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


def instances(n: int = 60):
    """L <= 8, 3 tiers, d in {1, 2, 4}; every third instance lets every stage choose among all
    four sync algorithms (smaller, so that brute force stays quick); m up to 16 so that the
    bottleneck-band MILPs (m >= BANDS_FROM_M) are exercised as well as the single MILP."""
    rng = random.Random(2024)
    plat = aws_platform()
    for i in range(n):
        every_sync = i % 3 == 0
        L = rng.randint(2, 5) if every_sync else (rng.randint(2, 8) if i % 6 == 1 else rng.randint(2, 6))
        yield (
            random_profile(rng, L),
            rng.choice([1, 2, 4]),
            rng.choice([1, 2, 4]),
            rng.choice([1, 2, 3, 4, 8, 12, 16]),
            tuple(sorted(rng.sample(plat.tiers_mb, 3))),
            rng.choice(WEIGHTS),
            3 if L > 6 or every_sync else 4,
            ALL if every_sync else ("scatter_reduce",),
        )


CASES = list(instances())


def test_the_instances_cover_both_solve_paths_and_every_sync_algorithm():
    ms = [c[3] for c in CASES]
    assert len(CASES) >= 50 and max(len(c[0].layers) for c in CASES) == 8
    assert any(m >= BANDS_FROM_M for m in ms) and any(m < BANDS_FROM_M for m in ms)
    assert sum(c[7] == ALL and c[1] == 4 for c in CASES) >= 5  # k_reduce only exists for d > 2


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"L{len(c[0].layers)}-d{c[1]}-b{c[2]}-m{c[3]}-{len(c[7])}sync")
def test_milp_equals_bruteforce(case):
    prof, d, b, m, tiers, (a1, a2), smax, algos = case
    plat = aws_platform()
    r = solve_fixed(prof, plat, d, b, m, a1, a2, tiers=tiers, max_stages=smax, time_limit=60, sync_algos=algos)
    best, obj = solve_bruteforce(prof, plat, d, b, m, a1, a2, tiers=tiers, max_stages=smax, sync_algos=algos)
    if best is None:
        assert r.config is None, f"brute force found nothing feasible but the MILP returned {r.config}"
        return
    assert r.config is not None and r.status == "optimal", r.status
    est = evaluate(prof, r.config, plat)
    assert est.feasible, est.violations
    mine = objective_value(est.cost, est.time_s, a1, a2)
    assert mine == pytest.approx(obj, rel=2e-6), (r.config, best.config)
    assert r.objective == pytest.approx(mine, rel=1e-6)  # the reported objective is the model's


@pytest.mark.parametrize("case", CASES[::5], ids=lambda c: f"L{len(c[0].layers)}-d{c[1]}-m{c[3]}")
def test_milp_equals_bruteforce_when_it_starts_from_a_few_groups(case):
    """``first_groups`` small: the round that improves the incumbent on the most promising groups
    runs (and, when they hold no plan, grows them) before the final MILPs."""
    prof, d, b, m, tiers, (a1, a2), smax, algos = case
    plat = aws_platform()
    r = solve_fixed(prof, plat, d, b, m, a1, a2, tiers=tiers, max_stages=smax, sync_algos=algos, first_groups=2)
    best, obj = solve_bruteforce(prof, plat, d, b, m, a1, a2, tiers=tiers, max_stages=smax, sync_algos=algos)
    if best is None:
        assert r.config is None
        return
    assert r.status == "optimal" and r.objective == pytest.approx(obj, rel=2e-6)


def test_a_cutoff_from_elsewhere_is_respected():
    """Given a better objective than anything here, the solve says so instead of returning a plan;
    given a worse one, it still finds the optimum."""
    rng = random.Random(3)
    prof, plat = random_profile(rng, 5), aws_platform()
    best, obj = solve_bruteforce(prof, plat, 2, 2, 4, 1, 2**19, tiers=(2048, 4096, 10240), max_stages=3, sync_algos=ALL)
    assert best is not None
    below = solve_fixed(prof, plat, 2, 2, 4, 1, 2**19, tiers=(2048, 4096, 10240), max_stages=3, cutoff=obj * 0.999)
    assert below.config is None and below.status.startswith("cutoff")
    above = solve_fixed(prof, plat, 2, 2, 4, 1, 2**19, tiers=(2048, 4096, 10240), max_stages=3, cutoff=obj * 1.2)
    assert above.status == "optimal" and above.objective == pytest.approx(obj, rel=2e-6)


def test_milp_evaluates_fixed_configs_like_the_perf_model():
    rng = random.Random(7)
    plat = aws_platform()
    prof = random_profile(rng, 6)
    cfgs = [
        Config((6,), (10240,), 1, 2, 3, (SyncChoice("none", 1),)),
        Config((2, 4), (4096, 10240), 2, 2, 2, (SyncChoice("scatter_reduce", 2),) * 2),
        Config(
            (1, 2, 3),
            (3072, 6144, 10240),
            4,
            1,
            2,
            (SyncChoice("scatter_reduce", 4), SyncChoice("all_reduce", 1), SyncChoice("pipelined_scatter_reduce", 4)),
        ),
        Config((3, 1, 2), (8192, 2048, 10240), 4, 2, 1, (SyncChoice("k_reduce", 2),) * 3),
        Config(
            (2, 2, 2),
            (10240, 10240, 10240),
            2,
            1,
            9,
            (SyncChoice("pipelined_scatter_reduce", 2), SyncChoice("scatter_reduce", 2), SyncChoice("all_reduce", 1)),
        ),
    ]
    checked = 0
    for cfg in cfgs:
        est = evaluate(prof, cfg, plat)
        if not est.feasible:
            continue
        checked += 1
        for a1, a2 in WEIGHTS:
            r = solve_fixed(
                prof,
                plat,
                cfg.replicas,
                cfg.micro_batch,
                cfg.micro_batches,
                a1,
                a2,
                tiers=sorted(set(cfg.tiers_mb)),
                max_stages=3,
                sync_algos=ALL,
                fix=cfg,
            )
            assert r.objective == pytest.approx(objective_value(est.cost, est.time_s, a1, a2), rel=1e-6)
    assert checked >= 3
