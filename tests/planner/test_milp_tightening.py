"""The rows and the refutation that tighten the exact solve (docs/performance-model.md §7.3-§7.4)
lose no plan below the cutoff: the carried waits' caps (milp.WaitSlack) hold for every plan of
random instances, and the solve with them, with the LP refutation of band MILPs and with the
promising MILPs' gap, still equals brute force."""

import math
import random

import numpy as np
import pytest
from test_milp import CASES
from test_milp_bounds import plan_groups, profile
from test_milp_speed_decomposition import assert_bruteforce_optimum, band_case_infos

from stagecoach.planner.model.platforms import aws_platform
from stagecoach.planner.solve import search
from stagecoach.planner.solve.bounds import LowerBounds
from stagecoach.planner.solve.bruteforce import all_plans
from stagecoach.planner.solve.candidates import candidate_groups
from stagecoach.planner.solve.objective import max_stages_for, objective_value, objective_weights

ALGOS = ("scatter_reduce", "pipelined_scatter_reduce")


def carried(path, q_at: int) -> float:
    """ea + xb + ll + ml of the stage at position ``q_at`` of a plan given as [(group, option)]:
    what the MILP's WaitSlack row caps."""
    ea = sum(g.af for g, _ in path[:q_at])
    xb = sum(g.bf for g, _ in path[q_at + 1 :])
    ll = path[-1][1].load_s
    ml = max(op.load_s for _, op in path[: q_at + 1])
    return ea + xb + ll + ml


def in_pair(pairs, p: int, max_a: float, max_b: float) -> bool:
    aLo, aHi, bLo, bHi = (float(v[p]) for v in pairs)
    return (max_a > aLo or aLo <= 0) and max_a <= aHi and (max_b > bLo or bLo <= 0) and max_b <= bHi


@pytest.mark.parametrize("seed", range(8))
def test_wait_slack_holds_for_every_plan(seed):
    """obj(plan) >= bound without context (of the plan's band pair) + wc d price (carried -
    least waits - own load) for every non-last stage of every feasible plan: what makes the
    row ea + xb + ll + ml <= before + after + l + slack valid below any cutoff."""
    rng = random.Random(100 + seed)
    plat = aws_platform()
    L, d, b, m = rng.randint(3, 5), rng.choice([2, 4]), rng.choice([1, 2]), rng.choice([2, 4, 8, 16])
    tiers = (rng.choice(plat.tiers_mb[:-1]), 10240)
    prof = profile(rng, L)
    a1, a2 = rng.choice([(1, 0), (1, 2**19), (1, 2**22)])
    wc, wt = objective_weights(a1, a2)
    cands = candidate_groups(prof, plat, d, b, m, tiers, sync_algos=ALGOS)
    bounds = LowerBounds(cands, wc, wt, plat, max_stages_for(d, L, 3))
    pairs = bounds.refine(bounds.grid(3), math.inf)
    rows = bounds.group_bounds(pairs, ctx=False, per_pair=True)
    checked = 0
    for e in all_plans(prof, plat, d, b, m, tiers, 3, ALGOS):
        if not e.feasible:
            continue
        v = objective_value(e.cost, e.time_s, a1, a2)
        qs = plan_groups(e, cands)
        ops = [next((op for op in cands.groups[q].options if op.choice == ch), None) for q, ch in zip(qs, e.config.sync)]
        if any(op is None for op in ops):
            continue  # a dominated sync option: the MILP holds a plan at least as good instead
        path = [(cands.groups[q], op) for q, op in zip(qs, ops)]
        max_a = max((g.a for g, _ in path[:-1]), default=0.0)
        max_b = max(g.bb for g, _ in path)
        for s, (g, op) in enumerate(path[:-1]):
            excess = carried(path, s) - bounds.before[g.i] - bounds.after[g.j] - op.load_s
            for p in range(len(pairs[0])):
                if in_pair(pairs, p, max_a, max_b):
                    assert rows[p, qs[s]] + wc * d * g.price * excess <= v * (1 + 1e-9) + 1e-6, (e.config, s, p)
                    checked += 1
    assert checked > 0


BAND_CASES = [c for c in CASES if c[3] >= search.BANDS_FROM_M][:12]


@pytest.mark.parametrize("case", BAND_CASES, ids=lambda c: f"L{len(c[0].layers)}-d{c[1]}-m{c[3]}-w{c[5][1]}")
def test_refuted_bands_and_wait_caps_equal_bruteforce(case, monkeypatch):
    """Every band split as far as it goes, each band's LP asked first (so many are refuted), the
    caps in every MILP, and a coarse gap for the promising MILPs: the optimum is brute force's."""
    monkeypatch.setattr(search, "BAND_SPLIT_GROUPS", 2)
    monkeypatch.setattr(search, "BANDS_ALL_MAX", 0)
    monkeypatch.setattr(search, "PAIR_BUDGET", 0)
    monkeypatch.setattr(search, "PROMISING_GAP", 0.05)
    assert_bruteforce_optimum(case)


def test_the_lp_refutes_some_bands():
    """The cases above really take the refutation path (else they prove nothing about it)."""
    assert sum(x["status"] == "refuted" for info in band_case_infos() for x in info.get("milps", [])) > 0


def test_wait_caps_are_rows_of_the_milp():
    """Given a cutoff and bounds, the MILP holds one more row per non-last group (the caps)."""
    rng = random.Random(5)
    plat = aws_platform()
    prof = profile(rng, 4)
    cands = candidate_groups(prof, plat, 2, 2, 8, (3008, 10240), sync_algos=ALGOS)
    wc, wt = objective_weights(1, 2**19)
    bounds = LowerBounds(cands, wc, wt, plat, 3)
    rows = bounds.group_bounds(bounds.grid(3), ctx=False)
    s = search._Search(prof, plat, cands, 1, 2**19, 3, 1e-7, None, 0.0, math.inf)
    s.best = float(np.min(rows[np.isfinite(rows)])) * 1.5
    qs = [q for q in range(len(cands.groups)) if np.isfinite(rows[q])]
    slack = s.slack(bounds, qs, rows)
    assert slack is not None and len(slack.slack) == len(qs)
    groups = [cands.groups[q] for q in qs]
    args = (cands, groups, plat, wc, wt, 3, 30.0, 1e-7, None, s.cut())
    plain, capped = search.solve_milp(*args), search.solve_milp(*args, slack=slack)
    assert capped.constraints - plain.constraints == sum(g.j < cands.layers for g in groups)
    assert capped.objective == pytest.approx(plain.objective, rel=1e-6)  # the optimum is below the cutoff: kept
