"""The lower bounds that prune candidate stages before the MILP are valid: no plan that uses a
group is cheaper than the group's bound, so pruning never loses the optimum."""

import math
import random
from dataclasses import dataclass

import numpy as np
import pytest

from stagecoach.planner.model.platforms import aws_platform
from stagecoach.planner.profile.layers import LayerProfile, ModelProfile
from stagecoach.planner.solve.bounds import LowerBounds
from stagecoach.planner.solve.bruteforce import all_plans
from stagecoach.planner.solve.candidates import Candidates, candidate_groups
from stagecoach.planner.solve.objective import max_stages_for, objective_value, objective_weights

MB = 2**20
ALGOS = ("scatter_reduce", "pipelined_scatter_reduce")


def profile(rng: random.Random, L: int) -> ModelProfile:
    layers = tuple(
        LayerProfile(
            f"l{j}",
            rng.uniform(5, 400) * MB,
            rng.uniform(1, 60) * MB,
            rng.uniform(0.1, 8) * MB,
            rng.uniform(0.1, 8) * MB,
            rng.uniform(0.2, 10) * 1e9,
            rng.uniform(0.4, 20) * 1e9,
        )
        for j in range(L)
    )
    return ModelProfile("random", layers, layers[0].in_bytes_per_sample)


def plan_groups(est, cands) -> list[int]:
    """Indices (into cands.groups) of the groups a plan uses."""
    index = {(g.i, g.j, g.tier): q for q, g in enumerate(cands.groups)}
    out, i = [], 0
    for n, t in zip(est.config.balance, est.config.tiers_mb):
        out.append(index[(i, i + n, t)])
        i += n
    return out


@dataclass
class Instance:
    """A small random planning instance, solved by brute force: its candidate groups, every
    feasible plan with its objective, and the lower bounds over the groups."""

    cands: Candidates
    plans: list
    objs: list[float]
    bounds: LowerBounds


def random_instance(rng: random.Random) -> Instance:
    plat = aws_platform()
    L, d, b, m = rng.randint(3, 5), rng.choice([1, 2, 4]), rng.choice([1, 2]), rng.choice([1, 2, 4, 8, 16])
    tiers = (rng.choice(plat.tiers_mb[:-1]), 10240)
    prof = profile(rng, L)
    a1, a2 = rng.choice([(1, 0), (1, 2**19), (1, 2**22)])
    wc, wt = objective_weights(a1, a2)
    cands = candidate_groups(prof, plat, d, b, m, tiers, sync_algos=ALGOS)
    plans = [e for e in all_plans(prof, plat, d, b, m, tiers, 3, ALGOS) if e.feasible]
    objs = [objective_value(e.cost, e.time_s, a1, a2) for e in plans]
    return Instance(cands, plans, objs, LowerBounds(cands, wc, wt, plat, max_stages_for(d, L, 3)))


@pytest.mark.parametrize("seed", range(8))
def test_group_bounds_never_exceed_a_plan_through_the_group(seed):
    inst = random_instance(random.Random(seed))
    cands, plans, objs, bounds = inst.cands, inst.plans, inst.objs, inst.bounds
    assert plans
    cutoff = sorted(objs)[len(objs) // 3]  # refining against a cutoff discards bands above it
    for pairs, limit in (
        (bounds.grid(3), math.inf),
        (bounds.refine(bounds.grid(3), math.inf), math.inf),
        (bounds.refine(bounds.grid(3), cutoff), cutoff),
    ):
        lb = bounds.group_bounds(pairs, ctx=True)
        lb_plain = bounds.group_bounds(pairs, ctx=False)
        assert np.all(lb_plain <= lb * (1 + 1e-9) + 1e-6)  # the group's own waits only add
        glb = bounds.pair_bounds(pairs).min() if len(pairs[0]) else math.inf
        for e, v in zip(plans, objs):
            if v > limit:
                continue  # bands were discarded against the cutoff: only plans below it are covered
            assert glb <= v * (1 + 1e-9) + 1e-6
            for q in plan_groups(e, cands):
                assert lb[q] <= v * (1 + 1e-9) + 1e-6, (e.config, cands.groups[q], lb[q], v)
