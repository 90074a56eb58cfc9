"""Issue 25 item 4, fourth pass: the speed-ups keep the solve exact.

- the bound sweeps over the alive groups run on a restricted view (``LowerBounds._restricted``):
  the very numbers of a sweep over every group where the others are no arcs;
- a band's LP stops once the dual simplex passes the cutoff (HiGHS's objective bound): it refutes
  exactly the LPs whose optimum lies above the cutoff;
- the promising rounds' LP incumbent (the LP's heaviest path, locally improved) and their MILPs
  only up to PROMISING_MILP_MAX groups: the search still proves brute force's optimum.
No timing here (benchmarks/planner.py measures the solve times)."""

import copy
import random

import numpy as np
import pytest
from test_milp import CASES
from test_milp_bounds import random_instance
from test_milp_speed_decomposition import assert_bruteforce_optimum

from stagecoach.planner.model.platforms import aws_platform
from stagecoach.planner.solve import milp, search
from stagecoach.planner.solve.objective import max_stages_for, objective_weights


def _masked_reference(bounds, pairs, ctx: bool, alive: np.ndarray) -> np.ndarray:
    """Per pair and group, the bounds of a full sweep in which the groups not ``alive`` are no
    arcs (an infinite weight never wins a minimum) and get inf themselves."""
    ref = copy.copy(bounds)
    ref._view = None
    ref.wpre, ref.wsuf, ref.base = bounds.wpre.copy(), bounds.wsuf.copy(), bounds.base.copy()
    ref.wpre[:, ~alive], ref.wsuf[:, ~alive], ref.base[~alive] = np.inf, np.inf, np.inf
    rows = ref.group_bounds(pairs, ctx=ctx, per_pair=True)
    return np.where(alive[None, :], rows, np.inf)


@pytest.mark.parametrize("seed", range(8))
def test_the_restricted_sweeps_equal_the_masked_full_sweeps(seed):
    """group_bounds / pair_bounds over the alive groups give, bit for bit, what a sweep over
    every group with the others taken out gives (the view changes the arrays' width only)."""
    inst = random_instance(random.Random(300 + seed))
    bounds, objs = inst.bounds, inst.objs
    left_out = 0
    for v0 in (min(objs), sorted(objs)[len(objs) // 10], sorted(objs)[len(objs) // 3]):
        cutoff = v0 * (1 + 1e-9) + 1e-6
        pairs = bounds.refine(bounds.grid(3), cutoff)
        alive = bounds.group_bounds(pairs, ctx=True, per_pair=True).min(axis=0) <= cutoff
        left_out += int((~alive).sum())
        for ctx in (True, False):
            got = bounds.group_bounds(pairs, ctx=ctx, per_pair=True, alive=alive)
            assert np.array_equal(got, _masked_reference(bounds, pairs, ctx, alive))
            assert np.array_equal(bounds.group_bounds(pairs, ctx=ctx, alive=alive), got.min(axis=0) if len(got) else got)
        ref = copy.copy(bounds)
        ref._view, ref.base = None, np.where(alive, bounds.base, np.inf)
        assert np.array_equal(bounds.pair_bounds(pairs, alive), ref.pair_bounds(pairs))
    assert left_out > 0  # some groups were left out, else the test proves nothing


@pytest.mark.parametrize("seed", range(6))
def test_an_lp_stopped_at_the_cutoff_refutes_exactly_the_lps_above_it(seed, monkeypatch):
    """With the cutoff as HiGHS's objective bound an LP says "infeasible" (refuted) only where the
    LP solved to its optimum ends above the cutoff, and otherwise has that same optimum."""
    cands = random_instance(random.Random(400 + seed)).cands
    plat = aws_platform()
    smax = max_stages_for(cands.replicas, cands.layers, 3, plat)
    wc, wt = objective_weights(1, 2**19)
    plain = milp._highs
    lp = milp.solve_milp(cands, list(cands.groups), plat, wc, wt, smax, 60.0, 1e-7, None, None, True).objective
    seen = set()
    for cutoff in (lp * 0.5, lp * 0.999, lp * 1.01, lp * 1.5, lp * 10):  # a cutoff only raises the LP (caps)
        args = (cands, list(cands.groups), plat, wc, wt, smax, 60.0, 1e-7, None, cutoff, True)
        stopped = milp.solve_milp(*args)
        with monkeypatch.context() as mp:
            mp.setattr(milp, "_highs", lambda tl, gap, th, bound: plain(tl, gap, th, None))
            full = milp.solve_milp(*args)
        above = full.status == "infeasible" or full.objective > cutoff * (1 + 1e-9)
        if stopped.status == "infeasible":  # stopped early: only where the LP's optimum is above
            assert above, (full.status, full.objective, cutoff)
        else:  # ran to its optimum (the dual simplex may pass the bound only at the end)
            assert stopped.status == full.status and stopped.objective == pytest.approx(full.objective, rel=1e-9)
        seen.add(above)
    assert seen == {True, False}  # both sides of the cutoff were tried


BAND_AND_ONE = [c for c in CASES if c[3] >= search.BANDS_FROM_M][:6] + [c for c in CASES if c[3] < search.BANDS_FROM_M][:6]


@pytest.mark.parametrize("case", BAND_AND_ONE, ids=lambda c: f"L{len(c[0].layers)}-d{c[1]}-m{c[3]}-w{c[5][1]}")
def test_promising_rounds_with_lp_incumbents_equal_bruteforce(case, monkeypatch):
    """The promising rounds forced on small instances (any number of groups left), their MILPs
    stopped after the first round: the LP incumbents never cost the optimum."""
    monkeypatch.setattr(search, "FEW_GROUPS", 0)
    monkeypatch.setattr(search, "PROMISING_MILP_MAX", 2)
    assert_bruteforce_optimum(case)


def test_the_promising_lp_rounds_run():
    """On the instances above the promising rounds do run their LPs (else they prove nothing)."""
    tags = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(search, "FEW_GROUPS", 0)
        mp.setattr(search, "PROMISING_MILP_MAX", 2)
        for prof, d, b, m, tiers, (a1, a2), smax, algos in BAND_AND_ONE:
            r = search.solve_fixed(prof, aws_platform(), d, b, m, a1, a2, tiers=tiers, max_stages=smax, sync_algos=algos, first_groups=2)
            tags += [x["tag"] for x in r.info.get("milps", [])]
    assert "promising-lpplan" in tags
