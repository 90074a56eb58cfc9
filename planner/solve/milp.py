"""Exact MILP co-optimisation of partition, memory tier and sync algorithm per stage.

For a fixed data-parallel degree d and micro-batching (b samples x m micro-batches) — few values,
enumerated by the caller — the plan minimising a1*cost + a2*time under the performance model
(docs/performance-model.md §3-§4) is found and *proven* optimal in four steps (§7 there):

1. Candidates. Every (interval of layers, tier) is a *group* g = (i, j, k); each of its sync
   choices an *option* o. Every per-stage quantity is a constant of (g, o), computed by
   ``perfmodel.stage_terms`` — the code ``evaluate`` uses, so the MILP cannot drift from the model.
   Groups that break a memory or 15-minute limit are dropped, and so are options no better in any
   respect than another option of the same group.

2. Bounds (a presolve that only removes what provably cannot beat the incumbent). A dynamic
   programme over boundary nodes gives, for every group, a lower bound of the objective of every
   plan that uses it (``LowerBounds``): each stage's own billed work and steps exactly, the
   flow-shop bottlenecks (m-1)*max per band of their values, the waits a bottleneck forces on
   the stages around it, the group's own waits on the stages before and after it. Groups whose
   bound exceeds the incumbent's objective are removed. Removing them cannot lose the optimum:
   any plan through such a group is worse than the incumbent.

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
import pulp

from stagecoach.planner.model.perfmodel import (
    Config,
    Estimate,
    StageTerms,
    SyncChoice,
    compose,
    evaluate,
    global_transitions,
    phase_overhead,
    stage_terms,
    sync_choices,
)
from stagecoach.planner.model.platforms import Platform
from stagecoach.planner.profile.layers import ModelProfile, balanced_partition

COST_UNIT = 1e-9  # objective: a1 * cost / COST_UNIT + a2 * seconds (nano-dollars; see docs/planner.md)
# relative tolerance of the cutoff and of the bound test: keep anything within 1e-7 of the incumbent
REL_TOL = 1e-7
BANDS_FROM_M = 8  # one MILP per band pair of the bottlenecks from this many micro-batches on (below: one MILP)
BANDS_OVERLAP = 4  # ... unless the bands' group sets add up to more than this many times their union
FEW_GROUPS = 150  # groups few enough for the final MILPs without another improving round
PROMISING_MAX = 160  # the largest "most promising groups" MILP
PAIR_BUDGET = 200  # band pairs kept by the bound refinement (each is a DP column, then at most one MILP)


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


def max_stages_for(d: int, layers: int, max_stages: int) -> int:
    """Stage slots: at most one stage per layer, and (S-1)*d forward workers in one inline Map
    (<= 40 concurrent iterations, docs/runtime.md "States")."""
    return max(1, min(layers, max_stages, 1 + 40 // d))


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


# -- candidate stages -----------------------------------------------------------------------------
@dataclass(frozen=True)
class SyncOption:
    """One sync choice of a group: what it adds beyond the group's flow-shop steps."""

    a: int  # index into the solve's sync choices
    choice: SyncChoice
    own_cost: float  # USD: the tail and the sync tasks billed, requests, transitions, S3
    extra_s: float  # seconds the stage's branch adds after its backward flow shop: tail (+ o + one sync task)
    tail_s: float
    load_s: float  # the stage's parameter load (0 when this sync leaves the parameters cached)
    terms: StageTerms = field(compare=False, repr=False, default=None)  # type: ignore[assignment]


@dataclass(frozen=True)
class Group:
    """A stage's interval and tier: its flow-shop steps (independent of the sync choice)."""

    i: int
    j: int
    k: int  # tier index
    tier: int
    price: float  # USD per second of one worker at this tier
    a: float  # forward step of one micro-batch (0 for the last stage): what the bottleneck maximises
    bb: float  # backward step of one micro-batch
    options: tuple[SyncOption, ...]
    af: float = 0.0  # a + the forward hop to the next stage: what later stages' sums carry
    ao: float = 0.0  # a + the hop's own part (its PUT): what the stage's own task end adds
    bf: float = 0.0  # the backward counterparts
    bo: float = 0.0


@dataclass(frozen=True)
class Candidates:
    """The candidate groups of one (d, b, m): independent of the objective weights, so a caller
    solving several weights computes them once."""

    replicas: int
    micro_batch: int
    micro_batches: int
    tiers: tuple[int, ...]
    choices: tuple[SyncChoice, ...]
    layers: int
    groups: tuple[Group, ...]

    @property
    def size(self) -> int:
        return sum(len(g.options) for g in self.groups)


