"""Exact MILP co-optimisation of partition, memory tier and sync algorithm per stage.

For a fixed data-parallel degree d and micro-batching (b samples x m micro-batches) — few values,
enumerated by the caller — one MILP per (d, b, m) is exact (docs/performance-model.md §7). It is an
*interval* (path) formulation:

  x[i,j,k,a] = 1  iff layers i..j-1 form a stage at memory tier k with sync choice a

Every per-stage quantity (``perfmodel.stage_terms``: memory, per-micro-batch steps, parameter
load, sync tail and task, requests, transitions, own billed work) is a *constant* of its interval,
computed by the same code ``evaluate`` uses; memory-infeasible intervals and intervals that cannot
beat the incumbent are never created. The stages form a path 0 -> L through boundary nodes (a
flow: its LP relaxation is integral), so the only weak part left is the billing of the flow-shop
waits, the one genuinely bilinear term (tier price of a stage x a time that depends on other
stages), linearised exactly with a big-M per (boundary, tier). No stage slots: no symmetry.

The flow-shop sums and maxima become node quantities without big-M:
  SumF[n]  = sum of a_s over stages ending at <= n        (linear in x; exact on the path)
  MaxA[n] >= MaxA[n-1], >= a of the stage ending at n     (bounded below; tight at an optimum)
and likewise MaxL (parameter loads) forwards and SumB/MaxB backwards from stage starts. A constraint
written for every node holds trivially at nodes that are not boundaries (their values are those of
the previous boundary, or smaller), so none needs a big-M. HiGHS (pulp.HiGHS) solves it, with the
heuristic incumbent's objective as a cutoff; no quadratic solver is needed.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass
from typing import Sequence

import pulp

from .perfmodel import Config, StageTerms, global_transitions, stage_terms, sync_choices
from .platforms import Platform
from .profile import ModelProfile

COST_UNIT = 1e-9  # objective: a1 * cost / COST_UNIT + a2 * seconds (nano-dollars; see docs/planner.md)


def objective_weights(a1: float, a2: float) -> tuple[float, float]:
    """(weight per USD, weight per second) of the objective, with a tiny tie-break so that a pure
    cost objective prefers the faster of equally cheap plans (and vice versa)."""
    if a1 < 0 or a2 < 0 or a1 + a2 == 0:
        raise ValueError(f"weights ({a1}, {a2}) must be non-negative and not both zero")
    wc = a1 / COST_UNIT if a1 else 1e-9 / COST_UNIT * 1e-9
    wt = a2 if a2 else 1e-3
    return wc, wt


def objective_value(cost: float, time_s: float, a1: float, a2: float) -> float:
    """The objective the MILP minimises, for an evaluated plan."""
    wc, wt = objective_weights(a1, a2)
    return wc * cost + wt * time_s


@dataclass
class MilpResult:
    config: Config | None
    objective: float  # a1 * cost / COST_UNIT + a2 * time, as the MILP computed it
    status: str
    solve_s: float
    variables: int
    constraints: int


def max_stages_for(d: int, layers: int, max_stages: int) -> int:
    """Stage slots: at most one stage per layer, and (S-1)*d forward workers in one inline Map
    (<= 40 concurrent iterations, DESIGN.md §6)."""
    return max(1, min(layers, max_stages, 1 + 40 // d))



def solve_fixed(
    profile: ModelProfile,
    plat: Platform,
    replicas: int,
    micro_batch: int,
    micro_batches: int,
    a1: float = 1.0,
    a2: float = 0.0,
    tiers: Sequence[int] | None = None,
    max_stages: int = 8,
    sync_algos: Sequence[str] | None = ("scatter_reduce",),
    time_limit: float = 30.0,
    gap: float = 1e-6,
    threads: int | None = None,
    incumbent_objective: float | None = None,
    fix: Config | None = None,
) -> MilpResult:
    """Minimise a1*cost + a2*time for fixed (d, b, m). ``config`` is None if infeasible.

    ``incumbent_objective`` (the objective of any feasible plan, e.g. the balanced heuristic's)
    prunes intervals that alone would exceed it, bounds the big-M constants and is HiGHS's
    objective cutoff. ``fix`` evaluates one configuration with the MILP (tests: MILP == evaluate).
    """
    with warnings.catch_warnings():  # pulp 3.x announces its 4.0 API on every variable
        warnings.simplefilter("ignore", DeprecationWarning)
        return _solve_fixed(profile, plat, replicas, micro_batch, micro_batches, a1, a2, tiers, max_stages, sync_algos, time_limit, gap, threads, incumbent_objective, fix)


@dataclass(frozen=True)
class _Interval:
    i: int
    j: int
    k: int  # tier index
    a: int  # sync choice index
    st: StageTerms
    own_cost: float  # USD: the stage's own billed work + its requests and transitions
    fwd_own: float  # load + m a_s (a lower bound of the forward task, part of its billing)
    bwd_own: float  # m bb_s (+ load if last): part of the backward task before its tail
    branch: float  # what the stage adds after its backward flow shop: tail (+ o + sync task)


def candidate_stages(profile: ModelProfile, plat: Platform, d: int, b: int, m: int, tiers: Sequence[int], choices: Sequence, time_cap: float = math.inf, cost_cap: float = math.inf) -> list[_Interval]:
    """Every feasible (interval, tier, sync choice) with its constants; dominated sync choices
    (no better in any respect than another for the same interval and tier) are dropped."""
    lay = profile.layers
    L = len(lay)
    o, maxT = plat.invoke_overhead_s, plat.max_predicted_task_s
    cum = lambda xs: [0.0] + list(__import__("itertools").accumulate(xs))
    P = cum([l.param_bytes for l in lay])
    SV = cum([l.saved_bytes_per_sample for l in lay])
    out: list[_Interval] = []
    for k, tier in enumerate(tiers):
        tm = [l.times(tier, b, plat) for l in lay]
        F = cum([t[0] for t in tm])
        G = cum([t[1] for t in tm])
        cap = plat.usable_bytes(tier)
        price = plat.price_per_s(tier)
        for i in range(L):
            for j in range(i + 1, L + 1):
                last = j == L
                group = []
                for a, ch in enumerate(choices):
                    st = stage_terms(P[j] - P[i], F[j] - F[i], G[j] - G[i], SV[j] - SV[i], lay[i].in_bytes_per_sample,
                                     lay[j - 1].out_bytes_per_sample, lay[i].ingrad_bytes_per_sample, profile.label_bytes_per_sample,
                                     i == 0, last, tier, ch, d, b, m, plat)
                    if st.memory_bytes > cap or st.sync.task_s > maxT:
                        continue
                    fwd_own = 0.0 if last else st.load_s + m * st.fwd_step_s
                    bwd_own = m * st.bwd_step_s + (st.load_s if last else 0.0)
                    if fwd_own > maxT or bwd_own + st.sync.tail_s > maxT:
                        continue
                    branch = st.sync.tail_s + ((o + st.sync.task_s) if st.sync.tasks else 0.0)
                    own = (price * (d * (fwd_own + bwd_own + st.sync.tail_s) + st.sync.tasks * st.sync.task_s)
                           + plat.price_request * st.invocations + plat.price_transition * st.transitions
                           + plat.price_put * st.puts + plat.price_get * st.gets)
                    if (0.0 if last else o + fwd_own) + o + bwd_own + branch > time_cap or own > cost_cap:
                        continue
                    group.append(_Interval(i, j, k, a, st, own, fwd_own, bwd_own, branch))
                for c in group:  # dominance among sync choices of the same stage
                    if not any(o_ is not c and o_.own_cost <= c.own_cost and o_.branch <= c.branch and o_.st.sync.tail_s <= c.st.sync.tail_s
                               and o_.st.sync.task_s <= c.st.sync.task_s and (o_.own_cost, o_.branch, o_.a) < (c.own_cost, c.branch, c.a)
                               for o_ in group):
                        out.append(c)
    return out


def _solve_fixed(profile, plat, replicas, micro_batch, micro_batches, a1, a2, tiers, max_stages, sync_algos, time_limit, gap, threads, incumbent_objective, fix) -> MilpResult:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    L = len(profile.layers)
    d, b, m = replicas, micro_batch, micro_batches
    tiers = list(tiers or plat.tiers_mb)
    choices = sync_choices(d, sync_algos)
    if fix is not None:
        choices = list(dict.fromkeys(list(choices) + list(fix.sync)))
    o, maxT = plat.invoke_overhead_s, plat.max_predicted_task_s
    Smax = max_stages_for(d, L, max_stages)
    wc, wt = objective_weights(a1, a2)
    time_cap = cost_cap = math.inf
    if incumbent_objective is not None:
        slack = incumbent_objective * 1e-7 + 1e-9
        time_cap = (incumbent_objective + slack) / wt
        cost_cap = (incumbent_objective + slack) / wc
    cands = candidate_stages(profile, plat, d, b, m, tiers, choices, time_cap, cost_cap)
    if fix is not None:
        want, i = set(), 0
        for s, n in enumerate(fix.balance):
            want.add((i, i + n, tiers.index(fix.tiers_mb[s]), choices.index(fix.sync[s])))
            i += n
        cands = [c for c in cands if (c.i, c.j, c.k, c.a) in want]
    for l in range(L):
        if not any(c.i <= l < c.j for c in cands):
            return MilpResult(None, math.inf, f"infeasible: layer {profile.layers[l].name} fits in no stage", time.perf_counter() - t0, 0, 0)

    prob = pulp.LpProblem("stagecoach_plan", pulp.LpMinimize)
    x = [pulp.LpVariable(f"x_{c.i}_{c.j}_{c.k}_{c.a}", cat=pulp.LpBinary) for c in cands]
    nv = lambda name: pulp.LpVariable(name, lowBound=0)
    by_start: dict[int, list[int]] = {n: [] for n in range(L + 1)}
    by_end: dict[int, list[int]] = {n: [] for n in range(L + 1)}
    for q, c in enumerate(cands):
        by_start[c.i].append(q)
        by_end[c.j].append(q)
    S = lambda qs, coef: pulp.lpSum(coef(cands[q]) * x[q] for q in qs)
    one = lambda c: 1.0
    # -- path: one stage leaves node 0, one enters node L, flow conserved between
    for n in range(L + 1):
        rhs = 1 if n == 0 else (-1 if n == L else 0)
        prob += S(by_start[n], one) - S(by_end[n], one) == rhs
    nstages = pulp.lpSum(x)
    prob += nstages <= Smax
    single = S([q for q in by_start[0] if cands[q].j == L], one)  # S = 1
    # -- time bounds for big-M (any better plan than the incumbent is at most this slow)
    Tb = min(maxT, time_cap)
    # -- forward (§3.1): node quantities over stages ending at <= n (all non-final)
    MaxL, MaxA, Fnode = {}, {}, {}
    sumF = 0
    for n in range(1, L):
        MaxL[n], MaxA[n] = nv(f"maxL_{n}"), nv(f"maxA_{n}")
        prob += MaxL[n] >= S(by_end[n], lambda c: c.st.load_s)
        prob += MaxA[n] >= S(by_end[n], lambda c: c.st.fwd_step_s)
        if n > 1:
            prob += MaxL[n] >= MaxL[n - 1]
            prob += MaxA[n] >= MaxA[n - 1]
        sumF = sumF + S(by_end[n], lambda c: c.st.fwd_step_s)
        Fnode[n] = MaxL[n] + sumF + (m - 1) * MaxA[n]  # F_s - o of the stage ending at n
        prob += Fnode[n] <= maxT
    TF = nv("T_forward")
    if L > 1:
        prob += TF >= Fnode[L - 1] + o * (1 - single)
    # -- backward (§3.2): node quantities over stages starting at >= n
    LL = S(by_end[L], lambda c: c.st.load_s)
    MaxB, Bnode = {}, {}
    sumB = 0
    TBS = nv("T_backward_sync")
    for n in range(L - 1, -1, -1):
        MaxB[n] = nv(f"maxB_{n}")
        prob += MaxB[n] >= S(by_start[n], lambda c: c.st.bwd_step_s)
        if n < L - 1:
            prob += MaxB[n] >= MaxB[n + 1]
        sumB = sumB + S(by_start[n], lambda c: c.st.bwd_step_s)
        Bnode[n] = LL + sumB + (m - 1) * MaxB[n]  # B_s - o of the stage starting at n (before its tail)
        prob += TBS >= o + Bnode[n] + S(by_start[n], lambda c: c.branch)
        prob += Bnode[n] + S(by_start[n], lambda c: c.st.sync.tail_s) <= maxT
    # valid inequalities: the bottleneck is at least the average stage
    if L > 1:
        prob += MaxB[0] * Smax >= sumB
        prob += MaxA[L - 1] * max(1, Smax - 1) >= sumF
    # -- billing (§4.1): own work is constant per interval; the waits on other stages (the rest)
    # are billed at the stage's tier: rest[n,k] >= wait - Tb (1 - [a tier-k stage ends/starts at n])
    cost = S(range(len(cands)), lambda c: c.own_cost)
    cost = cost + plat.price_transition * (global_transitions(1) + (global_transitions(2) - global_transitions(1)) * (1 - single))
    for n in range(1, L):
        ownF = S(by_end[n], lambda c: c.fwd_own)
        for k, tier in enumerate(tiers):
            z = [q for q in by_end[n] if cands[q].k == k]
            if not z:
                continue
            r = nv(f"rF_{n}_{k}")
            prob += r >= Fnode[n] - ownF - Tb * (1 - S(z, one))
            cost = cost + plat.price_per_s(tier) * d * r
    for n in range(L):
        ownB = S(by_start[n], lambda c: c.bwd_own)
        for k, tier in enumerate(tiers):
            z = [q for q in by_start[n] if cands[q].k == k]
            if not z:
                continue
            r = nv(f"rB_{n}_{k}")
            prob += r >= Bnode[n] - ownB - Tb * (1 - S(z, one))
            cost = cost + plat.price_per_s(tier) * d * r
    ref = max(1e-12, wc * 1e-4 + wt)
    prob += (wc * cost + wt * (TF + TBS)) * (1.0 / ref)
    opts = {}
    if incumbent_objective is not None and fix is None:
        opts["objective_bound"] = (incumbent_objective * (1 + 1e-6) + 1e-9) / ref
    solver = pulp.HiGHS(msg=False, gapRel=gap, gapAbs=0.0, timeLimit=time_limit, threads=threads, **opts)
    status = prob.solve(solver)
    solve_s = time.perf_counter() - t0
    nvars, ncons = len(prob.variables()), len(prob.constraints)
    if pulp.LpStatus[status] != "Optimal":
        return MilpResult(None, math.inf, pulp.LpStatus[status].lower(), solve_s, nvars, ncons)
    try:  # pulp reports a time-limited incumbent as "Optimal"; ask HiGHS itself
        ms = prob.solverModel.modelStatusToString(prob.solverModel.getModelStatus()).lower()
        proven = "optimal" in ms
    except Exception:  # pragma: no cover - older highspy
        proven = True
    chosen = {cands[q].i: cands[q] for q in range(len(cands)) if (x[q].value() or 0) > 0.5}
    balance, tier_sel, sync_sel = [], [], []
    n = 0
    while n < L:
        c = chosen[n]
        balance.append(c.j - c.i)
        tier_sel.append(tiers[c.k])
        sync_sel.append(choices[c.a])
        n = c.j
    cfg = Config(tuple(balance), tuple(tier_sel), d, b, m, tuple(sync_sel))
    obj = pulp.value(prob.objective) * ref
    return MilpResult(cfg, obj, "optimal" if proven else "time_limit", solve_s, nvars, ncons)
