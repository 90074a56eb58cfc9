"""Exact MILP co-optimisation of partition, memory tier and sync algorithm per stage.

For a fixed data-parallel degree d and micro-batching (b samples x m micro-batches) — few values,
enumerated by the caller — the plan minimising a1*cost + a2*time under the performance model
(docs/performance-model.md §3-§4) is found and *proven* optimal in four steps (§7 there):

1. Candidates (candidates.py): every (interval of layers, tier) is a *group*, each of its sync
   choices an *option*, priced by ``perfmodel.stage_terms``; what breaks a limit is dropped.

2. Bounds (bounds.py): a presolve that removes only what provably cannot beat the incumbent.

3. The MILP (milp.py) over the remaining groups: a path formulation, exact and linear.

4. The loop (``_solve``). Incumbent: the caller's plans, a cutoff from another (d, b), and a
   heuristic (balanced partitions, local search). Bounds against it; MILPs over the most
   promising groups improve it cheaply (bounds refined after each). Then, with many micro-batches
   ((m-1) max terms dominate, and an LP relaxation lowers a maximum by mixing paths), one MILP per
   surviving band of the bottleneck values with the maxima pinned to the band's floor
   ("enumerating the bottleneck"); otherwise one MILP over every surviving group. Every MILP is
   exact over its groups and every discarded group or band has a bound above the final
   objective, so the result is optimal over all candidates. HiGHS options: no restarts, no
   RINS/RENS/root-reduced-cost sub-MIPs (measured 2-10x faster on these models).

Verified: equal to brute force on random instances with every sync algorithm and both MILP paths
(tests/planner/test_milp.py), bounds valid against every plan (test_milp_bounds.py).
"""

from __future__ import annotations

import itertools
import math
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stagecoach.planner.model.perfmodel import (
    Config,
    evaluate,
)
from stagecoach.planner.model.platforms import Platform
from stagecoach.planner.model.syncmodel import sync_choices
from stagecoach.planner.profile.layers import ModelProfile, balanced_partition
from stagecoach.planner.solve.bounds import LowerBounds
from stagecoach.planner.solve.candidates import Candidates, Group, SyncOption, candidate_groups, path_estimate
from stagecoach.planner.solve.milp import MilpSolution, solve_milp
from stagecoach.planner.solve.objective import REL_TOL, max_stages_for, objective_value, objective_weights

BANDS_FROM_M = 8  # one MILP per band pair of the bottlenecks from this many micro-batches on (below: one MILP)
BANDS_OVERLAP = 4  # ... unless the bands' group sets add up to more than this many times their union
FEW_GROUPS = 150  # groups few enough for the final MILPs without another improving round
PROMISING_MAX = 160  # the largest "most promising groups" MILP
PAIR_BUDGET = 200  # band pairs kept by the bound refinement (each is a DP column, then at most one MILP)


@dataclass
class MilpResult:
    config: Config | None
    objective: float  # a1 * cost / COST_UNIT + a2 * time of ``config``
    status: str  # "optimal" (proven), "time_limit" (an incumbent, not proven), "infeasible: ..."
    solve_s: float
    variables: int  # of the (last) MILP solved
    constraints: int
    candidates: int = 0  # (interval, tier, sync) stages before the bound test
    kept: int = 0  # of them, left for the MILP after the bound test
    info: dict[str, Any] = field(default_factory=dict)