def candidate_groups(
    profile: ModelProfile,
    plat: Platform,
    d: int,
    b: int,
    m: int,
    tiers: Sequence[int] | None = None,
    sync_algos: Sequence[str] | None = None,
    choices: Sequence[SyncChoice] | None = None,
) -> Candidates:
    """Every (interval, tier) that fits memory and the task limits with at least one sync choice,
    with its constants; sync options no better in any respect than another are dropped."""
    tiers = tuple(tiers or plat.tiers_mb)
    choices = tuple(choices if choices is not None else sync_choices(d, sync_algos))
    lay = profile.layers
    L = len(lay)
    o, maxT = phase_overhead(plat, d), plat.max_predicted_task_s
    cum = lambda xs: [0.0, *itertools.accumulate(xs)]
    P = cum([l.param_bytes for l in lay])
    SV = cum([l.saved_bytes_per_sample for l in lay])
    out: list[Group] = []
    for k, tier in enumerate(tiers):
        tm = [l.times(tier, b, plat) for l in lay]
        F = cum([t[0] for t in tm])
        G = cum([t[1] for t in tm])
        cap = plat.usable_bytes(tier)
        price = plat.price_per_s(tier)
        for i in range(L):
            for j in range(i + 1, L + 1):
                last = j == L
                opts: list[SyncOption] = []
                st0 = None
                for a, ch in enumerate(choices):
                    st = stage_terms(
                        P[j] - P[i],
                        F[j] - F[i],
                        G[j] - G[i],
                        SV[j] - SV[i],
                        lay[i].in_bytes_per_sample,
                        lay[j - 1].out_bytes_per_sample,
                        lay[i].ingrad_bytes_per_sample,
                        profile.label_bytes_per_sample,
                        i == 0,
                        last,
                        tier,
                        ch,
                        d,
                        b,
                        m,
                        plat,
                    )
                    if st.memory_bytes > cap or st.sync.task_s > maxT:
                        continue
                    if not last and st.load_s + m * st.fwd_step_s + st.fwd_hop_own_s > maxT:
                        continue
                    if m * st.bwd_step_s + st.bwd_hop_own_s + (st.load_s if last else 0.0) + st.sync.tail_s > maxT:
                        continue
                    own = (
                        price * (d * st.sync.tail_s + st.sync.tasks * st.sync.task_s)
                        + plat.price_request * st.invocations
                        + plat.price_transition * st.transitions
                        + plat.price_put * st.puts
                        + plat.price_get * st.gets
                    )
                    extra = st.sync.tail_s + ((o + st.sync.task_s) if st.sync.tasks else 0.0)
                    opts.append(SyncOption(a, ch, own, extra, st.sync.tail_s, st.load_s, st))
                    st0 = st
                if st0 is None:
                    continue
                key = lambda c: (c.own_cost, c.extra_s, c.tail_s, c.load_s)
                keep = [
                    c
                    for c in opts
                    if not any(q is not c and all(u <= v for u, v in zip(key(q), key(c))) and (key(q), q.a) < (key(c), c.a) for q in opts)
                ]
                out.append(
                    Group(
                        i,
                        j,
                        k,
                        tier,
                        price,
                        st0.fwd_step_s,
                        st0.bwd_step_s,
                        tuple(keep),
                        af=st0.fwd_step_s + st0.fwd_hop_s,
                        ao=st0.fwd_step_s + st0.fwd_hop_own_s,
                        bf=st0.bwd_step_s + st0.bwd_hop_s,
                        bo=st0.bwd_step_s + st0.bwd_hop_own_s,
                    )
                )
    return Candidates(d, b, m, tiers, choices, L, tuple(out))


# -- lower bounds per group (docs/performance-model.md §7.2) --------------------------------------
# Flag automaton of the bottleneck bands: (fA, fB) before an arc -> (fA', fB') after it, with the
# condition on the arc ('s': its forward step exceeds the band's low end, 'b': its backward step
# does; 'n..': it does not) and whether it pays the forward / backward imbalance.
_TRANS: list[tuple[int, int, int, int, str | None, str | None, bool, bool]] = []
for _fa in (0, 1):
    for _fb in (0, 1):
        for _fa2, _ca in [(1, None)] if _fa == 1 else [(1, "s"), (0, "ns")]:
            for _fb2, _cb in [(1, "nb")] if _fb == 1 else [(0, None), (1, "b")]:
                _TRANS.append((_fa, _fb, _fa2, _fb2, _ca, _cb, _fa2 == 1, _fb == 0))


