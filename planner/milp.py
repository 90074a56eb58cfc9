"""Exact MILP co-optimisation of partition, memory tier and sync algorithm per stage.

For a fixed data-parallel degree d and micro-batching (b samples x m micro-batches) — few values,
enumerated by the caller — the performance model of ``perfmodel`` becomes linear once products are
linearised, so one MILP per (d, b) is exact (docs/performance-model.md §7). It is a *layer-chain*
formulation (no stage slots, hence no slot symmetry):

  e[l]      a stage boundary after layer l                   (binary, l < L-1)
  t[l,k]    layer l's stage runs at memory tier k            (binary; constant within a stage)
  al[l,a]   layer l's stage syncs with choice a (algo, K)    (binary; constant within a stage)

st[l] = e[l-1] marks the first layer of a stage, e[l] the last one of a non-final stage, and
q[l] = "no boundary at or after l" the final stage (whose forward is empty). Sums over stages
become sums over layers (the flow-shop prefix/suffix sums), per-stage totals become accumulators
that reset at boundaries, and maxima (bottlenecks, the slowest branch) become variables bounded
below: every one enters the objective with a positive weight, so at an optimum they are tight.
Products of a binary and a continuous time (billed GB-seconds) are linearised exactly with big-M,
split into the stage's own compute work (exactly linear in t) plus the rest, which gives the LP
relaxation a strong bound. HiGHS (pulp.HiGHS) solves it; no quadratic solver is needed.
"""

from __future__ import annotations

import math
import time
import warnings
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
    sync_algos: Sequence[str] | None = ("scatter_reduce",),
    time_limit: float = 30.0,
    gap: float = 1e-6,
    threads: int | None = None,
    incumbent_objective: float | None = None,
    fix: Config | None = None,
) -> MilpResult:
    """Minimise a1*cost + a2*time for fixed (d, b, m). ``config`` is None if infeasible.

    ``incumbent_objective`` (the objective of any feasible plan) tightens the big-M constants:
    with a2 > 0 no task of an optimal plan can outlast obj/a2 seconds.
    """
    with warnings.catch_warnings():  # pulp 3.x announces its 4.0 API on every variable
        warnings.simplefilter("ignore", DeprecationWarning)
        return _solve_fixed(profile, plat, replicas, micro_batch, micro_batches, a1, a2, tiers, max_stages, sync_algos, time_limit, gap, threads, incumbent_objective, fix)


