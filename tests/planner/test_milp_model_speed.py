"""Issue 25 item 4's speed-ups of the exact solve keep it exact:

- the MILP is handed to HiGHS by milp._Model instead of pulp: the same floats in every coefficient
  and row bound (so HiGHS solves the same model), checked against pulp's own arithmetic;
- the bound sweeps leave out groups already beyond a cutoff (``alive``): every bound still holds
  for every plan at or below that cutoff, checked against every plan of random instances;
- an LP relaxation whose heaviest path the model prices within the gap decides its MILP: equal to
  brute force on the instances of test_milp.py.
No timing here (benchmarks/planner.py measures the solve times)."""

import math
import random

import numpy as np
import pulp
import pytest
from test_milp import CASES
from test_milp_bounds import plan_groups, random_instance
from test_milp_speed_decomposition import assert_bruteforce_optimum

from stagecoach.planner.model.platforms import aws_platform
from stagecoach.planner.solve import search
from stagecoach.planner.solve.milp import _lin, _Var
from stagecoach.planner.solve.objective import weighted_objective


def _both(rng: random.Random, n: int) -> tuple[list[_Var], list[pulp.LpVariable]]:
    return [_Var(f"v{k}", 0, None) for k in range(n)], [pulp.LpVariable(f"v{k}", 0) for k in range(n)]


def _pulp_lin(pairs, const: float = 0.0) -> pulp.LpAffineExpression:
    acc: dict = {}
    for var, c in pairs:
        acc[var] = acc.get(var, 0.0) + c
    return pulp.LpAffineExpression(acc, const)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # pulp 3.x announces its 4.0 API on every variable
@pytest.mark.parametrize("seed", range(20))
def test_expressions_and_rows_are_pulps_to_the_last_bit(seed):
    """The operations the MILP builds its rows and objective with (sums of repeated terms, a
    scaled expression subtracted, a variable and a constant added, the weighted objective scaled)
    give bit for bit pulp's coefficients, constants and row bounds."""
    rng = random.Random(seed)
    ours, theirs = _both(rng, 6)
    picks = [(rng.randrange(6), rng.uniform(-1e3, 1e3) * 10 ** rng.randint(-6, 6)) for _ in range(12)]
    c0, c1, wc, wt, rhs = (rng.uniform(-50, 50) for _ in range(5))
    wt = wt if seed % 3 else 0.0  # a zero weight drops the terms (pulp: an empty expression)
    e1, p1 = _lin([(ours[k], c) for k, c in picks[:8]], c0), _pulp_lin([(theirs[k], c) for k, c in picks[:8]], c0)
    e2, p2 = _lin([(ours[k], c) for k, c in picks[6:]]), _pulp_lin([(theirs[k], c) for k, c in picks[6:]])
    e3, p3 = e1 - c1 * e2, p1 - c1 * p2
    e4, p4 = e3 + ours[5] + c0, p3 + theirs[5] + c0
    obj, pobj = (
        weighted_objective(e2, e4, wc, wt) * (1.0 / (wc * 1e-4 + 3.0)),
        weighted_objective(p2, p4, wc, wt) * (1.0 / (wc * 1e-4 + 3.0)),
    )
    for e, p in ((e3, p3), (e4, p4), (obj, pobj)):
        assert [(v.name, x) for v, x in e.items()] == [(v.name, x) for v, x in p.items()]
        assert e.const == p.constant
    for row, prow in ((e4 <= rhs, p4 <= rhs), (e4 >= rhs, p4 >= rhs), (e3 == rhs, p3 == rhs)):
        assert (row.lo, row.hi) == (prow.getLb(), prow.getUb())


@pytest.mark.parametrize("seed", range(8))
def test_bounds_over_the_alive_groups_hold_below_the_cutoff(seed):
    """Groups whose bounds exceed a cutoff left out of the sweeps: the group and pair bounds
    still hold for every plan at or below the cutoff (and are at least the full sweeps')."""
    inst = random_instance(random.Random(100 + seed))
    cands, plans, objs, bounds = inst.cands, inst.plans, inst.objs, inst.bounds
    left_out = 0
    for v0 in (min(objs), sorted(objs)[len(objs) // 20], sorted(objs)[len(objs) // 4]):
        cutoff = v0 * (1 + 1e-9) + 1e-6  # the search's own margin (objective.REL_TOL) is larger
        pairs = bounds.refine(bounds.grid(3), cutoff)
        alive = bounds.group_bounds(pairs, ctx=True, per_pair=True).min(axis=0) <= cutoff
        left_out += int((~alive).sum())
        for ctx in (True, False):
            rows = bounds.group_bounds(pairs, ctx=ctx, per_pair=True, alive=alive)
            assert np.all(rows >= bounds.group_bounds(pairs, ctx=ctx, per_pair=True) * (1 - 1e-12))
            lb, glb = rows.min(axis=0), bounds.pair_bounds(pairs, alive).min()
            for e, v in zip(plans, objs):
                if v > cutoff:
                    continue
                assert glb <= v * (1 + 1e-9) + 1e-6
                for q in plan_groups(e, cands):
                    assert lb[q] <= v * (1 + 1e-9) + 1e-6, (e.config, cands.groups[q], lb[q], v)
    assert left_out > 0  # some groups were left out, else the test proves nothing


ONE_MILP_CASES = [c for c in CASES if c[3] < search.BANDS_FROM_M][:12]


@pytest.mark.parametrize("case", ONE_MILP_CASES, ids=lambda c: f"L{len(c[0].layers)}-d{c[1]}-m{c[3]}-w{c[5][1]}")
def test_the_lp_first_one_milp_equals_bruteforce(case):
    """With few micro-batches the final MILP over every group left is first tried by its LP
    relaxation (refuted, or decided by its heaviest path): the optimum is brute force's."""
    assert_bruteforce_optimum(case)


def test_an_lp_decides_some_milps():
    """On these instances some final MILPs are decided by their LP (else the tests above prove
    nothing about that path)."""
    words = []
    for prof, d, b, m, tiers, (a1, a2), smax, algos in ONE_MILP_CASES:
        r = search.solve_fixed(prof, aws_platform(), d, b, m, a1, a2, tiers=tiers, max_stages=smax, sync_algos=algos, first_groups=2)
        words += [x["status"] for x in r.info.get("milps", []) if x["tag"].endswith("-lp")]
    assert "lp-plan" in words and math.isfinite(len(words))