class LowerBounds:
    """Valid lower bounds of the objective of every plan that uses a given group.

    A plan's objective is at least the sum over its stages of a per-stage weight (its own cost,
    every task's own billed work, its steps in T_F and T_BS, and for the first / last stage the
    branch's extra time / the last stage's load), plus (m-1)(maxA + maxB) times the time weight,
    plus the imbalance the bottleneck forces on the stages around it: a forward task after the
    stage with the largest step waits (m-1)(maxA - a_s), a backward task before it (m-1)(maxB -
    bb_s), both billed at the stage's own price. Dropped (all >= 0): every wait on the first
    micro-batch of other stages except the bounded group's own, and the parameter-load maxima.

    The maxima are handled by *bands*: (maxA, maxB) lies in one pair of value intervals
    (aLo, aHi] x (bLo, bHi]; inside a pair every arc must have a <= aHi, bb <= bHi, the maxima
    are at least the smallest candidate value above aLo / bLo, and a two-flag automaton marks the
    stages after the first arc above aLo (they pay the forward imbalance) and before the last arc
    above bLo (they pay the backward one). A DP over (node, flags, stage count <= Smax) per pair
    gives prefix and suffix bounds; pairs whose own bound exceeds the incumbent are discarded and
    the others split, so the bands become fine exactly where plans can still compete.
    """

    def __init__(self, cands: Candidates, wc: float, wt: float, plat: Platform, smax: int) -> None:
        groups = cands.groups
        L, d, m = cands.layers, cands.replicas, cands.micro_batches
        o, pt = phase_overhead(plat, d), plat.price_transition
        self.L, self.m, self.wt, self.smax = L, m, wt, smax
        G = len(groups)
        self.I = np.array([g.i for g in groups], dtype=int)
        self.J = np.array([g.j for g in groups], dtype=int)
        self.A = np.array([g.a for g in groups])
        self.B = np.array([g.bb for g in groups])
        price = np.array([g.price for g in groups])
        self.Kg = np.array([g.k for g in groups], dtype=int)
        self.fin = self.J == L
        K = len(cands.tiers)
        pk = np.array([plat.price_per_s(t) for t in cands.tiers])
        self.K = K
        # weights: base (no context); pre[c]/suf[c]: with the waits of a bounded group at tier c
        # on the arc (c = K: a last-stage group, which has no forward task)
        self.wpre = np.full((K + 1, G), np.inf)
        self.wsuf = np.full((K, G), np.inf)
        self.selfw = np.full(G, np.inf)
        first_extra = wt * o + wc * pt * (global_transitions(2) - global_transitions(1))
        for q, g in enumerate(groups):
            for op in g.options:
                # a stage adds at least its step and its own hop to T_F and to the first branch
                # of T_BS (ao >= a, bo >= bb), and its tasks are billed at least as long
                v = wc * (op.own_cost + d * g.price * (m * g.a + (g.ao - g.a) + m * g.bb + (g.bo - g.bb) + op.load_s)) + wt * (g.ao + g.bo)
                if g.j == L:
                    v += wt * op.load_s
                if g.i == 0:
                    v += wt * op.extra_s + (first_extra if g.j < L else 0.0)
                self.selfw[q] = min(self.selfw[q], v + (wt * op.load_s if g.j < L else 0.0))
                self.wpre[K, q] = min(self.wpre[K, q], v)
                self.wpre[:K, q] = np.minimum(self.wpre[:K, q], v + wc * d * pk * g.a)
                self.wsuf[:, q] = np.minimum(self.wsuf[:, q], v + wc * d * pk * (g.bb + (op.load_s if g.j == L else 0.0)))
        self.base = self.wpre[K]
        self.cA = wc * d * (m - 1) * price * (~self.fin)
        self.cB = wc * d * (m - 1) * price
        self.const = wt * (o + plat.iteration_overhead_s) + wc * pt * global_transitions(1)
        self.ends = [np.nonzero(self.J == n)[0] for n in range(L + 1)]
        self.starts = [np.nonzero(self.I == n)[0] for n in range(L + 1)]
        self.va = np.unique(self.A[~self.fin])
        self.vb = np.unique(self.B)

    # -- bands ------------------------------------------------------------------------------------
    def grid(self, n: int) -> tuple[np.ndarray, ...]:
        """An n x n grid of band pairs at quantiles of the candidate values (covers everything)."""

        def cuts(vals: np.ndarray) -> np.ndarray:
            if len(vals) == 0:
                return np.array([0.0, 0.0])
            qs = np.quantile(vals, np.linspace(0, 1, n + 1)[1:], method="lower")
            return np.unique(np.concatenate([[0.0], qs, [vals.max()]]))

        ca, cb = cuts(self.va), cuts(self.vb)
        pairs = [(ca[x], ca[x + 1], cb[y], cb[y + 1]) for x in range(len(ca) - 1) for y in range(len(cb) - 1)]
        return tuple(np.array(v) for v in zip(*pairs))

    @staticmethod
    def _low(vals: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The least candidate value in (lo, hi] (0 where lo = 0: the band includes 0), and
        whether the band holds any value at all."""
        pos = np.searchsorted(vals, lo, side="right")
        val = vals[np.minimum(pos, len(vals) - 1)] if len(vals) else np.zeros(len(lo))
        nonempty = (pos < len(vals)) & (val <= hi) if len(vals) else np.zeros(len(lo), bool)
        zero = lo <= 0
        return np.where(zero, 0.0, val), zero | nonempty

    def _setup(self, P: tuple[np.ndarray, ...]) -> None:
        aLo, aHi, bLo, bHi = P
        A, B, fin = self.A, self.B, self.fin
        self.allow = (fin[None, :] | (A[None, :] <= aHi[:, None])) & (B[None, :] <= bHi[:, None])
        self.setsA = (~fin[None, :]) & (A[None, :] > aLo[:, None])
        self.big = B[None, :] > bLo[:, None]
        self.thA, _ = self._low(self.va, aLo, aHi)
        self.thB, _ = self._low(self.vb, bLo, bHi)
        self.payA = self.cA[None, :] * np.maximum(0.0, self.thA[:, None] - A[None, :])
        self.payB = self.cB[None, :] * np.maximum(0.0, self.thB[:, None] - B[None, :])
        self.needA, self.needB = aLo > 0, bLo > 0

    def _sweeps(self, P: tuple[np.ndarray, ...], ctx: bool, prefix: bool = True) -> tuple[np.ndarray | None, np.ndarray]:
        """pre[c, fA, fB, count, pair, node]: cheapest path 0 -> node; sufc[...]: cheapest
        node -> L using at most ``count`` stages, ending with the flags the band requires."""
        self._setup(P)
        wpre = self.wpre if ctx else self.base[None, :]
        wsuf = self.wsuf if ctx else self.base[None, :]
        nP, S1, L = len(P[0]), self.smax + 1, self.L
        inf = np.inf

        def conds(qs: np.ndarray) -> tuple[dict, dict]:
            sA, bg = self.setsA[:, qs], self.big[:, qs]
            return {None: True, "s": sA, "ns": ~sA}, {None: True, "b": bg, "nb": ~bg}

        pre = np.full((wpre.shape[0], 2, 2, S1, nP, L + 1), inf) if prefix else None
        if pre is not None:
            pre[:, 0, 0, 0, :, 0] = 0.0
        for n in range(1, L if prefix else 1):
            assert pre is not None
            qs = self.ends[n]
            if len(qs) == 0:
                continue
            ca, cb = conds(qs)
            al, pA, pB, w = self.allow[:, qs], self.payA[:, qs], self.payB[:, qs], wpre[:, qs][:, None, None, :]
            Pin = pre[..., self.I[qs]]
            X = [[Pin[:, fa, fb, :-1] + w for fb in (0, 1)] for fa in (0, 1)]
            out = np.full(pre.shape[:-1], inf)
            for fa, fb, fa2, fb2, cA, cB, pa, pb in _TRANS:
                add = np.where(ca[cA] & cb[cB] & al, (pA if pa else 0.0) + (pB if pb else 0.0), inf)
                v = (X[fa][fb] + add[None, None]).min(axis=-1)
                out[:, fa2, fb2, 1:] = np.minimum(out[:, fa2, fb2, 1:], v)
            pre[..., n] = out
        suf = np.full((wsuf.shape[0], 2, 2, S1, nP, L + 1), inf)
        for fa in (0, 1):
            for fb in (0, 1):
                ok = np.ones(nP, bool)
                if fa == 0:
                    ok &= ~self.needA
                if fb == 0:
                    ok &= ~self.needB
                suf[:, fa, fb, 0, ok, L] = 0.0
        for n in range(L - 1, -1, -1):
            qs = self.starts[n]
            if len(qs) == 0:
                continue
            ca, cb = conds(qs)
            al, pA, pB, w = self.allow[:, qs], self.payA[:, qs], self.payB[:, qs], wsuf[:, qs][:, None, None, :]
            Sa = suf[..., self.J[qs]]
            X = [[Sa[:, fa2, fb2, :-1] + w for fb2 in (0, 1)] for fa2 in (0, 1)]
            out = np.full(suf.shape[:-1], inf)
            for fa, fb, fa2, fb2, cA, cB, pa, pb in _TRANS:
                add = np.where(ca[cA] & cb[cB] & al, (pA if pa else 0.0) + (pB if pb else 0.0), inf)
                v = (X[fa2][fb2] + add[None, None]).min(axis=-1)
                out[:, fa, fb, 1:] = np.minimum(out[:, fa, fb, 1:], v)
            suf[..., n] = out
        return pre, np.minimum.accumulate(suf, axis=3)

    def _band_const(self) -> np.ndarray:
        return self.wt * (self.m - 1) * (self.thA + self.thB) + self.const

    def pair_bounds(self, P: tuple[np.ndarray, ...]) -> np.ndarray:
        """A lower bound of every plan whose maxima fall in each band pair."""
        _, sufc = self._sweeps(P, ctx=False, prefix=False)
        return sufc[0, 0, 0, self.smax, :, 0] + self._band_const()

    def _split(self, vals: np.ndarray, lo: float, hi: float) -> list[tuple[float, float]]:
        inside = vals[(vals > lo) & (vals <= hi)]
        if len(inside) <= 1:
            return [(lo, hi)]
        mid = float(inside[(len(inside) - 1) // 2])
        return [(lo, hi)] if mid >= hi else [(lo, mid), (mid, hi)]

    def refine(self, P: tuple[np.ndarray, ...], cutoff: float, rounds: int = 8, budget: int = 600) -> tuple[np.ndarray, ...]:
        """Discard the band pairs that cannot beat ``cutoff`` and split the others, repeatedly."""
        for _ in range(rounds):
            keep = self.pair_bounds(P) <= cutoff
            P = tuple(v[keep] for v in P)
            new = [
                (al, ah, bl, bh)
                for p in range(len(P[0]))
                for al, ah in self._split(self.va, P[0][p], P[1][p])
                for bl, bh in self._split(self.vb, P[2][p], P[3][p])
            ]
            if len(new) > budget or len(new) == len(P[0]):
                break
            P = tuple(np.array(v) for v in zip(*new)) if new else P
        keep = self.pair_bounds(P) <= cutoff
        return tuple(v[keep] for v in P)

    def group_bounds(self, P: tuple[np.ndarray, ...], ctx: bool = True, per_pair: bool = False) -> np.ndarray:
        """Per group: a lower bound of the objective of every plan that uses it (inf if none
        falls in the given band pairs); ``per_pair``: one row per pair instead of their minimum."""
        G = len(self.I)
        if len(P[0]) == 0:
            return np.full((0, G), np.inf) if per_pair else np.full(G, np.inf)
        pre, sufc = self._sweeps(P, ctx)
        cpre = np.where(self.fin, self.K, self.Kg) if ctx else np.zeros(G, int)
        csuf = self.Kg if ctx else np.zeros(G, int)
        Pg = np.moveaxis(pre[cpre, :, :, :, :, self.I], 0, -1)  # (2, 2, S1, pairs, G)
        Sg = np.moveaxis(sufc[csuf, :, :, :, :, self.J], 0, -1)
        ca = {None: True, "s": self.setsA, "ns": ~self.setsA}
        cb = {None: True, "b": self.big, "nb": ~self.big}
        best = np.full((len(P[0]), G), np.inf)
        for fa, fb, fa2, fb2, cA, cB, pa, pb in _TRANS:
            add = np.where(ca[cA] & cb[cB], (self.payA if pa else 0.0) + (self.payB if pb else 0.0), np.inf)
            for cp in range(self.smax):
                best = np.minimum(best, Pg[fa, fb, cp] + Sg[fa2, fb2, self.smax - 1 - cp] + add)
        best = np.where(self.allow, best, np.inf) + self.selfw[None, :]
        a0 = np.where(self.fin, 0.0, self.A)
        bott = self.wt * (self.m - 1) * (np.maximum(self.thA[:, None], a0[None, :]) + np.maximum(self.thB[:, None], self.B[None, :]))
        out = best + bott + self.const
        return out if per_pair else out.min(axis=0)


# -- the MILP over a set of groups ----------------------------------------------------------------
@dataclass
class _Solved:
    config: Config | None
    objective: float
    status: str  # "optimal", "time_limit", "infeasible" (nothing below the cutoff), or HiGHS's word
    variables: int
    constraints: int


def _milp(
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
) -> _Solved:
    """Build and solve the path MILP over ``groups`` (module docstring, step 3)."""
    L, d, b, m = cands.layers, cands.replicas, cands.micro_batch, cands.micro_batches
    o, maxT = phase_overhead(plat, d), plat.max_predicted_task_s
    if any(not any(g.i <= l < g.j for g in groups) for l in range(L)):
        return _Solved(None, math.inf, "infeasible", 0, 0)
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
        acc: dict = {}
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
    cost_terms: list = []
    for q, g in enumerate(groups):
        cost_terms += [(v, op.own_cost) for v, op in zip(x[q], g.options)]
        cost_terms += [(var, d * g.price * c) for var, c in BTexpr[q].items()]
        if q in Fexpr:
            cost_terms += [(var, d * g.price * c) for var, c in Fexpr[q].items()]
    pt = plat.price_transition
    cost = E(cost_terms, pt * global_transitions(2)) - pt * (global_transitions(2) - global_transitions(1)) * single
    ref = max(1e-12, wc * 1e-4 + wt)  # scale the objective to O(1e4) for HiGHS's tolerances
    prob += (wc * cost + wt * (TF + TBS + plat.iteration_overhead_s)) * (1.0 / ref)
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
        return _Solved(None, pulp.value(prob.objective) * ref if ms == "optimal" else math.inf, ms, nvars, ncons)
    if pulp.LpStatus[status] != "Optimal":
        proven_empty = ms in ("infeasible", "objective bound")  # nothing better than the cutoff exists
        return _Solved(None, math.inf, "infeasible" if proven_empty else ms, nvars, ncons)
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
    return _Solved(cfg, pulp.value(prob.objective) * ref, "optimal" if ms == "optimal" else "time_limit", nvars, ncons)


# -- a heuristic incumbent -------------------------------------------------------------------------
def path_estimate(cands: Candidates, path: Sequence[tuple[Group, SyncOption]], plat: Platform) -> Estimate:
    """``perfmodel.compose`` of a path of (group, option): the model's exact prediction."""
    cfg = Config(
        tuple(g.j - g.i for g, _ in path),
        tuple(g.tier for g, _ in path),
        cands.replicas,
        cands.micro_batch,
        cands.micro_batches,
        tuple(op.choice for _, op in path),
    )
    return compose(cfg, [op.terms for _, op in path], plat)


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
    remaining = lambda: max(0.5, deadline - time.perf_counter())
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
    cut = lambda: best * (1 + REL_TOL) + 1e-9
    milps: list[dict[str, Any]] = []
    info["milps"] = milps
    proven = True
    last = _Solved(None, math.inf, "none", 0, 0)

    def run(qs: Sequence[int], floors: tuple[float, float] = (0.0, 0.0), tag: str = "") -> None:
        nonlocal best, best_cfg, proven, last
        tm = time.perf_counter()
        sol = _milp(
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
        qs = set(_prefix_with_path(alive, groups, L, smax, size))
        if best_cfg is not None:
            want = _config_groups(best_cfg, cands)
            qs |= {q for q in alive if (groups[q].i, groups[q].j, groups[q].k) in want}
        before = best
        run(sorted(qs), tag="promising")
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
        kept = set(qs)  # type: ignore[no-redef]
        if qs and _min_stages([groups[q] for q in qs], L) <= smax:
            run(qs, tag="all")
        order: Sequence[int] = []
    else:
        pair_lb = bounds.pair_bounds(pairs) if len(pairs[0]) else np.zeros(0)
        thA, thB = bounds.thA.copy(), bounds.thB.copy()
        info["band_pairs"] = len(pairs[0])
        kept: set[int] = set()
        order = [int(p) for p in np.argsort(pair_lb, kind="stable")]
    for p in order:
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
            s = _milp(candidates, groups, plat, wc, wt, smax, time_limit, gap, threads, None, relax=relax)
            return MilpResult(
                s.config, s.objective, s.status, time.perf_counter() - t0, s.variables, s.constraints, candidates.size, len(groups)
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