def _solve_fixed(profile, plat, replicas, micro_batch, micro_batches, a1, a2, tiers, max_stages, sync_algos, time_limit, gap, threads, incumbent_objective, fix) -> MilpResult:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    L = len(profile.layers)
    d, b, m = replicas, micro_batch, micro_batches
    tiers = list(tiers or plat.tiers_mb)
    K = range(len(tiers))
    Smax = max_stages_for(d, L, max_stages)
    choices = sync_choices(d, sync_algos)
    A = range(len(choices))
    co = [c.coeffs(d, plat) for c in choices]
    w, lat, o = plat.bandwidth_Bps, plat.storage_latency_s, plat.invoke_overhead_s
    lay = profile.layers
    R = range(L)
    # Sizes in MiB inside the model: bytes (1e9) next to seconds per byte (1e-8) would give HiGHS
    # badly scaled rows, and its cuts then drop feasible points.
    MB = float(2**20)
    Pl = [l.param_bytes / MB for l in lay]
    SVl = [l.saved_bytes_per_sample / MB for l in lay]
    INl = [l.in_bytes_per_sample / MB for l in lay]
    IGl = [l.ingrad_bytes_per_sample / MB for l in lay]
    OUTl = [l.out_bytes_per_sample / MB for l in lay]
    LAB = profile.label_bytes_per_sample / MB
    w = w / MB
    f = [[lay[l].times(t, b, plat)[0] for t in tiers] for l in R]
    g = [[lay[l].times(t, b, plat)[1] for t in tiers] for l in R]
    opt = [[optimizer_seconds(lay[l].param_bytes, t, plat) for t in tiers] for l in R]
    cap = [plat.usable_bytes(t) / MB for t in tiers]
    price = [plat.price_per_s(t) for t in tiers]
    copies = param_copies(d, plat)
    maxT = plat.max_predicted_task_s
    wc, wt = objective_weights(a1, a2)
    Mt = maxT + o
    if incumbent_objective is not None and a2 > 0:
        Mt = min(Mt, incumbent_objective / wt + o)
    Mt += 1.0
    Ptot = sum(Pl)
    optmax = sum(max(r) for r in opt)
    Malg = 1.0 + o + max(max(c.tail_time(Ptot * MB, optmax), c.task_time(Ptot * MB, optmax)) for c in co)
    Mp = Ptot + 1.0
    Mo = optmax + 1.0

    def alone(l: int) -> float:
        return copies * Pl[l] + b * (SVl[l] + 2 * INl[l] + 2 * OUTl[l])

    fits = {(l, k): alone(l) <= cap[k] for l in R for k in K}
    for l in R:
        if not any(fits[l, k] for k in K):
            return MilpResult(None, math.inf, f"infeasible: layer {lay[l].name} fits no tier", time.perf_counter() - t0, 0, 0)

    prob = pulp.LpProblem("stagecoach_plan", pulp.LpMinimize)
    Bn = pulp.LpBinary
    nv = lambda name, hi=None: pulp.LpVariable(name, lowBound=0, upBound=hi)
    e = {l: pulp.LpVariable(f"e_{l}", cat=Bn) for l in range(L - 1)}
    t = {(l, k): pulp.LpVariable(f"t_{l}_{k}", cat=Bn) for l in R for k in K if fits[l, k]}
    al = {(l, a): pulp.LpVariable(f"al_{l}_{a}", cat=Bn) for l in R for a in A}
    T = lambda l, k: t.get((l, k), 0)
    st = {l: (1 if l == 0 else e[l - 1]) for l in R}
    en = {l: (e[l] if l < L - 1 else 1) for l in R}
    esum = pulp.lpSum(e.values())
    # -- structure
    prob += esum <= Smax - 1
    for l in R:
        prob += pulp.lpSum(T(l, k) for k in K) == 1
        prob += pulp.lpSum(al[l, a] for a in A) == 1
        if l + 1 < L:
            for k in K:
                prob += T(l + 1, k) - T(l, k) <= e[l]
                prob += T(l, k) - T(l + 1, k) <= e[l]
            for a in A:
                prob += al[l + 1, a] - al[l, a] <= e[l]
                prob += al[l, a] - al[l + 1, a] <= e[l]
    # q[l]: layer l is in the final stage
    q = {l: nv(f"q_{l}", 1) for l in R}
    for l in R:
        later = [e[j] for j in range(l, L - 1)]
        prob += q[l] >= 1 - pulp.lpSum(later)
        for j in later:
            prob += q[l] <= 1 - j
    tn = {}
    for (l, k), var in t.items():  # t[l,k] and not in the final stage
        tn[l, k] = nv(f"tn_{l}_{k}", 1)
        prob += tn[l, k] >= var - q[l]
        prob += tn[l, k] <= var
        prob += tn[l, k] <= 1 - q[l]
    sn = {}
    for l in R:  # l starts a non-final stage
        sn[l] = nv(f"sn_{l}", 1)
        prob += sn[l] >= st[l] - q[l]
        prob += sn[l] <= st[l]
        prob += sn[l] <= 1 - q[l]
    TN = lambda l, k: tn.get((l, k), 0)

    def acc_exact(name: str, vals: dict, forward: bool, big: float) -> dict:
        """Within-stage running sums, reset at boundaries, with equality (both directions)."""
        out = {}
        order = list(R) if forward else list(reversed(R))
        prev = None
        for l in order:
            v = nv(f"{name}_{l}")
            out[l] = v
            prob.addConstraint(v >= vals[l])
            if prev is not None:
                cut = e[prev] if forward else e[l]
                prob.addConstraint(v >= out[prev] + vals[l] - big * cut)
                prob.addConstraint(v <= out[prev] + vals[l])
                prob.addConstraint(v <= vals[l] + big * (1 - cut))
            else:
                prob.addConstraint(v <= vals[l])
            prev = l
        return out

    def acc_lower(name: str, vals: dict, forward: bool, big: float) -> dict:
        """Running sums bounded below only (used where larger is never better)."""
        out = {}
        order = list(R) if forward else list(reversed(R))
        prev = None
        for l in order:
            v = nv(f"{name}_{l}")
            out[l] = v
            prob.addConstraint(v >= vals[l])
            if prev is not None:
                cut = e[prev] if forward else e[l]
                prob.addConstraint(v >= out[prev] + vals[l] - big * cut)
            prev = l
        return out


    # -- memory (§2): checked at each stage's last layer
    memv = {l: copies * Pl[l] + b * SVl[l] for l in R}
    accM = {}
    for l in R:
        v = nv(f"accM_{l}")
        accM[l] = v
        prob += v >= memv[l] + 2 * b * INl[l] * st[l]
        if l > 0:
            prob += v >= accM[l - 1] + memv[l] - (copies * Mp + b * 4 * Mp) * e[l - 1]
    accP = acc_lower("accP", {l: Pl[l] for l in R}, True, Mp)
    CAPl = {l: pulp.lpSum(cap[k] * T(l, k) for k in K) for l in R}
    big_mem = max([copies] + [c.mem_per_byte for c in co]) * Ptot + 4 * b * sum(SVl[l] + INl[l] + OUTl[l] for l in R) + max(cap)
    for l in R:
        prob += accM[l] + 2 * b * OUTl[l] <= CAPl[l] + big_mem * (1 - en[l])
        for a in A:
            if d > 1 and co[a].mem_per_byte > copies:
                prob += co[a].mem_per_byte * accP[l] <= CAPl[l] + big_mem * (2 - en[l] - al[l, a])
    # -- forward flow shop (§3.1)
    fc = {l: pulp.lpSum(f[l][k] * TN(l, k) for k in K) for l in R}
    cF = {l: fc[l] + sn[l] * (2 * lat + b * INl[l] / w) + (e[l] * (b * OUTl[l] / w) if l < L - 1 else 0) for l in R}
    accF = acc_lower("accF", cF, True, Mt)
    accFC = acc_exact("accFC", fc, True, Mt)
    Am, Lm = {}, {}
    for l in R:
        Am[l] = nv(f"Amax_{l}")
        Lm[l] = nv(f"Lmax_{l}")
        prob += Am[l] >= accF[l]
        if l < L - 1:
            prob += Lm[l] >= lat + accP[l] * (1 / w) - Mt * (1 - e[l])
        if l > 0:
            prob += Am[l] >= Am[l - 1]
            prob += Lm[l] >= Lm[l - 1]
    SA = {}
    run = 0
    for l in R:
        run = run + cF[l]
        SA[l] = run
    Fend = {l: o + Lm[l] + SA[l] + (m - 1) * Am[l] for l in R}
    TF = nv("T_forward")
    for l in range(L - 1):
        prob += TF >= Fend[l] - Mt * (1 - e[l])
        prob += Fend[l] - o <= maxT + Mt * (1 - e[l])
    # -- backward flow shop (§3.2), reverse order
    gc = {l: pulp.lpSum((f[l][k] + g[l][k]) * T(l, k) for k in K) for l in R}
    cB = {}
    for l in R:
        c = gc[l] + st[l] * (lat + b * INl[l] / w)
        if l > 0:
            c += st[l] * (lat + b * IGl[l] / w)
        if l < L - 1:
            c += e[l] * (lat + b * OUTl[l] / w)
        else:
            c += lat + b * LAB / w
        cB[l] = c
    accB = acc_lower("accB", cB, False, Mt)
    accBC = acc_exact("accBC", gc, False, Mt)
    accPb = acc_lower("accPb", {l: Pl[l] for l in R}, False, Mp)
    accOb = acc_lower("accOb", {l: pulp.lpSum(opt[l][k] * T(l, k) for k in K) for l in R}, False, Mo)
    Bm = {}
    for l in reversed(R):
        Bm[l] = nv(f"Bmax_{l}")
        prob += Bm[l] >= accB[l]
        if l < L - 1:
            prob += Bm[l] >= Bm[l + 1]
    # valid inequalities: a bottleneck is at least the average stage (<= Smax stages)
    prob += Bm[0] >= pulp.lpSum(cB.values()) * (1.0 / Smax)
    if Smax > 1:
        prob += Am[L - 1] >= pulp.lpSum(cF.values()) * (1.0 / (Smax - 1))
    LL = nv("load_last")
    prob += LL >= lat + pulp.lpSum(Pl[l] * q[l] for l in R) * (1 / w)
    SB = {}
    run = 0
    for l in reversed(R):
        run = run + cB[l]
        SB[l] = run
    Bstart = {l: o + LL + SB[l] + (m - 1) * Bm[l] for l in R}
    tail = {l: nv(f"tail_{l}") for l in R}
    Sy = {l: nv(f"sync_{l}") for l in R}
    TBS = nv("T_backward_sync")
    for l in R:
        for a in A:
            c = co[a]
            te = c.tail_lat + c.tail_per_byte * MB * accPb[l] + (accOb[l] if c.tail_opt else 0)
            prob += tail[l] >= te - Malg * (2 - st[l] - al[l, a])
            if c.tasks:
                prob += Sy[l] >= o + c.task_lat + c.task_per_byte * MB * accPb[l] + accOb[l] * (1.0 / c.k) - Malg * (2 - st[l] - al[l, a])
        prob += TBS >= Bstart[l] + tail[l] + Sy[l] - (Mt + 2 * Malg) * (1 - st[l])
        prob += Bstart[l] + tail[l] - o <= maxT + (Mt + Malg) * (1 - st[l])
        prob += Sy[l] - o <= maxT + Malg * (1 - st[l])
    # -- billing (§4.1): own compute work exactly linear in t, the rest via big-M per tier
    sync_terms: list = []
    gbs = [d * m * pulp.lpSum(price[k] * (f[l][k] * TN(l, k) + (f[l][k] + g[l][k]) * T(l, k)) for l in R for k in K)]
    for l in R:
        for k in K:
            if (l, k) not in t:
                continue
            if l < L - 1:
                wf = nv(f"wF_{l}_{k}")
                prob += wf >= Fend[l] - o - m * accFC[l] - Mt * (2 - e[l] - t[l, k])
                gbs.append(price[k] * d * wf)
            wb = nv(f"wB_{l}_{k}")
            prob += wb >= Bstart[l] + tail[l] - o - m * accBC[l] - (Mt + Malg) * (2 - st[l] - t[l, k])
            gbs.append(price[k] * d * wb)
            for a in A:
                if co[a].tasks:
                    ws = nv(f"wS_{l}_{k}_{a}")
                    prob += ws >= Sy[l] - o - Malg * (3 - st[l] - t[l, k] - al[l, a])
                    gbs.append(price[k] * co[a].tasks * ws)
                    sync_terms.append(price[k] * co[a].tasks * ws)
    if d > 1:  # valid inequality: sync billing >= the cheapest algorithm's own work, layer by layer
        lb = pulp.lpSum(
            price[k] * min(c.tasks * (c.task_per_byte * MB * Pl[l] + opt[l][k] / c.k) for c in co if c.tasks) * T(l, k) for l in R for k in K
        )
        prob += pulp.lpSum(sync_terms) >= lb
    # -- requests (§4.2-4.4)
    has2 = nv("multi_stage", 1)
    for v_ in e.values():
        prob += has2 >= v_
    prob += has2 <= esum
    ast = {}
    for l in R:
        for a in A:
            ast[l, a] = nv(f"as_{l}_{a}", 1)
            prob += ast[l, a] >= st[l] + al[l, a] - 1
            prob += ast[l, a] <= al[l, a]
            prob += ast[l, a] <= st[l]
    S_ = 1 + esum
    invocations = d * esum + d * S_ + pulp.lpSum(co[a].tasks * ast[l, a] for l in R for a in A)
    trans = TRANSITIONS_PER_ITERATION + TRANSITIONS_PER_PARALLEL + TRANSITIONS_PER_MAP * has2 + TRANSITIONS_PER_TASK * d * esum
    trans += (TRANSITIONS_PER_MAP + TRANSITIONS_PER_TASK * d) * S_
    trans += pulp.lpSum((TRANSITIONS_PER_MAP + TRANSITIONS_PER_TASK * co[a].tasks) * ast[l, a] for l in R for a in A if co[a].tasks)
    poll = plat.s3_polls_per_wait
    nonlast = esum
    nonlast_not_first = esum - has2
    gets = d * m * nonlast + d * m * poll * nonlast_not_first + 2 * d * m * S_ + d * m * poll * nonlast
    puts = d * m * nonlast + d * m * esum
    gets += pulp.lpSum((d * (co[a].shards + co[a].tail_gets) + co[a].tasks * co[a].task_gets) * ast[l, a] for l in R for a in A)
    puts += pulp.lpSum((d * co[a].tail_puts + co[a].tasks * co[a].task_puts) * ast[l, a] for l in R for a in A)
    cost = pulp.lpSum(gbs) + plat.price_request * invocations + plat.price_transition * trans + plat.price_put * puts + plat.price_get * gets
    if fix is not None:  # evaluate one configuration with the MILP (tests: MILP == perfmodel)
        ends = set()
        acc_ = 0
        for n_ in fix.balance:
            acc_ += n_
            ends.add(acc_ - 1)
        si = 0
        for l in R:
            if l < L - 1:
                prob += e[l] == (1 if l in ends else 0)
            kk = tiers.index(fix.tiers_mb[si])
            if (l, kk) not in t:
                return MilpResult(None, math.inf, "infeasible: fixed tier too small for a layer", time.perf_counter() - t0, 0, 0)
            prob += t[l, kk] == 1
            prob += al[l, choices.index(fix.sync[si])] == 1
            if l in ends:
                si += 1
    ref = max(1e-12, wc * 1e-4 + wt)
    prob += (wc * cost + wt * (TF + TBS)) * (1.0 / ref)
    solver = pulp.HiGHS(msg=False, gapRel=gap, gapAbs=0.0, timeLimit=time_limit, threads=threads)
    status = prob.solve(solver)
    solve_s = time.perf_counter() - t0
    nvars, ncons = len(prob.variables()), len(prob.constraints)
    st_name = pulp.LpStatus[status]
    if st_name != "Optimal":
        return MilpResult(None, math.inf, st_name.lower(), solve_s, nvars, ncons)
    try:  # pulp reports a time-limited incumbent as "Optimal"; ask HiGHS itself
        ms = prob.solverModel.modelStatusToString(prob.solverModel.getModelStatus()).lower()
        proven = "optimal" in ms
    except Exception:  # pragma: no cover - older highspy
        proven = True
    balance, tier_sel, sync_sel = [], [], []
    start = 0
    for l in R:
        if l == L - 1 or (e[l].value() or 0) > 0.5:
            balance.append(l + 1 - start)
            tier_sel.append(tiers[max(K, key=lambda k: (T(l, k).value() if (l, k) in t else 0) or 0)])
            sync_sel.append(choices[max(A, key=lambda a: al[l, a].value() or 0)])
            start = l + 1
    cfg = Config(tuple(balance), tuple(tier_sel), d, b, m, tuple(sync_sel))
    obj = pulp.value(prob.objective) * ref
    return MilpResult(cfg, obj, "optimal" if proven else "time_limit", solve_s, nvars, ncons)
