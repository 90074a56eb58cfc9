"""The MILP over a set of candidate stages (planner/solve/search.py has the whole method).

3. The MILP over the remaining groups: a *path* formulation, x[g,o] = 1 iff g is a stage with
   option o; the stages form a path 0 -> L through boundary nodes (a network flow: its LP
   relaxation is integral). What couples the stages are the two flow shops: the forward task of
   stage s lasts F_s = maxL_{<=s} + sumA_{<=s} + (m-1) maxA_{<=s} (prefix sums and maxima), the
   backward task BT_s = l_last + sumB_{>=s} + (m-1) maxB_{>=s} + tail_s (suffix ones), and both
   are billed at the stage's own tier: price_s x F_s is the one genuinely bilinear term. It is
   linearised exactly and without big-M by *carrying the flow-shop state along the path*: every
   group has variables for the prefix state it receives (ea: the forward steps before it, em and
   el: their maximum step and parameter load) and for the suffix state flowing backwards from the
   last stage (xb, xm, ll, and xw: the latest branch end after it). At every node the state leaving the stage that ends there equals the
   state entering the stage that starts there (conservation, like the path itself), and a
   group's state is 0 unless the group is chosen (ea <= U y_g with U a longest-path bound). Then
   F_g = ml + ea + a y + (m-1) ma, with ma >= em and ma >= a y, is the stage's forward duration if
   chosen and 0 otherwise, and sum_g price_g d F_g is the exact bill, linear. Maxima are
   variables bounded below; each is billed or timed with a positive weight, so it is tight at an
   optimum. T = T_F + T_BS with T_F the state carried into the last stage and T_BS = o + the
   latest branch end carried to the first stage. HiGHS (pulp.HiGHS) solves it with the incumbent
   as a cutoff.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pulp

from stagecoach.planner.model.perfmodel import (
    Config,
    global_transitions,
    phase_overhead,
)
from stagecoach.planner.model.platforms import Platform
from stagecoach.planner.solve.candidates import Candidates, Group
from stagecoach.planner.solve.objective import weighted_objective


# -- the MILP over a set of groups ----------------------------------------------------------------
@dataclass
class MilpSolution:
    config: Config | None
    objective: float
    status: str  # "optimal", "time_limit", "infeasible" (nothing below the cutoff), or HiGHS's word
    variables: int
    constraints: int


def solve_milp(
    cands: Candidates,
    groups: Sequence[Group],
    plat: Platform,
    wc: float,
    wt: float,
    smax: int,
    time_limit: float,
    gap: float,
    threads: int | None,
    cutoff: float | None,
    relax: bool = False,
    floors: tuple[float, float] = (0.0, 0.0),
) -> MilpSolution:
    """Build and solve the path MILP over ``groups`` (module docstring, step 3)."""
    L, d, b, m = cands.layers, cands.replicas, cands.micro_batch, cands.micro_batches
    o, maxT = phase_overhead(plat, d), plat.max_predicted_task_s
    if any(not any(g.i <= l < g.j for g in groups) for l in range(L)):
        return MilpSolution(None, math.inf, "infeasible", 0, 0)
    start: dict[int, list[int]] = {n: [] for n in range(L + 1)}
    end: dict[int, list[int]] = {n: [] for n in range(L + 1)}
    for q, g in enumerate(groups):
        start[g.i].append(q)
        end[g.j].append(q)
    # valid upper bounds of the carried state at each node (longest paths over these groups,
    # capped by the task limit: F_s >= sumA and >= m maxA, BT_s >= sumB and >= m maxB; and by the
    # cutoff: a plan below it has wt * T <= cutoff, so every carried time is <= cutoff / wt)
    tcap = cutoff / wt if cutoff is not None and math.isfinite(cutoff) and wt > 0 else math.inf
    ccap = cutoff / wc if cutoff is not None and math.isfinite(cutoff) and wc > 0 else math.inf
    UA, UM, UL = [0.0] * (L + 1), [0.0] * (L + 1), [0.0] * (L + 1)
    for n in range(1, L):
        for q in end[n]:
            g = groups[q]
            UA[n] = max(UA[n], UA[g.i] + g.af)
            UM[n] = max(UM[n], UM[g.i], g.a)
            UL[n] = max(UL[n], UL[g.i], max(op.load_s for op in g.options))
        UA[n], UM[n], UL[n] = min(UA[n], maxT, tcap), min(UM[n], maxT / m, tcap / m), min(UL[n], tcap)
    UB, UX = [0.0] * (L + 1), [0.0] * (L + 1)
    for n in range(L - 1, 0, -1):
        for q in start[n]:
            g = groups[q]
            UB[n] = max(UB[n], UB[g.j] + g.bf)
            UX[n] = max(UX[n], UX[g.j], g.bb)
        UB[n], UX[n] = min(UB[n], maxT, tcap), min(UX[n], maxT / m, tcap / m)
    ULL = min(tcap, max((op.load_s for q in end[L] for op in groups[q].options), default=0.0))
    # and per group from the bill: d * price * (its task's duration) <= cost <= cutoff / wc
    fcap = [ccap / (d * g.price) for g in groups]

    prob = pulp.LpProblem("stagecoach_plan", pulp.LpMinimize)
    cat = pulp.LpContinuous if relax else pulp.LpBinary
    V = pulp.LpVariable

    def E(pairs: Any, const: float = 0.0) -> pulp.LpAffineExpression:
        """A linear expression that sums repeated variables (pulp's constructor keeps the last)."""
        acc: dict[Any, float] = {}
        for var, c in pairs:
            acc[var] = acc.get(var, 0.0) + c
        return pulp.LpAffineExpression(acc, const)

    x = [[V(f"x_{g.i}_{g.j}_{g.k}_{op.a}", 0, 1, cat) for op in g.options] for g in groups]
    # path: one stage leaves node 0, one enters node L, flow conserved in between; S <= Smax
    for n in range(L + 1):
        rhs = 1 if n == 0 else (-1 if n == L else 0)
        prob += E([(v, 1.0) for q in start[n] for v in x[q]] + [(v, -1.0) for q in end[n] for v in x[q]]) == rhs, f"path_{n}"
    prob += E([(v, 1.0) for xs in x for v in xs]) <= smax, "stages"
    single = E([(v, 1.0) for q in start[0] if groups[q].j == L for v in x[q]])  # 1 iff S = 1
    # forward (§3.1): prefix state carried into each group (ea, em, el), 0 unless chosen
    ea, em, el, ma, ml, Fexpr = {}, {}, {}, {}, {}, {}
    for q, g in enumerate(groups):
        if g.i == 0:
            continue
        ua, um, ul = min(UA[g.i], fcap[q]), min(UM[g.i], fcap[q] / m), min(UL[g.i], fcap[q])
        ea[q], em[q], el[q] = V(f"ea_{q}", 0, ua), V(f"em_{q}", 0, um), V(f"el_{q}", 0, ul)
        for var, u in ((ea[q], ua), (em[q], um), (el[q], ul)):
            prob += E([(var, 1.0)] + [(v, -u) for v in x[q]]) <= 0
    for q, g in enumerate(groups):
        if g.j == L:
            continue  # the last stage's forward runs inside its backward task
        ma[q], ml[q] = V(f"ma_{q}", 0), V(f"ml_{q}", 0)
        prob += E([(ma[q], 1.0)] + [(v, -g.a) for v in x[q]]) >= 0
        prob += E([(ml[q], 1.0)] + [(v, -op.load_s) for v, op in zip(x[q], g.options)]) >= 0
        if q in em:
            prob += E([(ma[q], 1.0), (em[q], -1.0)]) >= 0
            prob += E([(ml[q], 1.0), (el[q], -1.0)]) >= 0
        terms = [(ml[q], 1.0), (ma[q], m - 1.0)] + [(v, g.ao) for v in x[q]] + ([(ea[q], 1.0)] if q in ea else [])
        Fexpr[q] = E(terms)  # F_s - o: the forward task's duration
        if UL[g.i] + UA[g.i] + g.ao + (m - 1) * max(UM[g.i], g.a) > maxT:
            prob += E(terms + [(v, -maxT) for v in x[q]]) <= 0
    for n in range(1, L):
        ins, outs = end[n], start[n]
        prob += (
            E([(ea[q], 1.0) for q in ins if q in ea] + [(v, groups[q].af) for q in ins for v in x[q]] + [(ea[q], -1.0) for q in outs]) == 0,
            f"sumA_{n}",
        )
        prob += E([(ma[q], 1.0) for q in ins] + [(em[q], -1.0) for q in outs]) == 0, f"maxA_{n}"
        prob += E([(ml[q], 1.0) for q in ins] + [(el[q], -1.0) for q in outs]) == 0, f"maxL_{n}"
    # T_F = F_{S-2}: the sum carried into the last stage holds every forward stage's hop to its
    # successor, and the last forward stage's own task ends at its PUT, one poll earlier
    # (fwd_hop_s - fwd_hop_own_s = poll_delay_s for every stage)
    of = o - plat.poll_delay_s
    TF = (
        E(
            [(ea[q], 1.0) for q in end[L] if q in ea]
            + [(em[q], m - 1.0) for q in end[L] if q in em]
            + [(el[q], 1.0) for q in end[L] if q in el],
            of,
        )
        - of * single
    )
    # backward (§3.2): suffix state carried into each group from the stages after it
    xb, xm, ll, mb, BTexpr = {}, {}, {}, {}, {}
    for q, g in enumerate(groups):
        mb[q] = V(f"mb_{q}", 0)
        prob += E([(mb[q], 1.0)] + [(v, -g.bb) for v in x[q]]) >= 0
        terms = [(mb[q], m - 1.0)] + [(v, g.bo) for v in x[q]]
        if g.j < L:
            ub, ux, ul = min(UB[g.j], fcap[q]), min(UX[g.j], fcap[q] / m), min(ULL, fcap[q])
            xb[q], xm[q], ll[q] = V(f"xb_{q}", 0, ub), V(f"xm_{q}", 0, ux), V(f"ll_{q}", 0, ul)
            for var, u in ((xb[q], ub), (xm[q], ux), (ll[q], ul)):
                prob += E([(var, 1.0)] + [(v, -u) for v in x[q]]) <= 0
            prob += E([(mb[q], 1.0), (xm[q], -1.0)]) >= 0
            terms += [(xb[q], 1.0), (ll[q], 1.0)]
            hi = ULL + UB[g.j] + g.bo + (m - 1) * max(UX[g.j], g.bb)
        else:
            terms += [(v, op.load_s) for v, op in zip(x[q], g.options)]
            hi = max(op.load_s for op in g.options) + g.bo + (m - 1) * g.bb
        BTexpr[q] = E(terms)  # BT_s - o - tail_s
        if hi + max(op.tail_s for op in g.options) > maxT:
            prob += E(terms + [(v, op.tail_s - maxT) for v, op in zip(x[q], g.options)]) <= 0
    for n in range(1, L):
        ins, outs = start[n], end[n]  # stages starting at n pass their suffix state to the stage ending at n
        prob += (
            E([(xb[q], 1.0) for q in ins if q in xb] + [(v, groups[q].bf) for q in ins for v in x[q]] + [(xb[q], -1.0) for q in outs]) == 0,
            f"sumB_{n}",
        )
        prob += E([(mb[q], 1.0) for q in ins] + [(xm[q], -1.0) for q in outs]) == 0, f"maxB_{n}"
        prob += (
            E(
                [(ll[q], 1.0) for q in ins if q in ll]
                + [(v, op.load_s) for q in ins if groups[q].j == L for v, op in zip(x[q], groups[q].options)]
                + [(ll[q], -1.0) for q in outs]
            )
            == 0,
            f"lastL_{n}",
        )
    if floors[0] > 0:  # the band's floor of the forward bottleneck: the max carried into the last stage
        prob += E([(em[q], 1.0) for q in end[L] if q in em]) >= floors[0], "floorA"
    if floors[1] > 0:  # ... and of the backward bottleneck: the suffix max of the first stage
        prob += E([(mb[q], 1.0) for q in start[0]]) >= floors[1], "floorB"
    # T_BS = o + max over stages of (BT_s + its branch's extra): the running maximum is carried
    # backwards like the other suffix state (W_q >= xw_q, W_q >= the group's own branch end), so
    # the LP relaxation takes the max along each path rather than over diluted node sums
    UW = [0.0] * (L + 1)
    for n in range(L - 1, 0, -1):
        for q in start[n]:
            g = groups[q]
            UW[n] = max(UW[n], UW[g.j], ULL + UB[g.j] + g.bo + (m - 1) * max(UX[g.j], g.bb) + max(op.extra_s for op in g.options))
        UW[n] = min(UW[n], tcap, maxT + max((op.extra_s for q in start[n] for op in groups[q].options), default=0.0))
    W, xw = {}, {}
    for q, g in enumerate(groups):
        W[q] = V(f"w_{q}", 0)
        own_end = [(var, -c) for var, c in BTexpr[q].items()] + [(v, -op.extra_s) for v, op in zip(x[q], g.options)]
        prob += E([(W[q], 1.0)] + own_end) >= 0
        if g.j < L:
            xw[q] = V(f"xw_{q}", 0, UW[g.j])
            prob += E([(xw[q], 1.0)] + [(v, -UW[g.j]) for v in x[q]]) <= 0
            prob += E([(W[q], 1.0), (xw[q], -1.0)]) >= 0
    for n in range(1, L):
        prob += E([(W[q], 1.0) for q in start[n]] + [(xw[q], -1.0) for q in end[n]]) == 0, f"maxBranch_{n}"
    TBS = V("T_backward_sync", 0)
    prob += E([(TBS, 1.0)] + [(W[q], -1.0) for q in start[0]]) >= o, "branch_0"
    for n in range(1, L):  # valid (implied) node rows: cheap, and they help the LP where flows merge
        terms = [(TBS, 1.0)]
        for q in start[n]:
            terms += [(var, -c) for var, c in BTexpr[q].items()]
            terms += [(v, -op.extra_s) for v, op in zip(x[q], groups[q].options)]
        prob += E(terms) >= o, f"branch_{n}"
    # cost (§4): own constants + every task's duration at its tier
    cost_terms: list[tuple[Any, float]] = []
    for q, g in enumerate(groups):
        cost_terms += [(v, op.own_cost) for v, op in zip(x[q], g.options)]
        cost_terms += [(var, d * g.price * c) for var, c in BTexpr[q].items()]
        if q in Fexpr:
            cost_terms += [(var, d * g.price * c) for var, c in Fexpr[q].items()]
    pt = plat.price_transition
    cost = E(cost_terms, pt * global_transitions(2)) - pt * (global_transitions(2) - global_transitions(1)) * single
    ref = max(1e-12, wc * 1e-4 + wt)  # scale the objective to O(1e4) for HiGHS's tolerances
    prob += weighted_objective(cost, TF + TBS + plat.iteration_overhead_s, wc, wt) * (1.0 / ref)
    # Measured on these models: restarts re-presolve the root again and again, and the sub-MIP
    # heuristics (RINS, RENS, root reduced cost) take most of the time while the incumbent from
    # the heuristic plan is already good; without them the same proofs take 2-10x less time.
    opts: dict[str, Any] = {
        "mip_allow_restart": False,
        "mip_heuristic_run_rins": False,
        "mip_heuristic_run_rens": False,
        "mip_heuristic_run_root_reduced_cost": False,
    }
    if cutoff is not None and math.isfinite(cutoff) and not relax:
        opts["objective_bound"] = cutoff / ref
    solver = pulp.HiGHS(msg=False, gapRel=gap, gapAbs=0.0, timeLimit=time_limit, threads=threads, **opts)
    status = prob.solve(solver)
    nvars, ncons = len(prob.variables()), len(prob.constraints)
    try:
        ms = prob.solverModel.modelStatusToString(prob.solverModel.getModelStatus()).lower()
    except Exception:  # pragma: no cover - older highspy
        ms = pulp.LpStatus[status].lower()
    if relax:
        return MilpSolution(None, pulp.value(prob.objective) * ref if ms == "optimal" else math.inf, ms, nvars, ncons)
    if pulp.LpStatus[status] != "Optimal":
        proven_empty = ms in ("infeasible", "objective bound")  # nothing better than the cutoff exists
        return MilpSolution(None, math.inf, "infeasible" if proven_empty else ms, nvars, ncons)
    chosen = {}
    for q, g in enumerate(groups):
        for v, op in zip(x[q], g.options):
            if (v.value() or 0) > 0.5:
                chosen[g.i] = (g, op)
    balance, tier_sel, sync_sel = [], [], []
    n = 0
    while n < L:
        g, op = chosen[n]
        balance.append(g.j - g.i)
        tier_sel.append(g.tier)
        sync_sel.append(op.choice)
        n = g.j
    cfg = Config(tuple(balance), tuple(tier_sel), d, b, m, tuple(sync_sel))
    return MilpSolution(cfg, pulp.value(prob.objective) * ref, "optimal" if ms == "optimal" else "time_limit", nvars, ncons)