def heuristic_incumbent(
    profile: ModelProfile, plat: Platform, cands: Candidates, a1: float, a2: float, smax: int
) -> tuple[Config | None, float]:
    """A good feasible plan, fast: balanced partitions (1..smax stages) with one tier and one sync
    choice for every stage, then a local search (move a boundary, change a stage's tier or sync)
    until no move improves. Only a starting point: the MILP proves or beats it."""
    index = {(g.i, g.j, g.k): g for g in cands.groups}
    L = cands.layers
    ref = plat.tiers_mb[len(plat.tiers_mb) // 2]
    wts = [sum(l.times(ref, cands.micro_batch, plat)) for l in profile.layers]

    def score(path: list[tuple[Group, SyncOption]]) -> float:
        e = path_estimate(cands, path, plat)
        return objective_value(e.cost, e.time_s, a1, a2) if e.feasible else math.inf

    def build(bounds_: Sequence[int], ks: Sequence[int], ops: Sequence[int]) -> list[tuple[Group, SyncOption]] | None:
        path = []
        for s in range(len(ks)):
            g = index.get((bounds_[s], bounds_[s + 1], ks[s]))
            if g is None:
                return None
            op = next((o for o in g.options if o.a == ops[s]), None) or g.options[0]
            path.append((g, op))
        return path

    best: tuple[float, list[int], list[int], list[int]] | None = None
    for S in range(1, min(smax, L) + 1):
        cut = [0, *itertools.accumulate(balanced_partition(wts, S))]
        for k in range(len(cands.tiers)):
            for a in range(len(cands.choices)):
                path = build(cut, [k] * S, [a] * S)
                if path is not None:
                    v = score(path)
                    if best is None or v < best[0]:
                        best = (v, cut, [k] * S, [op.a for _, op in path])
    if best is None or not math.isfinite(best[0]):
        return None, math.inf
    v, cut, ks, ops = best
    improved = True
    while improved:  # first-improvement local search
        improved = False
        moves = []
        for s in range(1, len(cut) - 1):
            for delta in (-1, 1):
                c2 = list(cut)
                c2[s] += delta
                if c2[s - 1] < c2[s] < c2[s + 1]:
                    moves.append((c2, ks, ops))
        for s in range(len(ks)):
            for k in range(len(cands.tiers)):
                if k != ks[s]:
                    moves.append((cut, ks[:s] + [k] + ks[s + 1 :], ops))
            for a in range(len(cands.choices)):
                if a != ops[s]:
                    moves.append((cut, ks, ops[:s] + [a] + ops[s + 1 :]))
        for c2, k2, o2 in moves:
            path = build(c2, k2, o2)
            if path is None:
                continue
            v2 = score(path)
            if v2 < v * (1 - 1e-12):
                v, cut, ks, ops = v2, list(c2), list(k2), [op.a for _, op in path]
                improved = True
                break
    path = build(cut, ks, ops)
    assert path is not None
    cfg = Config(
        tuple(g.j - g.i for g, _ in path),
        tuple(g.tier for g, _ in path),
        cands.replicas,
        cands.micro_batch,
        cands.micro_batches,
        tuple(op.choice for _, op in path),
    )
    return cfg, v


# -- the exact solve --------------------------------------------------------------------------------
def _config_groups(cfg: Config, cands: Candidates) -> set[tuple[int, int, int]]:
    out, i = set(), 0
    for s, n in enumerate(cfg.balance):
        if cfg.tiers_mb[s] in cands.tiers:
            out.add((i, i + n, cands.tiers.index(cfg.tiers_mb[s])))
        i += n
    return out


def _min_stages(groups: Sequence[Group], L: int) -> float:
    """Fewest stages of a plan made of ``groups`` (inf if they hold none)."""
    by_i: dict[int, list[Group]] = {}
    for g in groups:
        by_i.setdefault(g.i, []).append(g)
    dist = [math.inf] * (L + 1)
    dist[0] = 0
    for n in range(L):
        if dist[n] < math.inf:
            for g in by_i.get(n, ()):
                dist[g.j] = min(dist[g.j], dist[n] + 1)
    return dist[L]


def _prefix_with_path(order: Sequence[int], groups: Sequence[Group], L: int, smax: int, size: int) -> list[int]:
    """The first groups of ``order``: at least ``size`` of them and enough that they hold a plan
    of at most ``smax`` stages, if the whole order does."""
    n = min(size, len(order))
    while n < len(order) and _min_stages([groups[q] for q in order[:n]], L) > smax:
        n = min(len(order), n + max(8, n // 4))
    return list(order[:n])


def _solve(
    profile: ModelProfile,
    plat: Platform,
    cands: Candidates,
    a1: float,
    a2: float,
    smax: int,
    time_limit: float,
    gap: float,
    threads: int | None,
    incumbent: Config | Sequence[Config] | float | None,
    first_groups: int,
    cutoff: float | None = None,
) -> MilpResult:
    """Heuristic incumbent -> bounds -> a MILP over the most promising groups -> one MILP per band
    pair of the bottlenecks that can still beat the incumbent (docs/performance-model.md §7)."""
    t0 = time.perf_counter()
    deadline = t0 + time_limit

    def remaining() -> float:
        return max(0.5, deadline - time.perf_counter())

    wc, wt = objective_weights(a1, a2)
    groups = cands.groups
    L = cands.layers
    info: dict[str, Any] = {}
    for l in range(L):
        if not any(g.i <= l < g.j for g in groups):
            return MilpResult(
                None, math.inf, f"infeasible: layer {profile.layers[l].name} fits in no stage", time.perf_counter() - t0, 0, 0, cands.size
            )
    # 1. incumbent: the caller's plan (or just its objective), or the heuristic's if better
    best_cfg: Config | None = None
    best = math.inf
    if isinstance(incumbent, (int, float)):
        best = float(incumbent)
    elif incumbent is not None:
        for cfg in [incumbent] if isinstance(incumbent, Config) else incumbent:
            if (
                (cfg.replicas, cfg.micro_batch, cfg.micro_batches) != (cands.replicas, cands.micro_batch, cands.micro_batches)
                or len(cfg.balance) > smax
                or sum(cfg.balance) != L
            ):
                continue
            e = evaluate(profile, cfg, plat)
            v = objective_value(e.cost, e.time_s, a1, a2)
            if e.feasible and v < best:
                best_cfg, best = cfg, v
    if cutoff is not None and cutoff < best:  # a better plan exists elsewhere: only plans below it matter
        best_cfg, best = None, float(cutoff)
    bounds = LowerBounds(cands, wc, wt, plat, smax)
    if math.isfinite(best):  # one cheap DP sweep first: maybe nothing here can beat what is known
        glb = bounds.pair_bounds(bounds.grid(8))
        info["global_bound"] = float(glb.min()) if len(glb) else math.inf
        if not len(glb) or glb.min() > best * (1 + REL_TOL) + 1e-9:
            status = "optimal" if best_cfg is not None else "cutoff: no plan beats the given incumbent objective"
            return MilpResult(
                best_cfg, best if best_cfg is not None else math.inf, status, time.perf_counter() - t0, 0, 0, cands.size, 0, info
            )
    th = time.perf_counter()
    hcfg, hobj = heuristic_incumbent(profile, plat, cands, a1, a2, smax)
    info["heuristic"] = {"objective": hobj, "s": round(time.perf_counter() - th, 3)}
    if hcfg is not None and hobj < best:
        best_cfg, best = hcfg, hobj

    def cut() -> float:
        return best * (1 + REL_TOL) + 1e-9

    milps: list[dict[str, Any]] = []
    info["milps"] = milps
    proven = True
    last = MilpSolution(None, math.inf, "none", 0, 0)

    def run(qs: Sequence[int], floors: tuple[float, float] = (0.0, 0.0), tag: str = "") -> None:
        nonlocal best, best_cfg, proven, last
        tm = time.perf_counter()
        sol = solve_milp(
            cands,
            [groups[q] for q in sorted(qs)],
            plat,
            wc,
            wt,
            smax,
            remaining(),
            gap,
            threads,
            cut() if math.isfinite(best) else None,
            floors=floors,
        )
        last = sol
        milps.append(
            {"tag": tag, "groups": len(qs), "status": sol.status, "objective": sol.objective, "s": round(time.perf_counter() - tm, 3)}
        )
        if sol.config is not None:
            e = evaluate(profile, sol.config, plat)  # a band floor may have inflated the MILP's own value
            v = objective_value(e.cost, e.time_s, a1, a2)
            if e.feasible and v < best:
                best_cfg, best = sol.config, v
        if sol.status not in ("optimal", "infeasible"):
            proven = False

    if not math.isfinite(best):
        # 2'. no incumbent at all: the groups with the smallest coarse bounds, more until a plan is found
        coarse = bounds.group_bounds(bounds.grid(6), ctx=False)
        order = [int(q) for q in np.argsort(coarse, kind="stable") if math.isfinite(coarse[q])]
        size = first_groups
        while not math.isfinite(best) and time.perf_counter() < deadline:
            qs = _prefix_with_path(order, groups, L, smax, size)
            run(qs, tag="first")
            if len(qs) == len(order) or math.isfinite(best):
                break
            size *= 2
        if not math.isfinite(best):
            status = "infeasible: no plan fits memory and the task limits" if last.status == "infeasible" else last.status
            if isinstance(incumbent, (int, float)):
                status = "cutoff: no plan beats the given incumbent objective"
            return MilpResult(None, math.inf, status, time.perf_counter() - t0, last.variables, last.constraints, cands.size, 0, info)
    # 2. bounds against the incumbent; a MILP over the most promising groups improves it cheaply
    tb = time.perf_counter()
    pairs = bounds.refine(bounds.grid(8), cut(), budget=PAIR_BUDGET)
    lbm = bounds.group_bounds(pairs, ctx=False, per_pair=True)
    info["bounds_s"] = time.perf_counter() - tb
    lbg = lbm.min(axis=0) if len(pairs[0]) else np.full(len(groups), np.inf)
    alive = [int(q) for q in np.argsort(lbg, kind="stable") if lbg[q] <= cut()]
    info["alive"] = len(alive)
    size = first_groups
    while len(alive) > max(size, FEW_GROUPS) and time.perf_counter() < deadline:
        chosen = set(_prefix_with_path(alive, groups, L, smax, size))
        if best_cfg is not None:
            want = _config_groups(best_cfg, cands)
            chosen |= {q for q in alive if (groups[q].i, groups[q].j, groups[q].k) in want}
        before = best
        run(sorted(chosen), tag="promising")
        if best >= before * (1 - 1e-9) or size >= PROMISING_MAX:
            break  # no better plan among these: the final MILPs decide
        # a better incumbent discards more; if many groups survive, look at twice as many of them
        pairs = bounds.refine(pairs, cut(), budget=PAIR_BUDGET)
        lbg = bounds.group_bounds(pairs, ctx=False, per_pair=True).min(axis=0) if len(pairs[0]) else np.full(len(groups), np.inf)
        alive = [int(q) for q in np.argsort(lbg, kind="stable") if lbg[q] <= cut()]
        size *= 2
    pairs = bounds.refine(pairs, cut(), budget=PAIR_BUDGET)
    tb = time.perf_counter()
    lbm = bounds.group_bounds(pairs, ctx=True, per_pair=True)
    info["bounds_s"] += time.perf_counter() - tb
    # 3. with many micro-batches the bottlenecks (m-1)*max dominate and the LP relaxation of a
    # maximum over mixed paths is weak: one MILP per band pair of (max forward step, max backward
    # step) that can still beat the incumbent, over the groups whose bound in that pair can (the
    # bottleneck enumerated: the MILP's maxima are pinned to a narrow band). With few micro-batches
    # the maxima weigh little, and when the bands' group sets overlap a lot (their total many
    # times the union) the MILPs repeat each other's work: then one MILP over every group left is
    # faster (measured on the zoo models).
    live = np.nonzero(bounds.pair_bounds(pairs) <= cut())[0] if len(pairs[0]) else np.zeros(0, int)
    union = int((lbm.min(axis=0) <= cut()).sum()) if len(pairs[0]) else 0
    repeated = int((lbm[live] <= cut()).sum()) if len(live) else 0
    info["band_groups_total"], info["union_groups"] = repeated, union
    if cands.micro_batches < BANDS_FROM_M or repeated > BANDS_OVERLAP * max(1, union):
        qs = [int(q) for q in np.nonzero(lbm.min(axis=0) <= cut())[0]] if len(pairs[0]) else []
        info["band_pairs"] = 0
        kept: set[int] = set(qs)
        if qs and _min_stages([groups[q] for q in qs], L) <= smax:
            run(qs, tag="all")
        bands: Sequence[int] = []
    else:
        pair_lb = bounds.pair_bounds(pairs) if len(pairs[0]) else np.zeros(0)
        thA, thB = bounds.thA.copy(), bounds.thB.copy()
        info["band_pairs"] = len(pairs[0])
        kept = set()
        bands = [int(p) for p in np.argsort(pair_lb, kind="stable")]
    for p in bands:
        if pair_lb[p] > cut():
            break
        if time.perf_counter() > deadline:
            proven = False
            break
        qs = [int(q) for q in np.nonzero(lbm[p] <= cut())[0]]
        if not qs or _min_stages([groups[q] for q in qs], L) > smax:
            continue
        kept |= set(qs)
        run(qs, floors=(float(thA[p]), float(thB[p])), tag=f"band{int(p)}")
    if best_cfg is None:  # only an objective was given, and nothing beats it
        return MilpResult(
            None,
            math.inf,
            "cutoff: no plan beats the given incumbent objective",
            time.perf_counter() - t0,
            last.variables,
            last.constraints,
            cands.size,
            len(kept),
            info,
        )
    return MilpResult(
        best_cfg,
        best,
        "optimal" if proven else "time_limit",
        time.perf_counter() - t0,
        last.variables,
        last.constraints,
        cands.size,
        len(kept),
        info,
    )


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
    time_limit: float = 60.0,
    gap: float = 1e-7,
    threads: int | None = None,
    incumbent: Config | Sequence[Config] | float | None = None,
    incumbent_objective: float | None = None,
    fix: Config | None = None,
    relax: bool = False,
    candidates: Candidates | None = None,
    first_groups: int = 40,
    cutoff: float | None = None,
) -> MilpResult:
    """Minimise a1*cost + a2*time for fixed (d, b, m), proven optimal; ``config`` is None if no
    plan fits.

    ``incumbent``: feasible plans (or just an objective value) to start from; the result is
    never worse. ``cutoff``: only plans with a smaller objective are of interest (e.g. the best
    found for another d); if there is none the result has ``config=None`` and status "cutoff...". ``candidates``: precomputed ``candidate_groups`` (they do not depend on the
    weights). ``fix`` evaluates one configuration with the MILP (tests: MILP == evaluate);
    ``relax`` solves the LP relaxation over all candidates (its objective is a lower bound).
    ``time_limit`` caps the whole solve; if it is hit the status says "time_limit".
    """
    with warnings.catch_warnings():  # pulp 3.x announces its 4.0 API on every variable
        warnings.simplefilter("ignore", DeprecationWarning)
        t0 = time.perf_counter()
        L = len(profile.layers)
        smax = max_stages_for(replicas, L, max_stages)
        if candidates is None or fix is not None:
            choices = sync_choices(replicas, sync_algos)
            if fix is not None:
                choices = list(dict.fromkeys(list(choices) + list(fix.sync)))
            candidates = candidate_groups(profile, plat, replicas, micro_batch, micro_batches, tiers, choices=choices)
        elif (candidates.replicas, candidates.micro_batch, candidates.micro_batches, candidates.layers) != (
            replicas,
            micro_batch,
            micro_batches,
            L,
        ):
            raise ValueError("candidates were computed for another (replicas, micro_batch, micro_batches) or profile")
        if fix is not None or relax:
            groups = list(candidates.groups)
            if fix is not None:
                want, i = {}, 0
                for s, n in enumerate(fix.balance):
                    want[(i, i + n, candidates.tiers.index(fix.tiers_mb[s]))] = candidates.choices.index(fix.sync[s])
                    i += n
                groups = [
                    Group(
                        g.i,
                        g.j,
                        g.k,
                        g.tier,
                        g.price,
                        g.a,
                        g.bb,
                        tuple(op for op in g.options if op.a == want[(g.i, g.j, g.k)]),
                        g.af,
                        g.ao,
                        g.bf,
                        g.bo,
                    )
                    for g in groups
                    if (g.i, g.j, g.k) in want
                ]
                groups = [g for g in groups if g.options]
            wc, wt = objective_weights(a1, a2)
            one = solve_milp(candidates, groups, plat, wc, wt, smax, time_limit, gap, threads, None, relax=relax)
            return MilpResult(
                one.config,
                one.objective,
                one.status,
                time.perf_counter() - t0,
                one.variables,
                one.constraints,
                candidates.size,
                len(groups),
            )
        r = _solve(
            profile,
            plat,
            candidates,
            a1,
            a2,
            smax,
            time_limit,
            gap,
            threads,
            incumbent if incumbent is not None else incumbent_objective,
            first_groups,
            cutoff,
        )
        r.solve_s = time.perf_counter() - t0
        return r
