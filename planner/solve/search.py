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
   promising groups (and their LPs' plans, locally improved) improve it cheaply (bounds refined after each). Then, with many micro-batches
   ((m-1) max terms dominate, and an LP relaxation lowers a maximum by mixing paths), one MILP per
   surviving band of the bottleneck values with the maxima pinned to the band's floor
   ("enumerating the bottleneck"; a band whose MILP would hold over 100 groups is split first, and
   bands are used whenever one MILP would hold over 300; a band whose LP relaxation is already at
   or above the incumbent is refuted without its MILP, and otherwise its MILP waits for its turn
   by that LP's optimum: best first); otherwise one MILP over every surviving
   group. Every final MILP is first tried by its LP relaxation, which also decides it when the
   plan along its heaviest arcs is priced within the gap of the LP (``_Search.lp_refutes``); once
   the groups' bounds are known, the bound sweeps leave out the groups beyond the cutoff
   (``LowerBounds.group_bounds``' ``alive``). Every MILP caps the waits its groups carry by their bounds (milp.WaitSlack). Every MILP is exact over its groups and every discarded group or band has a bound above
   the final objective, so the result is optimal over all candidates. HiGHS options: no restarts, no
   RINS/RENS/root-reduced-cost sub-MIPs (measured 2-10x faster on these models), no presolve
   (0.6-0.75x the CPU time of the slowest solves, not of every one; milp._highs).

Verified: equal to brute force on random instances with every sync algorithm and both MILP paths
(tests/planner/test_milp.py), bounds valid against every plan (test_milp_bounds.py).
"""

from __future__ import annotations

import heapq
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
from stagecoach.planner.solve.milp import MilpSolution, WaitSlack, solve_milp
from stagecoach.planner.solve.objective import REL_TOL, max_stages_for, objective_value, objective_weights

BANDS_FROM_M = 8  # one MILP per band pair of the bottlenecks from this many micro-batches on (below: one MILP)
BANDS_OVERLAP = 4  # ... unless the bands' group sets add up to more than this many times their union
FEW_GROUPS = 150  # groups few enough for the final MILPs without another improving round
PROMISING_MAX = 160  # the largest "most promising groups" MILP
BANDS_ALL_MAX = 300  # ... and the union holds at most this many groups (more: bands anyway)
BAND_SPLIT_GROUPS = 100  # a band pair whose MILP would hold more groups is split in two or four first
BAND_SPLIT_DEPTH = 6  # ... at most this many times over
PAIR_BUDGET = 200  # band pairs kept by the bound refinement (each is a DP column, then at most one MILP)
PROMISING_MILP_MAX = 80  # ... with bands to come (m >= BANDS_FROM_M), the largest of them that is a MILP (larger: its LP)
PROMISING_GAP = 1e-3  # the "most promising groups" MILPs stop this close to their own optimum (they prove nothing)


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


_StagePath = list[tuple[Group, SyncOption]]
_Start = tuple[float, list[int], list[int], list[int]]  # (objective, boundaries, tier per stage, sync per stage)


@dataclass
class _Paths:
    """Plans of one candidate set as paths of (group, option), built from boundaries, a tier and
    a sync index per stage, and scored by the model's exact prediction."""

    cands: Candidates
    plat: Platform
    a1: float
    a2: float
    index: dict[tuple[int, int, int], Group] = field(init=False)

    def __post_init__(self) -> None:
        self.index = {(g.i, g.j, g.k): g for g in self.cands.groups}

    def score(self, path: _StagePath) -> float:
        e = path_estimate(self.cands, path, self.plat)
        return objective_value(e.cost, e.time_s, self.a1, self.a2) if e.feasible else math.inf

    def build(self, bounds_: Sequence[int], ks: Sequence[int], ops: Sequence[int]) -> _StagePath | None:
        """The path, or None if a stage is no candidate; a sync the group lacks falls back to its first."""
        path = []
        for s in range(len(ks)):
            g = self.index.get((bounds_[s], bounds_[s + 1], ks[s]))
            if g is None:
                return None
            op = next((o for o in g.options if o.a == ops[s]), None) or g.options[0]
            path.append((g, op))
        return path


def _balanced_start(profile: ModelProfile, plat: Platform, paths: _Paths, smax: int) -> _Start | None:
    """The best balanced partition (1..smax stages, by compute time at a middle tier) with one
    tier and one sync choice for every stage."""
    cands = paths.cands
    ref = plat.tiers_mb[len(plat.tiers_mb) // 2]
    wts = [sum(l.times(ref, cands.micro_batch, plat)) for l in profile.layers]
    best: _Start | None = None
    for S in range(1, min(smax, cands.layers) + 1):
        cut = [0, *itertools.accumulate(balanced_partition(wts, S))]
        for k in range(len(cands.tiers)):
            for a in range(len(cands.choices)):
                path = paths.build(cut, [k] * S, [a] * S)
                if path is not None:
                    v = paths.score(path)
                    if best is None or v < best[0]:
                        best = (v, cut, [k] * S, [op.a for _, op in path])
    return best


def _moves(cut: list[int], ks: list[int], ops: list[int], tiers: int, choices: int) -> list[tuple[list[int], list[int], list[int]]]:
    """The neighbours of a plan: a boundary moved by one layer, one stage's tier or sync changed,
    a stage split in two or two neighbours merged (each part keeps its tier and sync)."""
    moves = _tier_and_boundary_moves(cut, ks, ops, tiers, choices)
    for s in range(len(ks)):
        for c in range(cut[s] + 1, cut[s + 1]):
            moves.append((cut[: s + 1] + [c] + cut[s + 1 :], ks[: s + 1] + ks[s:], ops[: s + 1] + ops[s:]))
    for s in range(1, len(ks)):
        for keep in (s - 1, s):
            moves.append((cut[:s] + cut[s + 1 :], ks[: s - 1] + [ks[keep]] + ks[s + 1 :], ops[: s - 1] + [ops[keep]] + ops[s + 1 :]))
    return moves


def _tier_and_boundary_moves(
    cut: list[int], ks: list[int], ops: list[int], tiers: int, choices: int
) -> list[tuple[list[int], list[int], list[int]]]:
    """A boundary moved by one layer, or one stage's tier or sync changed."""
    moves = []
    for s in range(1, len(cut) - 1):
        for delta in (-1, 1):
            c2 = list(cut)
            c2[s] += delta
            if c2[s - 1] < c2[s] < c2[s + 1]:
                moves.append((c2, ks, ops))
    for s in range(len(ks)):
        for k in range(tiers):
            if k != ks[s]:
                moves.append((cut, ks[:s] + [k] + ks[s + 1 :], ops))
        for a in range(choices):
            if a != ops[s]:
                moves.append((cut, ks, ops[:s] + [a] + ops[s + 1 :]))
    return moves


def _local_search(paths: _Paths, start: _Start, smax: int) -> _Start:
    """First-improvement local search from ``start`` until no move improves."""
    v, cut, ks, ops = start
    improved = True
    while improved:
        improved = False
        for c2, k2, o2 in _moves(cut, ks, ops, len(paths.cands.tiers), len(paths.cands.choices)):
            path = paths.build(c2, k2, o2) if len(k2) <= smax else None
            if path is None:
                continue
            v2 = paths.score(path)
            if v2 < v * (1 - 1e-12):
                v, cut, ks, ops = v2, list(c2), list(k2), [op.a for _, op in path]
                improved = True
                break
    return v, cut, ks, ops


def heuristic_incumbent(
    profile: ModelProfile, plat: Platform, cands: Candidates, a1: float, a2: float, smax: int
) -> tuple[Config | None, float]:
    """A good feasible plan, fast: balanced partitions (1..smax stages) with one tier and one sync
    choice for every stage, then a local search (move a boundary, change a stage's tier or sync)
    until no move improves. Only a starting point: the MILP proves or beats it."""
    paths = _Paths(cands, plat, a1, a2)
    start = _balanced_start(profile, plat, paths, smax)
    if start is None or not math.isfinite(start[0]):
        return None, math.inf
    v, cut, ks, ops = _local_search(paths, start, smax)
    path = paths.build(cut, ks, ops)
    assert path is not None
    return _path_config(cands, path), v


def _path_config(cands: Candidates, path: _StagePath) -> Config:
    """The plan of a path of (group, option)."""
    return Config(
        tuple(g.j - g.i for g, _ in path),
        tuple(g.tier for g, _ in path),
        cands.replicas,
        cands.micro_batch,
        cands.micro_batches,
        tuple(op.choice for _, op in path),
    )


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


def _caller_incumbent(
    profile: ModelProfile,
    plat: Platform,
    cands: Candidates,
    a1: float,
    a2: float,
    smax: int,
    incumbent: Config | Sequence[Config] | float | None,
) -> tuple[Config | None, float]:
    """The caller's best feasible plan of this (d, b, m) (or just its objective; inf if none)."""
    best_cfg: Config | None = None
    best = math.inf
    if isinstance(incumbent, (int, float)):
        best = float(incumbent)
    elif incumbent is not None:
        for cfg in [incumbent] if isinstance(incumbent, Config) else incumbent:
            if (
                (cfg.replicas, cfg.micro_batch, cfg.micro_batches) != (cands.replicas, cands.micro_batch, cands.micro_batches)
                or len(cfg.balance) > smax
                or sum(cfg.balance) != cands.layers
            ):
                continue
            e = evaluate(profile, cfg, plat)
            v = objective_value(e.cost, e.time_s, a1, a2)
            if e.feasible and v < best:
                best_cfg, best = cfg, v
    return best_cfg, best


def _pair(P: tuple[np.ndarray, ...], p: int) -> tuple[float, float, float, float]:
    """Band pair p of the arrays P = (aLo, aHi, bLo, bHi)."""
    return float(P[0][p]), float(P[1][p]), float(P[2][p]), float(P[3][p])


@dataclass(order=True)
class _Band:
    """One band pair waiting for its MILP, ordered by its lower bound (the most promising first):
    its floors of the two bottlenecks and every group's bound within it."""

    lb: float
    tag: Any = field(compare=False)
    pair: tuple[float, float, float, float] = field(compare=False)
    thA: float = field(compare=False)
    thB: float = field(compare=False)
    row: np.ndarray = field(compare=False, repr=False)
    nrow: np.ndarray = field(compare=False, repr=False)  # ... without context (for the MILP's WaitSlack)
    depth: int = field(default=0, compare=False)
    lp: bool = field(default=False, compare=False)  # its LP relaxation ran, below the cutoff then: lb is its optimum


@dataclass
class _Search:
    """One exact solve (``_solve``) in progress: the incumbent, whether every MILP so far ended
    proven, the last MILP's size and what ``MilpResult.info`` reports."""

    profile: ModelProfile
    plat: Platform
    cands: Candidates
    a1: float
    a2: float
    smax: int
    gap: float
    threads: int | None
    t0: float
    deadline: float
    best_cfg: Config | None = None
    best: float = math.inf
    proven: bool = True
    last: MilpSolution = field(default_factory=lambda: MilpSolution(None, math.inf, "none", 0, 0))
    info: dict[str, Any] = field(default_factory=dict)
    milps: list[dict[str, Any]] = field(default_factory=list)
    mask: np.ndarray | None = None  # the groups alive at some cutoff >= today's (LowerBounds.group_bounds' ``alive``)
    lp_value: float = -math.inf  # the last lp_refutes' LP optimum (-inf: none)
    wc: float = field(init=False)
    wt: float = field(init=False)

    def __post_init__(self) -> None:
        self.wc, self.wt = objective_weights(self.a1, self.a2)

    def remaining(self) -> float:
        return max(0.5, self.deadline - time.perf_counter())

    def cut(self) -> float:
        """What a plan must stay below to count as better than the incumbent."""
        return self.best * (1 + REL_TOL) + 1e-9

    def result(self, status: str, kept: int) -> MilpResult:
        cfg = self.best_cfg
        obj = self.best if cfg is not None else math.inf
        elapsed = time.perf_counter() - self.t0
        return MilpResult(cfg, obj, status, elapsed, self.last.variables, self.last.constraints, self.cands.size, kept, self.info)

    def slack(self, bounds: LowerBounds, qs: Sequence[int], lbn: np.ndarray | None) -> WaitSlack | None:
        """The carried waits' caps (milp.WaitSlack) of groups ``qs`` whose bounds without context
        (in the pair of the MILP's plans, or the least over every live pair) are ``lbn``."""
        if lbn is None or not math.isfinite(self.best) or self.wc <= 0:
            return None
        groups, d, cut = self.cands.groups, self.cands.replicas, self.cut()
        caps = {id(groups[q]): max(0.0, (cut - float(lbn[q])) / (self.wc * d * groups[q].price)) for q in qs}
        return WaitSlack(bounds.before, bounds.after, caps)

    def run(
        self,
        qs: Sequence[int],
        floors: tuple[float, float] = (0.0, 0.0),
        tag: str = "",
        slack: WaitSlack | None = None,
        gap: float | None = None,
    ) -> None:
        """One MILP over the groups ``qs``; a plan it finds is the incumbent if the model says it
        is better (a band floor may have inflated the MILP's own value). ``gap``: HiGHS's relative
        gap, where the MILP only looks for a better incumbent and so proves nothing (the final
        MILPs use ``self.gap``)."""
        tm, cm = time.perf_counter(), time.process_time()
        cut = self.cut() if math.isfinite(self.best) else None
        sol = self._solve(qs, self.gap if gap is None else gap, cut, floors=floors, slack=slack)
        self.last = sol
        self.milps.append(
            {
                "tag": tag,
                "groups": len(qs),
                "status": sol.status,
                "objective": sol.objective,
                "s": round(time.perf_counter() - tm, 3),
                "cpu": round(time.process_time() - cm, 3),
            }
        )
        if sol.config is not None:
            e = evaluate(self.profile, sol.config, self.plat)
            v = objective_value(e.cost, e.time_s, self.a1, self.a2)
            if e.feasible and v < self.best:
                self.best_cfg, self.best = sol.config, v
        if sol.status not in ("optimal", "infeasible") and gap is None:
            self.proven = False

    def _solve(
        self,
        qs: Sequence[int],
        gap: float,
        cut: float | None,
        relax: bool = False,
        floors: tuple[float, float] = (0.0, 0.0),
        slack: WaitSlack | None = None,
    ) -> MilpSolution:
        """solve_milp over the groups ``qs`` with this search's model, time left and threads."""
        groups = [self.cands.groups[q] for q in sorted(qs)]
        return solve_milp(
            self.cands, groups, self.plat, self.wc, self.wt, self.smax, self.remaining(), gap, self.threads, cut, relax, floors, slack
        )

    def lp_refutes(self, qs: Sequence[int], floors: tuple[float, float], slack: WaitSlack | None, tag: str) -> bool:
        """True if the LP relaxation of the MILP over ``qs`` decides it: at or above the cutoff
        (its optimum bounds every plan of the MILP from below, so the MILP can find nothing
        better), or with a plan along its heaviest arcs that the model prices within the MILP's
        gap of the LP's optimum (that plan is then as good as the MILP's, and the incumbent if
        better). Exact either way; an LP is a fraction of its MILP's time, most band MILPs end
        with nothing, and where the LP is integral (AmoebaNet-D36, L = 30, d = 64, (1, 2^22)) its
        plan is the optimum."""
        tm, cm = time.perf_counter(), time.process_time()
        lp = self._solve(qs, self.gap, self.cut(), relax=True, floors=floors, slack=slack)
        cut = self.cut()
        out = lp.status == "infeasible" or (lp.status == "optimal" and lp.objective > cut + 1e-9 * abs(cut))
        word = "refuted" if out else "lp"
        # a lower bound of every plan of the MILP below the cutoff (its LP's optimum, or nothing known)
        self.lp_value = lp.objective if lp.status == "optimal" and math.isfinite(lp.objective) else -math.inf
        if not out and lp.status == "optimal" and lp.path is not None:
            e = evaluate(self.profile, lp.path, self.plat)
            v = objective_value(e.cost, e.time_s, self.a1, self.a2) if e.feasible else math.inf
            if v < self.best:
                self.best_cfg, self.best = lp.path, v
            out = v <= lp.objective * (1 + self.gap) + 1e-9 * abs(lp.objective)
            word = "lp-plan" if out else word
        took = round(time.perf_counter() - tm, 3)
        cpu = round(time.process_time() - cm, 3)
        self.milps.append({"tag": tag + "-lp", "groups": len(qs), "status": word, "objective": lp.objective, "s": took, "cpu": cpu})
        return out

    def lp_incumbent(self, qs: Sequence[int]) -> None:
        """The plan along the heaviest arcs of the LP relaxation over ``qs``, improved by the local
        search, becomes the incumbent if better. Proves nothing; a fraction of a promising MILP's
        time and often as good (AmoebaNet-D36, L = 30, (1, 2^22): d = 16's optimum from 80
        groups in 0.1 CPU s, where the 160-group MILP took 4.5 s to find the same plan)."""
        tm, cm = time.perf_counter(), time.process_time()
        lp = self._solve(qs, self.gap, None, relax=True)
        v = math.inf
        if lp.status == "optimal" and lp.path is not None:
            paths = _Paths(self.cands, self.plat, self.a1, self.a2)
            cut = [0, *itertools.accumulate(lp.path.balance)]
            ks = [self.cands.tiers.index(t) for t in lp.path.tiers_mb]
            ops = [self.cands.choices.index(c) for c in lp.path.sync]
            path = paths.build(cut, ks, ops)
            if path is not None:
                v, cut, ks, ops = _local_search(paths, (paths.score(path), cut, ks, ops), self.smax)
                path = paths.build(cut, ks, ops)
                if path is not None and v < self.best:
                    self.best_cfg, self.best = _path_config(self.cands, path), v
        took, cpu = round(time.perf_counter() - tm, 3), round(time.process_time() - cm, 3)
        self.milps.append({"tag": "promising-lpplan", "groups": len(qs), "status": lp.status, "objective": v, "s": took, "cpu": cpu})

    def refuted(self, bounds: LowerBounds) -> bool:
        """One cheap DP sweep: True if nothing here can beat the incumbent."""
        glb = bounds.pair_bounds(bounds.grid(8))
        self.info["global_bound"] = float(glb.min()) if len(glb) else math.inf
        return not len(glb) or bool(glb.min() > self.cut())

    def heuristic(self) -> None:
        th = time.perf_counter()
        hcfg, hobj = heuristic_incumbent(self.profile, self.plat, self.cands, self.a1, self.a2, self.smax)
        self.info["heuristic"] = {"objective": hobj, "s": round(time.perf_counter() - th, 3)}
        if hcfg is not None and hobj < self.best:
            self.best_cfg, self.best = hcfg, hobj

    def first_plan(self, bounds: LowerBounds, first_groups: int) -> None:
        """No incumbent at all: MILPs over the groups with the smallest coarse bounds, more of
        them until a plan is found."""
        groups, L = self.cands.groups, self.cands.layers
        coarse = bounds.group_bounds(bounds.grid(6), ctx=False)
        order = [int(q) for q in np.argsort(coarse, kind="stable") if math.isfinite(coarse[q])]
        size = first_groups
        while not math.isfinite(self.best) and time.perf_counter() < self.deadline:
            qs = _prefix_with_path(order, groups, L, self.smax, size)
            self.run(qs, tag="first")
            if len(qs) == len(order) or math.isfinite(self.best):
                break
            size *= 2

    def _alive(self, lbg: np.ndarray) -> list[int]:
        """The groups whose bound can still beat the incumbent, most promising first."""
        return [int(q) for q in np.argsort(lbg, kind="stable") if lbg[q] <= self.cut()]

    def promising(self, bounds: LowerBounds, first_groups: int) -> tuple[np.ndarray, ...]:
        """Bounds against the incumbent, and the LP (``lp_incumbent``) and MILP over the most
        promising groups (and the incumbent's), 40, 80, 160 of them while more survive; with
        bands to follow only the LP past PROMISING_MILP_MAX groups. Returns the band pairs left.
        "Survive" by the bounds with the group's own waits counted exactly along the path (ctx,
        as the final MILPs use): weaker ones kept more groups alive, so a 160-group MILP ran
        where the final one held fewer (AmoebaNet-D36, L = 12, d = 64, (1, 2^22): 123), and
        dropping it took that solve from 10.7 to 4.6 CPU s, L = 30, d = 128 from 12.4 to 7.8."""
        groups, L = self.cands.groups, self.cands.layers
        tb, cb = time.perf_counter(), time.process_time()
        pairs = bounds.refine(bounds.grid(8), self.cut(), budget=PAIR_BUDGET)
        lbm = bounds.group_bounds(pairs, ctx=True, per_pair=True)
        self.info["bounds_s"] = time.perf_counter() - tb
        self.info["bounds_cpu"] = time.process_time() - cb
        alive = self._alive(lbm.min(axis=0) if len(pairs[0]) else np.full(len(groups), np.inf))
        self.info["alive"] = len(alive)
        self.mask = self._mask(alive)
        size = first_groups
        while len(alive) > max(size, FEW_GROUPS) and time.perf_counter() < self.deadline:
            chosen = set(_prefix_with_path(alive, groups, L, self.smax, size))
            if self.best_cfg is not None:
                want = _config_groups(self.best_cfg, self.cands)
                chosen |= {q for q in alive if (groups[q].i, groups[q].j, groups[q].k) in want}
            self.lp_incumbent(sorted(chosen))
            if size <= PROMISING_MILP_MAX or self.cands.micro_batches < BANDS_FROM_M:
                self.run(sorted(chosen), tag="promising", gap=PROMISING_GAP)
            if size >= PROMISING_MAX:
                break  # the final MILPs decide
            # twice as many of the groups that survive, improved or not: such a MILP takes seconds
            # and can find what the local search misses, and a better incumbent discards more
            # (AmoebaNet-D36, d = 16, (1, 2^22): the optimum, 0.7% below the heuristic's, at 160)
            pairs = bounds.refine(pairs, self.cut(), budget=PAIR_BUDGET, alive=self.mask)
            alive = self._alive(
                bounds.group_bounds(pairs, ctx=True, per_pair=True, alive=self.mask).min(axis=0)
                if len(pairs[0])
                else np.full(len(groups), np.inf)
            )
            self.mask = self._mask(alive)
            size *= 2
        return bounds.refine(pairs, self.cut(), budget=PAIR_BUDGET, alive=self.mask)

    def _mask(self, alive: Sequence[int]) -> np.ndarray:
        """``alive`` as a mask over every group."""
        mask = np.zeros(len(self.cands.groups), bool)
        mask[list(alive)] = True
        return mask

    def final(self, bounds: LowerBounds, pairs: tuple[np.ndarray, ...]) -> set[int]:
        """The MILPs that decide: one per band pair, or one over every group left (below).
        Returns the groups they were given.

        With many micro-batches the bottlenecks (m-1)*max dominate and the LP relaxation of a
        maximum over mixed paths is weak: one MILP per band pair of (max forward step, max
        backward step) that can still beat the incumbent, over the groups whose bound in that
        pair can (the bottleneck enumerated: the MILP's maxima are pinned to a narrow band). With
        few micro-batches the maxima weigh little, and when the bands' group sets overlap a lot
        (their total many times the union) the MILPs repeat each other's work: then one MILP
        over every group left is faster (measured on the zoo models)."""
        tb, cb = time.perf_counter(), time.process_time()
        lbm = bounds.group_bounds(pairs, ctx=True, per_pair=True, alive=self.mask)
        lbn = bounds.group_bounds(pairs, ctx=False, per_pair=True, alive=self.mask)
        self.info["bounds_s"] += time.perf_counter() - tb
        self.info["bounds_cpu"] += time.process_time() - cb
        cut = self.cut()
        live = np.nonzero(bounds.pair_bounds(pairs, self.mask) <= cut)[0] if len(pairs[0]) else np.zeros(0, int)
        union = int((lbm.min(axis=0) <= cut).sum()) if len(pairs[0]) else 0
        repeated = int((lbm[live] <= cut).sum()) if len(live) else 0
        self.info["band_groups_total"], self.info["union_groups"] = repeated, union
        # ... but one MILP over more than BANDS_ALL_MAX groups is what took minutes (AmoebaNet-D36 at
        # L = 30, (1, 2^22), d = 16: 557 groups, 55 CPU s; the bands 37 CPU s, the same optimum;
        # d = 32: 1,136 groups unproven after 400 s, the bands proved a 0.9% better plan)
        overlapping = repeated > BANDS_OVERLAP * max(1, union) and union <= BANDS_ALL_MAX
        if self.cands.micro_batches < BANDS_FROM_M or overlapping:
            return self._all_groups(bounds, lbm, lbn, pairs)
        return self._bands(bounds, lbm, lbn, pairs)

    def _all_groups(self, bounds: LowerBounds, lbm: np.ndarray, lbn: np.ndarray, pairs: tuple[np.ndarray, ...]) -> set[int]:
        """One MILP over every group whose bound in some band pair can beat the incumbent."""
        qs = [int(q) for q in np.nonzero(lbm.min(axis=0) <= self.cut())[0]] if len(pairs[0]) else []
        self.info["band_pairs"] = 0
        if qs and _min_stages([self.cands.groups[q] for q in qs], self.cands.layers) <= self.smax:
            slack = self.slack(bounds, qs, lbn.min(axis=0))
            if not self.lp_refutes(qs, (0.0, 0.0), slack, "all"):
                self.run(qs, tag="all", slack=slack)
        return set(qs)

    def _bands(self, bounds: LowerBounds, lbm: np.ndarray, lbn: np.ndarray, pairs: tuple[np.ndarray, ...]) -> set[int]:
        """One MILP per band pair, in the order of their bounds, until the next cannot beat the
        incumbent; each over the groups that can in that pair, its maxima pinned to the floors.
        A pair whose MILP would hold more than BAND_SPLIT_GROUPS groups is split first
        (``_split_band``): its halves cover it, so nothing is lost, and their MILPs are smaller
        and pinned tighter (AmoebaNet-D36, L = 30, d = 16, (1, 2^22): 36.4 CPU s split, 36.8
        unsplit, on a loaded machine; it keeps any one MILP from holding the whole union)."""
        pair_lb = bounds.pair_bounds(pairs, self.mask) if len(pairs[0]) else np.zeros(0)
        self.info["band_pairs"], self.info["band_splits"] = len(pairs[0]), 0
        work = [
            _Band(float(pair_lb[p]), p, _pair(pairs, p), float(bounds.thA[p]), float(bounds.thB[p]), lbm[p], lbn[p])
            for p in range(len(pair_lb))
        ]
        heapq.heapify(work)
        kept: set[int] = set()
        while work:
            band = heapq.heappop(work)
            if band.lb > self.cut():
                break
            if time.perf_counter() > self.deadline:
                self.proven = False
                break
            qs = [int(q) for q in np.nonzero(band.row <= self.cut())[0]]
            if not qs or _min_stages([self.cands.groups[q] for q in qs], self.cands.layers) > self.smax:
                continue
            if band.lp:  # second time here: its LP's optimum is still below the cutoff, so its MILP
                cut = self.cut()
                if band.lb <= cut + 1e-9 * abs(cut):  # (lp_refutes' margin)
                    kept |= set(qs)
                    self.run(qs, floors=(band.thA, band.thB), tag=f"band{band.tag}", slack=self.slack(bounds, qs, band.nrow))
                continue
            if len(qs) > BAND_SPLIT_GROUPS and band.depth < BAND_SPLIT_DEPTH:
                halves = self._split_band(bounds, band)
                if halves:
                    for h in halves:
                        heapq.heappush(work, h)
                    continue
            kept |= set(qs)
            slack = self.slack(bounds, qs, band.nrow)
            if not self.lp_refutes(qs, (band.thA, band.thB), slack, f"band{band.tag}"):
                # its MILP waits for its turn by the LP's optimum, a bound of the band as valid as
                # the DP's and higher: the MILPs then run most promising first, and the optimum
                # found early refutes the bands whose LPs end above it without their MILPs
                band.lb, band.lp = max(band.lb, self.lp_value), True
                heapq.heappush(work, band)
        return kept

    def _split_band(self, bounds: LowerBounds, band: _Band) -> list[_Band]:
        """The band pair's halves with their own bounds ([] if it cannot be split): each half's
        pair and group bounds are those of plans whose maxima lie in it, at least the pair's."""
        sub = bounds.split_pair(band.pair)
        if len(sub[0]) < 2:
            return []
        tb, cb = time.perf_counter(), time.process_time()
        alive = band.row <= self.cut()  # a plan of the halves below the cutoff uses only these
        rows = bounds.group_bounds(sub, ctx=True, per_pair=True, alive=alive)
        nrows = bounds.group_bounds(sub, ctx=False, per_pair=True, alive=alive)
        thA, thB = bounds.thA.copy(), bounds.thB.copy()
        plb = bounds.pair_bounds(sub, alive)
        self.info["bounds_s"] += time.perf_counter() - tb
        self.info["bounds_cpu"] += time.process_time() - cb
        self.info["band_splits"] += 1
        return [
            _Band(
                max(band.lb, float(plb[h])),
                f"{band.tag}.{h}",
                _pair(sub, h),
                float(thA[h]),
                float(thB[h]),
                rows[h],
                nrows[h],
                band.depth + 1,
            )
            for h in range(len(sub[0]))
        ]


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
    for l in range(cands.layers):
        if not any(g.i <= l < g.j for g in cands.groups):
            return MilpResult(
                None, math.inf, f"infeasible: layer {profile.layers[l].name} fits in no stage", time.perf_counter() - t0, 0, 0, cands.size
            )
    s = _Search(profile, plat, cands, a1, a2, smax, gap, threads, t0, t0 + time_limit)
    # 1. incumbent: the caller's plan (or just its objective), or the heuristic's if better
    s.best_cfg, s.best = _caller_incumbent(profile, plat, cands, a1, a2, smax, incumbent)
    if cutoff is not None and cutoff < s.best:  # a better plan exists elsewhere: only plans below it matter
        s.best_cfg, s.best = None, float(cutoff)
    bounds = LowerBounds(cands, s.wc, s.wt, plat, smax)
    if math.isfinite(s.best) and s.refuted(bounds):
        return s.result("optimal" if s.best_cfg is not None else "cutoff: no plan beats the given incumbent objective", 0)
    s.heuristic()
    s.info["milps"] = s.milps
    if not math.isfinite(s.best):
        # 2'. no incumbent at all: the groups with the smallest coarse bounds, more until a plan is found
        s.first_plan(bounds, first_groups)
        if not math.isfinite(s.best):
            status = "infeasible: no plan fits memory and the task limits" if s.last.status == "infeasible" else s.last.status
            if isinstance(incumbent, (int, float)):
                status = "cutoff: no plan beats the given incumbent objective"
            return s.result(status, 0)
    # 2. bounds against the incumbent; a MILP over the most promising groups improves it cheaply
    pairs = s.promising(bounds, first_groups)
    # 3. the final MILPs: per band pair of the bottlenecks, or one over every group left
    kept = s.final(bounds, pairs)
    if s.best_cfg is None:  # only an objective was given, and nothing beats it
        return s.result("cutoff: no plan beats the given incumbent objective", len(kept))
    return s.result("optimal" if s.proven else "time_limit", len(kept))


def _candidates_for(
    profile: ModelProfile,
    plat: Platform,
    replicas: int,
    micro_batch: int,
    micro_batches: int,
    tiers: Sequence[int] | None,
    sync_algos: Sequence[str] | None,
    fix: Config | None,
    candidates: Candidates | None,
) -> Candidates:
    """The caller's candidates if they fit this (d, b, m) and profile; else computed (with
    ``fix``'s sync choices among them, so that it can be evaluated)."""
    if candidates is None or fix is not None:
        choices = sync_choices(replicas, sync_algos)
        if fix is not None:
            choices = list(dict.fromkeys(list(choices) + list(fix.sync)))
        return candidate_groups(profile, plat, replicas, micro_batch, micro_batches, tiers, choices=choices)
    if (candidates.replicas, candidates.micro_batch, candidates.micro_batches, candidates.layers) != (
        replicas,
        micro_batch,
        micro_batches,
        len(profile.layers),
    ):
        raise ValueError("candidates were computed for another (replicas, micro_batch, micro_batches) or profile")
    return candidates


def _fixed_groups(candidates: Candidates, fix: Config) -> list[Group]:
    """The groups of ``fix``'s stages, each with only the option of its sync choice."""
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
        for g in candidates.groups
        if (g.i, g.j, g.k) in want
    ]
    return [g for g in groups if g.options]


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
        smax = max_stages_for(replicas, len(profile.layers), max_stages, plat)
        candidates = _candidates_for(profile, plat, replicas, micro_batch, micro_batches, tiers, sync_algos, fix, candidates)
        if fix is not None or relax:
            # one MILP: over fix's stages only (it evaluates them), or the relaxation over all
            groups = list(candidates.groups) if fix is None else _fixed_groups(candidates, fix)
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
        start = incumbent if incumbent is not None else incumbent_objective
        r = _solve(profile, plat, candidates, a1, a2, smax, time_limit, gap, threads, start, first_groups, cutoff)
        r.solve_s = time.perf_counter() - t0
        return r
