"""Exact MILP co-optimisation of partition, memory tier and sync algorithm per stage.

For a fixed data-parallel degree d and micro-batching (b samples x m micro-batches) — few values,
enumerated by the caller — the performance model of ``perfmodel`` is linear in the decisions once
products are linearised, so one MILP per (d, b) is exact (docs/performance-model.md §7):

  y[l,s,k]  layer l sits in stage s, which runs at tier k      (binary; x[l,s] = sum_k y[l,s,k])
  z[s,k]    stage s uses tier k                                  (binary; u[s] = sum_k z = stage used)
  v[s,a]    stage s syncs with choice a (algorithm, K)           (binary)

Contiguity: layer 0 in stage 0; layer l+1 in the stage of layer l or the next one. Stage
boundaries then follow from cumulative sums c[l,s] = sum_{s'<=s} x[l,s']:
first[l,s] = c[l-1,s-1] - c[l,s-1] (layer l starts stage s), last-of-stage likewise, and
last[s] = x[L-1,s] marks the pipeline's final stage. Everything per stage (parameter bytes,
boundary bytes, compute time at the chosen tier) is then linear in y and x.

Maxima (pipeline bottlenecks, the slowest branch) become variables bounded below; every term
enters the objective with a positive weight, so at the optimum they equal the maxima. Products of
a tier (or algorithm) binary with a continuous time — the billed GB-seconds — are linearised
exactly with big-M: w >= t - M(1 - z), w >= 0. HiGHS (via pulp.HiGHS) solves it; no quadratic
solver is needed.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Sequence

import pulp

from .perfmodel import (
    TRANSITIONS_PER_ITERATION,
    TRANSITIONS_PER_MAP,
    TRANSITIONS_PER_PARALLEL,
    TRANSITIONS_PER_TASK,
    Config,
    SyncChoice,
    optimizer_seconds,
    param_copies,
    sync_choices,
)
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
    sync_algos: Sequence[str] | None = None,
    time_limit: float = 120.0,
    gap: float = 1e-7,
    threads: int | None = None,
) -> MilpResult:
    """Minimise a1*cost + a2*time for fixed (d, b, m). ``config`` is None if infeasible."""
    t0 = time.perf_counter()
    L = len(profile.layers)
    d, b, m = replicas, micro_batch, micro_batches
    tiers = list(tiers or plat.tiers_mb)
    K = range(len(tiers))
    S_ = max_stages_for(d, L, max_stages)
    S = range(S_)
    choices = sync_choices(d, sync_algos)
    A = range(len(choices))
    co = [c.coeffs(d, plat) for c in choices]
    w, lat, o = plat.bandwidth_Bps, plat.storage_latency_s, plat.invoke_overhead_s
    lay = profile.layers
    Pl = [l.param_bytes for l in lay]
    f = [[lay[l].times(t, b, plat)[0] for t in tiers] for l in range(L)]
    g = [[lay[l].times(t, b, plat)[1] for t in tiers] for l in range(L)]
    opt = [[optimizer_seconds(Pl[l], t, plat) for t in tiers] for l in range(L)]
    cap = [plat.usable_bytes(t) for t in tiers]
    copies = param_copies(d, plat)
    maxT = plat.max_predicted_task_s
    # a safe upper bound on every time expression (big-M)
    comm = sum(b * (l.in_bytes_per_sample + l.out_bytes_per_sample + l.ingrad_bytes_per_sample) for l in lay) / w
    comp = sum(max(f[l][k] + g[l][k] for k in K) for l in range(L))
    Ptot = sum(Pl)
    big_t = 3 * o + 2 * (lat + Ptot / w) + m * (comp + comm + 8 * lat * L + b * profile.label_bytes_per_sample / w)
    big_t += max(c.tail_time(Ptot, sum(max(r) for r in opt)) + c.task_time(Ptot, sum(max(r) for r in opt)) for c in co)
    big_t = 1.1 * big_t + 1.0
    big_mem = max([copies] + [c.mem_per_byte for c in co]) * Ptot + 1.0

    prob = pulp.LpProblem("stagecoach_plan", pulp.LpMinimize)
    B = pulp.LpBinary
    # single-layer memory pruning: layer l alone at tier k must fit, else y[l,*,k] = 0
    def alone(l: int) -> float:
        ly = lay[l]
        return copies * ly.param_bytes + b * (ly.saved_bytes_per_sample + 2 * ly.in_bytes_per_sample + 2 * ly.out_bytes_per_sample)

    y = {(l, s, k): pulp.LpVariable(f"y_{l}_{s}_{k}", cat=B) for l in range(L) for s in S if s <= l for k in K if alone(l) <= cap[k]}
    z = {(s, k): pulp.LpVariable(f"z_{s}_{k}", cat=B) for s in S for k in K}
    v = {(s, a): pulp.LpVariable(f"v_{s}_{a}", cat=B) for s in S for a in A}
    for l in range(L):
        if not any((l, s, k) in y for s in S for k in K):
            return MilpResult(None, math.inf, "infeasible: a layer fits no tier", time.perf_counter() - t0, 0, 0)
    X = {(l, s): pulp.lpSum(y[l, s, k] for k in K if (l, s, k) in y) for l in range(L) for s in S}
    u = {s: pulp.lpSum(z[s, k] for k in K) for s in S}
    C = {(l, s): pulp.lpSum(X[l, t] for t in range(s + 1)) for l in range(L) for s in S}

    def first(l: int, s: int):  # layer l is the first layer of stage s
        if l == 0:
            return 1 if s == 0 else 0
        if s == 0:
            return 0
        return C[l - 1, s - 1] - C[l, s - 1]

    def lastof(l: int, s: int):  # layer l is the last layer of stage s
        if l == L - 1:
            return X[l, s]
        return first(l + 1, s + 1) if s + 1 < S_ else X[l, s] - X[l + 1, s]

    last = {s: X[L - 1, s] for s in S}
    # -- structure
    for l in range(L):
        prob += pulp.lpSum(X[l, s] for s in S) == 1
        for s in S:
            if l + 1 < L:
                prob += X[l + 1, s] <= X[l, s] + (X[l, s - 1] if s > 0 else 0)
            for k in K:
                if (l, s, k) in y:
                    prob += y[l, s, k] <= z[s, k]
    for s in S:
        prob += u[s] <= 1
        prob += u[s] <= pulp.lpSum(X[l, s] for l in range(L))
        prob += pulp.lpSum(v[s, a] for a in A) == u[s]
        if s + 1 < S_:
            prob += u[s + 1] <= u[s]
    # -- per-stage linear quantities
    P = {s: pulp.lpSum(Pl[l] * X[l, s] for l in range(L)) for s in S}
    SV = {s: pulp.lpSum(lay[l].saved_bytes_per_sample * X[l, s] for l in range(L)) for s in S}
    IN = {s: pulp.lpSum(lay[l].in_bytes_per_sample * first(l, s) for l in range(L)) for s in S}
    ING = {s: pulp.lpSum(lay[l].ingrad_bytes_per_sample * first(l, s) for l in range(1, L)) for s in S}
    OUT = {s: pulp.lpSum(lay[l].out_bytes_per_sample * lastof(l, s) for l in range(L)) for s in S}
    OUTNL = {s: pulp.lpSum(lay[l].out_bytes_per_sample * lastof(l, s) for l in range(L - 1)) for s in S}
    CF = {s: pulp.lpSum(f[l][k] * y[l, s, k] for l in range(L) for k in K if (l, s, k) in y) for s in S}
    CG = {s: pulp.lpSum(g[l][k] * y[l, s, k] for l in range(L) for k in K if (l, s, k) in y) for s in S}
    OPT = {s: pulp.lpSum(opt[l][k] * y[l, s, k] for l in range(L) for k in K if (l, s, k) in y) for s in S}
    CAP = {s: pulp.lpSum(cap[k] * z[s, k] for k in K) for s in S}
    # -- memory (§2)
    for s in S:
        prob += copies * P[s] + b * (SV[s] + 2 * IN[s] + 2 * OUT[s]) <= CAP[s]
        for a in A:
            if d > 1 and co[a].mem_per_byte > copies:
                prob += co[a].mem_per_byte * P[s] <= CAP[s] + big_mem * (1 - v[s, a])
    # -- forward flow shop (§3.1)
    nv = lambda name, lo=0: pulp.LpVariable(name, lowBound=lo)
    aF = {s: nv(f"aF_{s}") for s in S}
    Lm = {s: nv(f"Lmax_{s}") for s in S}
    Am = {s: nv(f"Amax_{s}") for s in S}
    for s in S:
        prob += aF[s] >= 2 * lat * u[s] + b * (IN[s] + OUT[s]) / w + CF[s] - big_t * last[s]
        prob += Lm[s] >= lat * u[s] + P[s] / w - big_t * last[s]
        prob += Am[s] >= aF[s]
        if s > 0:
            prob += Lm[s] >= Lm[s - 1]
            prob += Am[s] >= Am[s - 1]
    F = {s: o + Lm[s] + pulp.lpSum(aF[t] for t in range(s + 1)) + (m - 1) * Am[s] for s in S}
    TF = nv("T_forward")
    for s in S:
        prob += TF >= F[s] - big_t * (1 - u[s] + last[s])
        prob += F[s] - o <= maxT + big_t * (1 - u[s] + last[s])
    # -- backward flow shop (§3.2), tails and sync (§5)
    bb = {}
    for s in S:
        e = lat * u[s] + b * OUTNL[s] / w + (b * profile.label_bytes_per_sample / w) * last[s]
        e += lat * u[s] + b * IN[s] / w + CF[s] + CG[s]
        if s > 0:
            e += lat * u[s] + b * ING[s] / w
        bb[s] = e
    Bm = {s: nv(f"Bmax_{s}") for s in S}
    LL = nv("load_last")
    for s in S:
        prob += Bm[s] >= bb[s]
        if s + 1 < S_:
            prob += Bm[s] >= Bm[s + 1]
        prob += LL >= lat + P[s] / w - big_t * (1 - last[s])
    Bt = {s: o + LL + pulp.lpSum(bb[t] for t in range(s, S_)) + (m - 1) * Bm[s] for s in S}
    tail = {s: nv(f"tail_{s}") for s in S}
    Sy = {s: nv(f"sync_{s}") for s in S}
    for s in S:
        for a in A:
            c = co[a]
            te = c.tail_lat * u[s] + c.tail_per_byte * P[s] + (OPT[s] if c.tail_opt else 0)
            prob += tail[s] >= te - big_t * (1 - v[s, a])
            if c.tasks:
                prob += Sy[s] >= o + c.task_lat + c.task_per_byte * P[s] + OPT[s] * (1.0 / c.k) - big_t * (1 - v[s, a])
    BT = {s: Bt[s] + tail[s] for s in S}
    TBS = nv("T_backward_sync")
    for s in S:
        prob += TBS >= BT[s] + Sy[s]
        prob += BT[s] - o <= maxT + big_t * (1 - u[s])
        prob += Sy[s] - o <= maxT
    T = TF + TBS
    # -- billing (§4.1): exact products via big-M
    gbs = []
    for s in S:
        for k in K:
            price = plat.price_per_s(tiers[k])
            wf = nv(f"wF_{s}_{k}")
            wb = nv(f"wB_{s}_{k}")
            prob += wf >= F[s] - o - big_t * (1 - z[s, k]) - big_t * last[s]
            prob += wb >= BT[s] - o - big_t * (1 - z[s, k])
            gbs.append(price * d * (wf + wb))
            for a in A:
                if co[a].tasks:
                    ws = nv(f"wS_{s}_{k}_{a}")
                    prob += ws >= Sy[s] - o - big_t * (2 - z[s, k] - v[s, a])
                    gbs.append(price * co[a].tasks * ws)
    # -- requests (§4.2-4.4), all linear in u, last, v
    Ssum = pulp.lpSum(u[s] for s in S)
    invocations = d * (Ssum - 1) + d * Ssum + pulp.lpSum(co[a].tasks * v[s, a] for s in S for a in A)
    trans = TRANSITIONS_PER_ITERATION + TRANSITIONS_PER_PARALLEL
    if S_ > 1:
        trans += TRANSITIONS_PER_MAP * u[1] + TRANSITIONS_PER_TASK * d * (Ssum - 1)
    trans += pulp.lpSum((TRANSITIONS_PER_MAP + TRANSITIONS_PER_TASK * d) * u[s] for s in S)
    trans += pulp.lpSum((TRANSITIONS_PER_MAP + TRANSITIONS_PER_TASK * co[a].tasks) * v[s, a] for s in S for a in A if co[a].tasks)
    poll = plat.s3_polls_per_wait
    gets = puts = 0
    for s in S:
        nl = u[s] - last[s]
        gets += d * m * nl + (d * m * poll * nl if s > 0 else 0)
        puts += d * m * nl
        gets += 2 * d * m * u[s] + d * m * poll * nl
        if s > 0:
            puts += d * m * u[s]
        for a in A:
            c = co[a]
            gets += (d * (c.shards + c.tail_gets) + c.tasks * c.task_gets) * v[s, a]
            puts += (d * c.tail_puts + c.tasks * c.task_puts) * v[s, a]
    cost = pulp.lpSum(gbs) + plat.price_request * invocations + plat.price_transition * trans + plat.price_put * puts + plat.price_get * gets
    # normalise the objective to O(1) for the solver's tolerances
    wc, wt = objective_weights(a1, a2)
    ref = max(1e-12, wc * 1e-4 + wt)
    prob += (wc * cost + wt * T) * (1.0 / ref)
    solver = pulp.HiGHS(msg=False, gapRel=gap, gapAbs=0.0, timeLimit=time_limit, threads=threads)
    status = prob.solve(solver)
    solve_s = time.perf_counter() - t0
    nvars, ncons = len(prob.variables()), len(prob.constraints)
    st = pulp.LpStatus[status]
    if st != "Optimal":
        return MilpResult(None, math.inf, st.lower(), solve_s, nvars, ncons)
    balance, tier_sel, sync_sel = [], [], []
    for s in S:
        if (u[s].value() or 0) < 0.5:
            break
        balance.append(sum(1 for l in range(L) if (X[l, s].value() or 0) > 0.5))
        tier_sel.append(tiers[max(K, key=lambda k: z[s, k].value() or 0)])
        sync_sel.append(choices[max(A, key=lambda a: v[s, a].value() or 0)])
    cfg = Config(tuple(balance), tuple(tier_sel), d, b, m, tuple(sync_sel))
    obj = pulp.value(prob.objective) * ref
    return MilpResult(cfg, obj, "optimal", solve_s, nvars, ncons)
